"""The audit's replay section: llama-server's probabilistic checkpoint replay on the replay
fixture, stock vs fixed (`replay-fix`), by `dist` at 8 tokens and 15000 seeds.

The measuring lives next to the other fixes' proofs (`patched.replay_pair`); this module is the
audit's entry for it, so it can be run (``--only replay``) or left out on its own.
"""

from __future__ import annotations

from specaudit.audit.context import AuditContext, Section
from specaudit.audit.sections import patched


def section(ctx: AuditContext) -> Section:
    """Stock vs fixed `replay-rejection` (`patched.replay_pair`)."""
    return patched.replay_section(ctx, patched.replay_pair(ctx))


__all__ = ["section"]
