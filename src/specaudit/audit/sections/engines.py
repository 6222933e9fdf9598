"""The audit's engines section: the distribution test beyond llama.cpp's own programs.

Every registered engine whose entry says `audit` (it needs only the fixture), on both
fixtures: Hugging Face transformers' `generate()` with every candidate generator a llama
fixture can drive (assistant model, prompt lookup, early exit), OpenVINO GenAI's plain, draft
and prompt-lookup paths (converted to F16, with each path's logprob fidelity and
reproducibility in the notes), and any plug-in that asks for it; then llama-server through its
OpenAI-compatible `/v1/completions` (`--engine openai`), llama-cpp-python's server with
prompt-lookup decoding through the same engine, and `check` on it (real logprobs, no
/slots). Each row is shown as its entry says (`EngineEntry.audit_row`). Kept fast: sequential
mode, at most `SEEDS` samples each.
"""

from __future__ import annotations

from pathlib import Path

from specaudit import check, distribution
from specaudit import llama_cpp_python as lcp
from specaudit.audit.context import AuditContext, Section
from specaudit.fixtures import FixtureSet
from specaudit.outcome import Outcome
from specaudit.report import md_table
from specaudit.stats import Verdict

SEEDS = 2000  # the most any engine samples; sequential mode stops when decided (~1000)
HEADERS = (
    "engine",
    "generator",
    "fixture",
    "verdict",
    "samples",
    "drafted",
    "accepted",
    "TV bound",
    "samples/s",
)


def rows(results: list[tuple[str, str, distribution.DistResult]]) -> list[tuple[object, ...]]:
    """One row per (engine, generator, fixture): the table of docs/engines.md. `results`:
    (engine name, the generator column when the engine's entry leaves it empty, result)."""
    out: list[tuple[object, ...]] = []
    for engine, generator, r in results:
        entry = distribution.registry.get(engine)
        for e in r.engines:
            label, gen = entry.audit_row(e)
            out.append(
                (
                    label,
                    gen or generator,
                    r.fixture,
                    e.verdict.value,
                    e.n_samples,
                    "-" if e.drafted is None else e.drafted,
                    "-" if e.accepted is None else e.accepted,
                    "-" if e.tv_bound is None else f"{e.tv_bound:.3f}",
                    f"{e.samples_per_s:.0f}",
                )
            )
    return out


def _sequential(
    engine: str, fs: FixtureSet, seeds: int, url: str | None = None
) -> distribution.DistResult:
    """`engine` on `fs`, sequential, at most `seeds` samples."""
    req = distribution.make_request([engine], fixture=fs, url=url, seeds=seeds, sequential=True)
    return distribution.run(req)


def run_engines(
    ctx: AuditContext, seeds: int = SEEDS
) -> tuple[list[tuple[str, str, distribution.DistResult]], check.CheckResult, list[str]]:
    """Every engine of the section; (engine, generator, result) triples, check, notes."""
    out: list[tuple[str, str, distribution.DistResult]] = []
    notes: list[str] = []
    for entry in distribution.registry.entries():
        if not entry.audit:
            continue
        for fs in (ctx.fixture, ctx.context_fixture):
            ctx.progress(f"engines: {entry.name} on {fs.spec.name}")
            r = _sequential(entry.name, fs, seeds)
            notes += [f"{fs.spec.name}: {n}" for n in r.notes]  # its truth check, its findings
            out.append((entry.name, "", r))
    ctx.progress("engines: llama-server via /v1/completions")
    srv = ctx.server("fixture-spec")
    r = _sequential("openai", ctx.fixture, seeds, srv.url)
    for e in r.engines:
        e.engine = "llama-server (openai)"
    out.append(("openai", "llama-server draft-simple", r))
    lcp.install()
    chk: check.CheckResult | None = None
    for fs in (ctx.fixture, ctx.context_fixture):
        ctx.progress(f"engines: llama-cpp-python with prompt lookup on {fs.spec.name}")
        log = Path(ctx.out_dir) / f"llama-cpp-python-{fs.spec.kind}.log"
        f32 = fs.spec.kind == "context"
        with lcp.LlamaCppPythonServer(Path(fs.target), log_path=log, f32_cache=f32) as s:
            r = _sequential("openai", fs, seeds, s.url)
            for e in r.engines:
                e.engine = f"llama-cpp-python {lcp.VERSION} (openai)"
            out.append(("openai", f"llama-cpp-python {lcp.PROMPT_LOOKUP}", r))
            if chk is None:
                chk = check.run(s.url, prompt=fs.spec.prompt, tokens=8, endpoint="completions")
    assert chk is not None
    return out, chk, notes


def section(ctx: AuditContext) -> Section:
    """The engines section (see the module doc)."""
    results, chk, notes = run_engines(ctx)
    table = rows(results)
    not_covered = [nc for _, _, r in results for nc in r.not_covered]
    not_covered = list(dict.fromkeys(not_covered))
    markdown = "\n".join(
        [
            "The distribution test beyond llama.cpp's own programs (sequential, at most "
            f"{SEEDS} seeds each; TV bound: the largest certified one-sided TV bound).",
            "",
            md_table(HEADERS, table),
            "",
            *notes,
            "",
            "transformers generators and OpenVINO paths that cannot run on a llama fixture:",
            "",
            *distribution.not_covered_lines(not_covered),
            "",
            f"`check` on llama-cpp-python's server: {chk.verdict} ({chk.reason}); "
            f"speculation {chk.speculation.summary}.",
        ]
    )
    broken = [row for row in table if row[3] == Verdict.BROKEN.value]
    status = Outcome.FINDING if broken or chk.outcome is Outcome.FINDING else Outcome.OK
    summary = "; ".join(f"{r[0]} {r[1]} {r[2]}: {r[3]}" for r in table)
    return Section(
        key="engines",
        title="Engines: transformers, llama-cpp-python, OpenVINO GenAI, any OpenAI-compatible "
        "server",
        markdown=markdown,
        data={"engines": [r for _, _, r in results], "check_llama_cpp_python": chk},
        status=status,
        summary=summary,
    )


__all__ = ["HEADERS", "SEEDS", "rows", "run_engines", "section"]
