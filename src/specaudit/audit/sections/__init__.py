"""The audit's sections, in report order: one module per capability, each with
``section(ctx) -> Section``. This list is the whole truth about what the audit runs."""

from __future__ import annotations

from collections.abc import Callable

from specaudit.audit.context import AuditContext, Section
from specaudit.audit.sections import (
    ab,
    check,
    dist,
    engines,
    model,
    patched,
    proxy,
    replay,
    servers,
    speculative,
    vllm,
)

SectionFn = Callable[[AuditContext], Section]

SECTIONS: tuple[tuple[str, SectionFn], ...] = (
    ("servers", servers.section),
    ("check", check.section),
    ("ab", ab.section),
    ("dist", dist.section),
    ("engines", engines.section),
    ("proxy", proxy.section),
    ("patched", patched.section),
    ("model", model.section),
    ("speculative", speculative.section),
    ("replay", replay.section),
    ("vllm", vllm.section),
)

__all__ = ["SECTIONS", "SectionFn"]
