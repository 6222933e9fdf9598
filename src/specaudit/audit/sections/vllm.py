"""The audit's vLLM section: vLLM's CPU build, stock and with specaudit's fix, on both fixtures
(closed-form truth) and on Gemma 3 270M (re-scored against a plain llama-server of the same
float32 numbers).

Why a section of its own: every vLLM server costs a minute or more to start, so each server
here is started once and sampled at both sampler settings through `dist --vllm-url` (its
probabilities checked against the closed form first), then stopped. The settings are the two
faces of the bug docs/upstream/vllm-cpu-expand-kernel.md explains: at top-k 0 and top-p 0.8
the stock n-gram server samples tokens its sampler forbids (BROKEN); with top-k on it crashes
(a clear line, not a verdict). The fixed server must be PRESERVED at both. Suffix decoding
(Arctic Inference's suffix trees; the env builds it) and EAGLE-1 (a head built on the exported
target) verify through the same sampler, on the last-token fixture. On Gemma, vLLM
drafts by n-gram lookup on prompts that repeat themselves (so it drafts and rejects often;
vLLM 0.32 refuses Gemma 3 as its own ``draft_model``: its sliding and full attention layers
are two KV cache groups), and every token is re-scored (`rescore --engine vllm`) against
llama-server serving the GGUF dequantised to float32 (`model_export`): no closed form, and the
reference is not vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specaudit import distribution, model_export, rescore
from specaudit.audit.context import AuditContext, Section
from specaudit.distribution import vllm as dv
from specaudit.distribution.results import DistError
from specaudit.fixtures import FixtureSet, SamplerSettings
from specaudit.outcome import Outcome
from specaudit.reference import start_reference
from specaudit.report import md_table
from specaudit.rescore import render
from specaudit.rescore.records import RescoreError

FIX = "cpu-sampler"
# (label, sampler): the bug's two faces (module doc)
SAMPLERS: tuple[tuple[str, SamplerSettings], ...] = (
    ("top-k 0, top-p 0.8, T 1", SamplerSettings(top_k=0, top_p=0.8, min_p=0.0, temperature=1.0)),
    ("top-k 3, T 0.7", SamplerSettings(top_k=3, top_p=1.0, min_p=0.0, temperature=0.7)),
)
# (method, fixed): the servers started on each fixture
SERVERS: tuple[tuple[str, bool], ...] = (("plain", False), ("ngram", False), ("ngram", True))
# suffix decoding drafts from suffix trees of the context (Arctic Inference's) and shares
# n-gram's verification; its servers run on the last-token fixture alone (each start costs
# a minute or more, and the context fixture adds nothing to a sampler shared with n-gram)
SUFFIX_SERVERS: tuple[tuple[str, bool], ...] = (("suffix", False), ("suffix", True))
# EAGLE-1, EAGLE3, DFlash and Medusa draft from heads built on the exported target, MTP from
# the layer of the target exported as a MiMo (`fixtures.hf_heads.HEADS`); last-token fixture
# alone, as suffix (same sampler, a minute or more per start)
EAGLE_SERVERS: tuple[tuple[str, bool], ...] = (
    ("eagle", False), ("eagle", True), ("eagle3", False), ("eagle3", True),
    ("mtp", False), ("mtp", True), ("dflash", False), ("dflash", True),
    ("medusa", False), ("medusa", True),
)  # fmt: skip
# seeds of each fixture run (fixed N: at 1000 the fixed server certifies dist's 0.15
# tolerance at both settings; the stock server's forbidden tokens come within a few dozen)
SEEDS = 1000
# seeds per Gemma prompt: at 45 (810 tokens) the fixed server was INCONCLUSIVE, its
# repeated-prefix TV bound 0.184 over the 0.15 tolerance, about 1,240 tokens to decide
GEMMA_SEEDS = 80
GEMMA_SAMPLER = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=1.0)
# prompts whose continuation repeats the prompt: n-gram lookup drafts at most steps
GEMMA_PROMPTS = (
    "apple, banana, cherry, apple, banana, cherry, apple, banana,",
    "1 2 3 4 5 1 2 3 4 5 1 2 3",
    "red green blue red green blue red",
)
CRASH = "crash"
HEADERS = ("fixture", "server", "sampler", "verdict", "samples", "drafted", "accepted", "why")


@dataclass
class VllmRow:
    """One (fixture, server, sampler) run: a verdict, or the crash that ended it."""

    fixture: str
    server: str
    sampler: str
    verdict: str
    samples: int = 0
    drafted: int | None = None
    accepted: int | None = None
    why: str = ""

    def cells(self) -> list[Any]:
        def n(x: int | None) -> Any:
            return "-" if x is None else x

        return [self.fixture, self.server, self.sampler, self.verdict, self.samples,
                n(self.drafted), n(self.accepted), self.why]  # fmt: skip


@dataclass
class GemmaRun:
    """vLLM on Gemma, stock or fixed, re-scored."""

    server: str
    result: rescore.RescoreResult | None  # None: refused before sampling
    why: str = ""  # the engine's root cause when it failed
    plot: Path | None = None

    @property
    def verdict(self) -> str:
        s = self.result.stats if self.result is not None else None
        if s is not None:
            return s.verdict.value
        return CRASH if self.why else "no decision"


@dataclass
class VllmReport:
    rows: list[VllmRow] = field(default_factory=list)
    gemma: list[GemmaRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def server_name(method: str, fixed: bool) -> str:
    return f"{method} + {FIX} fix" if fixed else f"{method} (stock)"


@contextlib.contextmanager
def _server(
    ctx: AuditContext, model: Path, speculative: dict[str, Any] | None, fixed: bool, name: str,
    **args: Any,
) -> Iterator[Any]:  # fmt: skip
    from specaudit.vllm.env import ensure_env
    from specaudit.vllm.fixes import resolve
    from specaudit.vllm.server import VllmServer

    ctx.log_dir.mkdir(parents=True, exist_ok=True)
    srv = VllmServer(
        ensure_env(), model, speculative=speculative, fixes=resolve([FIX] if fixed else []),
        log_path=ctx.log_dir / f"vllm-{name}.log", **args,
    )  # fmt: skip
    with srv:
        yield srv


def fixture_rows(
    fs: FixtureSet, name: str, url: str, log: Path | None, *, seeds: int = SEEDS
) -> tuple[list[VllmRow], list[str]]:
    """One running vLLM server of `fs`'s exported target, at each of `SAMPLERS` (`dist
    --vllm-url`, `seeds` each): rows and the truth checks' notes. A crash ends the server's
    rows (a crashed server answers nothing more)."""
    out: list[VllmRow] = []
    notes: list[str] = []
    for label, sampler in SAMPLERS:
        if out and out[-1].verdict == CRASH:
            out.append(VllmRow(fs.spec.name, name, label, "not run", why="the server crashed"))
            continue
        try:
            req = distribution.make_request(
                ["vllm"], fixture=fs, seeds=seeds, sampler=sampler,
                vllm_urls=(f"audit={url}",),
            )  # fmt: skip
            res = distribution.run(req)
        except DistError as e:
            why = str(e) if log is None else f"{e} [{dv.root_cause(log)}]"
            out.append(VllmRow(fs.spec.name, name, label, CRASH, why=why))
            continue
        notes += [f"{fs.spec.name}, {name}, {label}: {n}" for n in res.notes]
        for eng in res.engines:
            out.append(
                VllmRow(fs.spec.name, name, label, eng.verdict.value, eng.n_samples,
                        eng.drafted, eng.accepted, eng.reason)
            )  # fmt: skip
    return out, notes


def run_fixtures(
    ctx: AuditContext,
    fixtures: Sequence[FixtureSet],
    seeds: int,
    servers: Sequence[tuple[str, bool]] = SERVERS,
) -> VllmReport:
    """`servers` (method, fixed) on each fixture, each started once and sampled at every
    setting."""
    from specaudit.fixtures import hf

    report = VllmReport()
    for fs in fixtures:
        work = ctx.out_dir / "vllm-export" / fs.spec.kind
        head = max(dv.MIN_HEAD_SIZE, fs.spec.config.head_dim)
        ex = hf.export_hf(fs, work, head_size=head)
        for method, fixed in servers:
            name = server_name(method, fixed)
            ctx.progress(f"vllm: {name} on {fs.spec.name}")
            spec_cfg = dv.speculative_config(method, ex.draft, dv.head(method, ex))
            key = f"{fs.spec.kind}-{method}{'-fixed' if fixed else ''}"
            served = dv.target(method, ex)
            with _server(ctx, served, spec_cfg, fixed, key, **dv.server_args(fs.spec)) as srv:
                rows, notes = fixture_rows(fs, name, srv.url, srv.log_path, seeds=seeds)
            report.rows += rows
            report.notes += notes
    return report


def run_gemma(
    ctx: AuditContext, *, seeds: int, tokens: int, fixed: Sequence[bool] = (False, True),
    concurrency: int = 4,
) -> list[GemmaRun]:  # fmt: skip
    """vLLM's n-gram drafting on Gemma, stock and fixed, each re-scored at `GEMMA_SAMPLER` on
    `GEMMA_PROMPTS` against a plain llama-server of the float32 GGUF."""
    hf_dir = model_export.gemma_270m_hf()
    f32 = model_export.gemma_270m_f32()
    spec_cfg = dv.speculative_config("ngram", hf_dir)
    out: list[GemmaRun] = []
    with start_reference(f32, parallel=concurrency, ctx_size=256 * concurrency) as ref:
        for fix in fixed:
            name = server_name("ngram", fix)
            ctx.progress(f"vllm: Gemma, {name}")
            key = f"gemma-ngram{'-fixed' if fix else ''}"
            with _server(
                ctx, hf_dir, spec_cfg, fix, key, max_logprobs=20, max_model_len=512,
                startup_timeout=dv.STARTUP_TIMEOUT, kv_cache_gib=2, eager=True,
            ) as srv:  # fmt: skip
                req = rescore.make_request(
                    srv.url, engine="vllm", reference_url=ref, prompts=GEMMA_PROMPTS,
                    seeds=seeds, tokens=tokens,
                    sampler=GEMMA_SAMPLER, concurrency=concurrency, timeout=600.0,
                    label=f"vLLM Gemma, {name}",
                )  # fmt: skip
                res: rescore.RescoreResult | None = None
                try:
                    res = rescore.run(req)
                    failed = res.error
                except RescoreError as e:  # refused before sampling (the probe's request)
                    failed = str(e)
                why = ""
                if failed:
                    why = f"{failed} [{dv.root_cause(srv.log_path)}]" if srv.log_path else failed
                    why = why if srv.alive() else f"the server died: {why}"
            run = GemmaRun(name, res, why)
            if res is not None and res.stats is not None:
                run.plot = render.plot_pit(res, ctx.out_dir / f"rescore-vllm-gemma-{key}.png")
            out.append(run)
    return out


def section(ctx: AuditContext, *, seeds: int = SEEDS, gemma_seeds: int = GEMMA_SEEDS) -> Section:
    """The vLLM section (see the module doc). `gemma_seeds` per prompt (3 prompts, 6 tokens)."""
    report = run_fixtures(ctx, (ctx.fixture, ctx.context_fixture), seeds)
    for servers in (SUFFIX_SERVERS, EAGLE_SERVERS):
        more = run_fixtures(ctx, (ctx.fixture,), seeds, servers=servers)
        report.rows += more.rows
        report.notes += more.notes
    report.gemma = run_gemma(ctx, seeds=gemma_seeds, tokens=6)
    return render_section(report)


def render_section(report: VllmReport) -> Section:
    from specaudit.vllm.env import VERSION

    gemma_rows = []
    for g in report.gemma:
        r = g.result
        s = r.stats if r is not None else None
        gemma_rows.append([
            g.server, g.verdict, len(r.samples) if r else 0, r.rescored if r else 0,
            "-" if r is None or r.drafted is None else r.drafted,
            "-" if r is None or r.accepted is None else r.accepted,
            s.reason if s is not None else g.why,
        ])  # fmt: skip
    md = [
        f"vLLM {VERSION} (CPU build), stock and with specaudit's `{FIX}` fix "
        "(docs/upstream/vllm-cpu-expand-kernel.md), each server started once.",
        "",
        "**Fixtures** (`dist --vllm-url`, each server sampled at both settings, closed-form "
        "truth checked on each server first):",
        "",
        md_table(HEADERS, [r.cells() for r in report.rows]),
        "",
        *report.notes,
        "",
        "**Your model**: Gemma 3 270M (float32, dequantised from the GGUF), n-gram drafts "
        f"({dv.SPECULATIVE_TOKENS} tokens) on {len(GEMMA_PROMPTS)} prompts that repeat "
        "themselves, top-k 40, T = 1, every token re-scored against llama-server serving the "
        "same float32 numbers (`rescore --engine vllm`):",
        "",
        md_table(
            ["server", "verdict", "samples", "tokens", "drafted", "accepted", "why"], gemma_rows
        ),
        "",
        *(f"![PIT histogram, {g.server}]({g.plot.name})" for g in report.gemma if g.plot),
    ]
    stock_bad = [
        r for r in report.rows if "stock" in r.server and r.verdict in (CRASH, "BROKEN")
    ] + [g for g in report.gemma if "stock" in g.server and g.verdict in (CRASH, "BROKEN")]
    fixed_bad = [r for r in report.rows if "fix" in r.server and r.verdict != "PRESERVED"] + [
        g for g in report.gemma if "fix" in g.server and g.verdict != "PRESERVED"
    ]
    plain_bad = [r for r in report.rows if r.server.startswith("plain") and r.verdict == "BROKEN"]
    status = Outcome.FINDING if stock_bad or fixed_bad or plain_bad else Outcome.OK
    summary = "; ".join(
        [f"{r.fixture} {r.server} {r.sampler}: {r.verdict}" for r in report.rows]
        + [f"Gemma {g.server}: {g.verdict}" for g in report.gemma]
    )
    return Section(
        key="vllm",
        title="vLLM (CPU build): fixtures and your model, stock and fixed",
        markdown="\n".join(md),
        data={
            "fixtures": [r.__dict__ for r in report.rows],
            "gemma": [
                {
                    "server": g.server,
                    "verdict": g.verdict,
                    "why": g.why,
                    "rescore": render.to_json(g.result) if g.result else None,
                }
                for g in report.gemma
            ],
        },  # fmt: skip
        plots=[g.plot for g in report.gemma if g.plot],
        status=status,
        summary=summary,
    )


__all__ = [
    "EAGLE_SERVERS",
    "HEADERS",
    "SAMPLERS",
    "SERVERS",
    "SUFFIX_SERVERS",
    "GemmaRun",
    "VllmReport",
    "VllmRow",
    "fixture_rows",
    "render_section",
    "run_fixtures",
    "run_gemma",
    "section",
]
