"""The audit's speculative section: llama.cpp's llama-speculative example, stock vs fixed
(`speculative-fix`, #29975), by `dist` on both fixtures and two prompts.

The measuring lives next to the other fix's proof (`patched.example_pairs`); this module is
the audit's entry for it, so the patched section stays quick enough to test on its own.
"""

from __future__ import annotations

from specaudit.audit.context import AuditContext, Section
from specaudit.audit.sections import patched


def section(ctx: AuditContext) -> Section:
    """Stock vs fixed llama-speculative (`patched.example_pairs`): the fixed example on 1000
    seeds; the stock one sequentially (at most 1000), which stops once its bias is proven."""
    return patched.fix_section(ctx, patched.example_pairs(ctx, stock_sequential=True))


__all__ = ["section"]
