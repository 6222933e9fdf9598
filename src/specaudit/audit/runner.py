"""Running the audit's sections and writing its report.

The section list is explicit (`specaudit.audit.sections.SECTIONS`): a section that is renamed
or removed is a change to that list, never a silent gap in the report. A section that raises
is recorded as NO_DECISION with its error, and the sections after it still run.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specaudit import llama
from specaudit.audit.context import AuditContext, EnsureFn, ProgressFn, Section
from specaudit.audit.sections import SECTIONS, SectionFn
from specaudit.outcome import Outcome
from specaudit.report import to_jsonable


@dataclass
class AuditReport:
    out_dir: Path
    sections: list[Section]
    started: str
    seconds: float
    binaries: dict[str, str]

    @property
    def errors(self) -> list[Section]:
        return [s for s in self.sections if s.error is not None]

    @property
    def exit_code(self) -> int:
        """0 when every section ran (its findings are in the report), 2 when one could not."""
        return (Outcome.NO_DECISION if self.errors else Outcome.OK).exit_code


def select(
    only: tuple[str, ...] = (), sections: tuple[tuple[str, SectionFn], ...] = SECTIONS
) -> list[tuple[str, SectionFn]]:
    """The sections to run, in report order; an unknown key in `only` is an error."""
    from specaudit.errors import SpecauditError

    keys = [k for k, _ in sections]
    unknown = [k for k in only if k not in keys]
    if unknown:
        raise SpecauditError(f"unknown section {', '.join(unknown)}; choose from {', '.join(keys)}")
    return [(k, f) for k, f in sections if not only or k in only]


def run_section(key: str, fn: SectionFn, ctx: AuditContext) -> Section:
    """One section; an exception becomes a NO_DECISION section that carries the error."""
    try:
        return fn(ctx)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # a broken section must not hide the others
        msg = " ".join(str(e).split()) or type(e).__name__
        return Section(
            key=key,
            title=key,
            markdown=f"**error**: {msg}\n\n```\n{traceback.format_exc()[-2000:]}\n```",
            status=Outcome.NO_DECISION,
            summary=f"error: {msg}",
            error=msg,
        )


def run(
    out_dir: Path,
    build: int = llama.DEFAULT_BUILD,
    only: tuple[str, ...] = (),
    progress: ProgressFn | None = None,
    ensure_bins: EnsureFn | None = None,
    sections: tuple[tuple[str, SectionFn], ...] = SECTIONS,
) -> AuditReport:
    """Run every section (or `only` those keys) and write report.md / report.json.

    `out_dir` is created and checked writable first: a one-line error, before any section.
    """
    from specaudit import validate

    chosen = select(only, sections)
    out_dir = validate.writable_dir(out_dir, "--out")
    say = progress or (lambda m: None)
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    done: list[Section] = []
    with AuditContext(out_dir, build, progress, ensure_bins) as ctx:
        for key, fn in chosen:
            say(f"section {key}")
            done.append(run_section(key, fn, ctx))
        bins = ctx.binaries_used
    report = AuditReport(out_dir, done, started, time.monotonic() - t0, bins)
    write(report)
    return report


def _status(s: Section) -> str:
    return "error" if s.error is not None else s.status.value


def to_markdown(report: AuditReport) -> str:
    lines = [
        "# specaudit report",
        "",
        f"Started {report.started}, took {report.seconds:.0f} s. Binaries: "
        + ", ".join(f"{k}: `{v}`" for k, v in report.binaries.items()),
        "",
        "| section | status | summary |",
        "|---|---|---|",
    ]
    lines += [f"| {s.key} | {_status(s)} | {s.summary} |" for s in report.sections]
    for s in report.sections:
        lines += ["", f"## {s.title}", "", s.markdown]
        for p in s.plots:
            rel = p.relative_to(report.out_dir) if p.is_relative_to(report.out_dir) else p
            if f"]({rel})" not in s.markdown:  # a section may place its plot in its own text
                lines += ["", f"![{p.stem}]({rel})"]
    return "\n".join(lines) + "\n"


def to_json(report: AuditReport) -> dict[str, Any]:
    return {
        "started": report.started,
        "seconds": report.seconds,
        "binaries": report.binaries,
        "sections": [
            {
                "key": s.key,
                "title": s.title,
                "status": _status(s),
                "outcome": s.status.value,
                "error": s.error,
                "summary": s.summary,
                "plots": [str(p) for p in s.plots],
                "data": to_jsonable(s.data),
            }
            for s in report.sections
        ],
    }


def write(report: AuditReport) -> None:
    (report.out_dir / "report.md").write_text(to_markdown(report))
    (report.out_dir / "report.json").write_text(json.dumps(to_json(report), indent=2))


__all__ = ["AuditReport", "run", "run_section", "select", "to_json", "to_markdown", "write"]
