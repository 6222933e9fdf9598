"""`specaudit audit`: everything on built-in defaults, one report.

It provisions llama.cpp, builds the fixtures, assembles Gemma 3 270M, starts the servers each
section needs (once, shared by all sections) and runs the sections in order. Each capability
module contributes a section through ``audit_section(ctx) -> Section``; a section that fails is
recorded as an error and the others still run, so one broken piece never hides the rest.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specaudit import llama
from specaudit.client import Client
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer
from specaudit.report import md_table, to_jsonable

# Capability modules whose audit_section() runs after the server table, in this order.
SECTION_MODULES = ("check", "ab", "dist", "proxy", "patched")

ProgressFn = Callable[[str], None]


@dataclass
class Section:
    key: str
    title: str
    markdown: str  # the section body, already rendered (tables, verdict lines, plot links)
    data: dict[str, Any] = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)
    status: str = "ok"  # "ok", "finding" (the audit found the fault it looks for), "error"
    summary: str = ""  # one line for the console


@dataclass(frozen=True)
class ServerSpec:
    """A named server configuration the audit (and its sections) can ask for."""

    name: str
    model: str  # "fixture" or "gemma"
    speculative: bool
    variant: str = "stock"  # or "patched"
    spec_type: str = "draft-simple"


SERVERS = {
    s.name: s
    for s in (
        ServerSpec("fixture-plain", "fixture", False),
        ServerSpec("fixture-spec", "fixture", True),
        ServerSpec("gemma-plain", "gemma", False),
        ServerSpec("gemma-spec", "gemma", True),
        ServerSpec("fixture-spec-patched", "fixture", True, "patched"),
        ServerSpec("gemma-spec-patched", "gemma", True, "patched"),
        ServerSpec("gemma-ngram", "gemma", True, spec_type="ngram-mod"),
    )
}

PATCH = "spec-logprobs"


class AuditContext:
    """Shared state of one audit run: binaries, models, servers started on demand."""

    def __init__(
        self,
        out_dir: Path,
        build: int = llama.DEFAULT_BUILD,
        progress: ProgressFn | None = None,
        ensure_bins: Callable[[int, tuple[str, ...]], LlamaBinaries] | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.build = build
        self.progress = progress or (lambda msg: None)
        self._ensure_bins = ensure_bins or (lambda b, p: llama.ensure(b, p))
        self._stack = contextlib.ExitStack()
        self._servers: dict[str, LlamaServer] = {}
        self._bins: dict[str, LlamaBinaries] = {}
        self._fixture: Any = None
        self._gemma: Path | None = None
        self.log_dir = out_dir / "logs"

    # provisioning ---------------------------------------------------------------------

    def binaries(self, variant: str = "stock") -> LlamaBinaries:
        if variant not in self._bins:
            patches = (PATCH,) if variant == "patched" else ()
            self.progress(f"llama.cpp b{self.build} {variant}")
            self._bins[variant] = self._ensure_bins(self.build, patches)
        return self._bins[variant]

    @property
    def fixture(self) -> Any:
        """The default fixture set (`specaudit.fixtures.FixtureSet`), built once."""
        if self._fixture is None:
            from specaudit import fixtures

            self.progress("building fixtures")
            self._fixture = fixtures.build(self.out_dir / "fixtures")
        return self._fixture

    @property
    def gemma(self) -> Path:
        if self._gemma is None:
            from specaudit.models import gemma_270m

            self.progress("assembling Gemma 3 270M")
            self._gemma = gemma_270m().path
        return self._gemma

    def model_path(self, model: str) -> Path:
        return Path(self.fixture.target) if model == "fixture" else self.gemma

    def draft_path(self, model: str) -> Path:
        return Path(self.fixture.draft) if model == "fixture" else self.gemma

    def server(self, name: str) -> LlamaServer:
        """The named server, started on first use and stopped when the audit ends."""
        if name in self._servers:
            return self._servers[name]
        spec = SERVERS[name]
        bins = self.binaries(spec.variant)
        self.progress(f"starting {name}")
        uses_draft = spec.speculative and spec.spec_type.startswith("draft")
        srv = LlamaServer(
            bins,
            self.model_path(spec.model),
            draft=self.draft_path(spec.model) if uses_draft else None,
            spec_type=spec.spec_type if spec.speculative else None,
            parallel=4 if spec.model == "fixture" else 2,
            ctx_size=1024 if spec.model == "fixture" else 4096,
            # One thread per fixture server: a tiny model gains nothing from more, and with
            # several servers on few cores extra threads cost 2-6x throughput.
            extra_args=["-t", "1"] if spec.model == "fixture" else [],
            log_path=self.log_dir / f"{name}.log",
            name=name,
        )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._stack.enter_context(srv)
        self._servers[name] = srv
        return srv

    def close(self) -> None:
        self._stack.close()
        self._servers.clear()

    def __enter__(self) -> AuditContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# the server table (this module's own section)


@dataclass
class ServerRow:
    name: str
    model: str
    draft: str | None
    spec_type: str | None
    binaries: str
    slots_total: int | None
    slots_speculative: int | None
    props_spec_types: str | None
    verdict: str


def describe_server(name: str, srv: LlamaServer) -> ServerRow:
    """What /slots and /props say about whether `srv` speculates."""
    with Client(srv.url, timeout=30) as c:
        slots = c.slots()
        props = c.props()
    n_spec = sum(bool(s.get("speculative")) for s in slots) if slots is not None else None
    types = None
    if props is not None:
        params = (props.get("default_generation_settings") or {}).get("params") or {}
        t = params.get("speculative.types", params.get("speculative.type"))
        types = t if isinstance(t, str) else (json.dumps(t) if t is not None else None)
    claims_none = types in (None, "none", "[]", '["none"]')
    if n_spec is None:
        verdict = "unknown: no /slots"
    elif n_spec and claims_none:
        verdict = f"hidden: /props says {types}, /slots says {n_spec}/{len(slots or [])} speculate"
    elif n_spec:
        verdict = "speculates (both agree)"
    else:
        verdict = "does not speculate"
    return ServerRow(
        name=name,
        model=srv.model.name,
        draft=srv.draft.name if srv.draft else None,
        spec_type=srv.spec_type,
        binaries=srv.binaries.label,
        slots_total=len(slots) if slots is not None else None,
        slots_speculative=n_spec,
        props_spec_types=types,
        verdict=verdict,
    )


def servers_section(ctx: AuditContext) -> Section:
    rows = [
        describe_server(n, ctx.server(n))
        for n in ("fixture-plain", "fixture-spec", "gemma-plain", "gemma-spec")
    ]
    headers = [
        "server",
        "model",
        "draft",
        "--spec-type",
        "/slots speculative",
        "/props speculative.types",
        "verdict",
    ]
    md = [
        md_table(
            headers,
            [
                (
                    r.name,
                    r.model,
                    r.draft,
                    r.spec_type,
                    f"{r.slots_speculative}/{r.slots_total}",
                    r.props_spec_types,
                    r.verdict,
                )
                for r in rows
            ],
        )
    ]
    hidden = [r for r in rows if r.verdict.startswith("hidden")]
    md.append("")
    md.append(
        f"{len(hidden)} of {len(rows)} servers speculate while /props claims they don't; "
        "read /slots, not /props."
        if hidden
        else "No server hides its speculation."
    )
    return Section(
        key="servers",
        title="Servers: does /props tell the truth about speculation?",
        markdown="\n".join(md),
        data={"servers": [r.__dict__ for r in rows]},
        status="finding" if hidden else "ok",
        summary=f"{len(hidden)}/{len(rows)} servers hide that they speculate",
    )


# ---------------------------------------------------------------------------------------------
# running


@dataclass
class AuditReport:
    out_dir: Path
    sections: list[Section]
    started: str
    seconds: float
    binaries: dict[str, str]

    @property
    def errors(self) -> list[Section]:
        return [s for s in self.sections if s.status == "error"]


def section_functions(
    only: tuple[str, ...] = (),
) -> list[tuple[str, Callable[[AuditContext], Section]]]:
    fns: list[tuple[str, Callable[[AuditContext], Section]]] = [("servers", servers_section)]
    for name in SECTION_MODULES:
        try:
            mod = importlib.import_module(f"specaudit.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"specaudit.{name}":
                raise
            continue
        fn = getattr(mod, "audit_section", None)
        if fn is not None:
            fns.append((name, fn))
    if only:
        fns = [(k, f) for k, f in fns if k in only]
    return fns


def run(
    out_dir: Path,
    build: int = llama.DEFAULT_BUILD,
    only: tuple[str, ...] = (),
    progress: ProgressFn | None = None,
    ensure_bins: Callable[[int, tuple[str, ...]], LlamaBinaries] | None = None,
) -> AuditReport:
    """Run every section (or `only` those keys) and write report.md / report.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    sections: list[Section] = []
    with AuditContext(out_dir, build, progress, ensure_bins) as ctx:
        for key, fn in section_functions(only):
            (progress or (lambda m: None))(f"section {key}")
            try:
                sections.append(fn(ctx))
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:  # a broken section must not hide the others
                msg = " ".join(str(e).split()) or type(e).__name__
                sections.append(
                    Section(
                        key=key,
                        title=key,
                        markdown=f"**error**: {msg}\n\n```\n{traceback.format_exc()[-2000:]}\n```",
                        status="error",
                        summary=f"error: {msg}",
                    )
                )
        bins = {k: str(v.bin_dir) for k, v in ctx._bins.items()}
    report = AuditReport(out_dir, sections, started, time.monotonic() - t0, bins)
    write(report)
    return report


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
    lines += [f"| {s.key} | {s.status} | {s.summary} |" for s in report.sections]
    for s in report.sections:
        lines += ["", f"## {s.title}", "", s.markdown]
        for p in s.plots:
            rel = p.relative_to(report.out_dir) if p.is_relative_to(report.out_dir) else p
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
                "status": s.status,
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


__all__ = [
    "AuditContext",
    "AuditReport",
    "Section",
    "ServerRow",
    "describe_server",
    "run",
]
