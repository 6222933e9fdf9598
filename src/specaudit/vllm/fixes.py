"""specaudit's fixes of vLLM bugs it found, applied to a server it starts without touching the
env: ``specaudit/patches/vllm/`` goes on the server's PYTHONPATH, where its ``sitecustomize.py``
imports, in every process of the server, the fix modules ``SPECAUDIT_VLLM_FIXES`` names
(``fix_<name>.py``).

Why not patch the env's files: the env is shared by every run and built once; a fix that lives
beside it keeps stock and fixed servers on the same install, side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specaudit.errors import SpecauditError

ROOT = Path(__file__).resolve().parents[1] / "patches" / "vllm"


@dataclass(frozen=True)
class VllmFix:
    """A fix: its name on the command line (its module is ``fix_<name>``), what it fixes."""

    name: str
    summary: str

    @property
    def path(self) -> Path:
        return ROOT / f"fix_{self.name.replace('-', '_')}.py"


FIXES = {
    f.name: f
    for f in (
        VllmFix(
            "cpu-sampler",
            "the CPU rejection sampler's per-draft-token temperature, top-k and top-p read from "
            "uninitialised memory (expand_kernel's CPU stand-in), and its top-k crash on a step "
            "without draft tokens (docs/upstream/vllm-cpu-expand-kernel.md)",
        ),
    )
}


def resolve(names: tuple[str, ...] | list[str]) -> tuple[VllmFix, ...]:
    """The fixes of these names, in order; a one-line error for an unknown one."""
    out = []
    for n in dict.fromkeys(names):
        if n not in FIXES:
            raise SpecauditError(f"unknown vLLM fix {n!r} (one of {', '.join(FIXES)})")
        out.append(FIXES[n])
    return tuple(out)


def environ(fixes: tuple[VllmFix, ...]) -> dict[str, str]:
    """What a server's environment needs to load `fixes` in every process (nothing for none)."""
    if not fixes:
        return {}
    return {"PYTHONPATH": str(ROOT), "SPECAUDIT_VLLM_FIXES": ",".join(f.name for f in fixes)}


__all__ = ["FIXES", "ROOT", "VllmFix", "environ", "resolve"]
