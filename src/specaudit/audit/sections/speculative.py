"""The audit's speculative section: llama.cpp's llama-speculative example, stock vs fixed
(`speculative-fix`, #29975), by `dist` on both fixtures and two prompts.

The measuring lives next to the other fix's proof (`patched.example_pairs`); this module is
the audit's entry for it, so the patched section stays quick enough to test on its own.
"""

from __future__ import annotations

from specaudit.audit.context import AuditContext, Section
from specaudit.audit.sections import patched


def section(ctx: AuditContext) -> Section:
    """Stock vs fixed llama-speculative, 1000 seeds each (`patched.example_pairs`)."""
    return patched.fix_section(ctx, patched.example_pairs(ctx))


__all__ = ["section"]
