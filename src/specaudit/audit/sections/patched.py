"""The audit's patched section: stock vs patched llama-server, proven with specaudit's own
instruments.

The `spec-logprobs` patch (src/specaudit/patches/llama.cpp/b11434/, explained in
docs/spec-logprobs-patch.md) makes a speculating llama-server report the target's real
probabilities for every token; the `speculative-fix` patch (docs/llama-speculative-fix.md)
makes llama.cpp's llama-speculative example keep the target distribution; the `replay-fix`
patch (docs/replay-fix.md) makes llama-server's probabilistic checkpoint replay draw fresh
uniforms after a restore. A fix is only as good as its proof, so this section runs the same
`check`, `ab` and `dist` measurements that find each fault on the stock binary against the
patched one, side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specaudit import ab, check, distribution, llama
from specaudit.audit.context import AuditContext, Section
from specaudit.llama.presets import PATCH, REPLAY_FIX, SPECULATIVE_FIX
from specaudit.outcome import Outcome
from specaudit.report import md_table, to_jsonable
from specaudit.stats import Verdict

# (stock role, patched role, check endpoint)
PAIRS = (
    ("fixture-spec", "fixture-spec-patched", "all"),
    ("gemma-spec", "gemma-spec-patched", "chat"),
)


@dataclass
class CheckPair:
    model: str
    endpoint: str
    stock: check.CheckResult
    patched: check.CheckResult


def check_pair(ctx: AuditContext, stock: str, patched: str, endpoint: str) -> CheckPair:
    """`specaudit check` on the stock and the patched speculating server, same request."""
    fixture = stock.startswith("fixture")
    kw: dict[str, Any] = {
        "endpoint": endpoint,
        "prompt": ctx.fixture.spec.prompt if fixture else check.DEFAULT_PROMPT,
        "tokens": 24,
        "top_k": 3,
        "seed": 1,
        "temperature": 1.0,
    }
    return CheckPair(
        model="fixture" if fixture else "Gemma 3 270M",
        endpoint=endpoint,
        stock=check.run(ctx.server(stock).url, **kw),
        patched=check.run(ctx.server(patched).url, **kw),
    )


EXAMPLE_SEEDS = range(1, 1001)  # the report's 1000 seeds
SECOND_PROMPT = "hag"  # a prompt other than the fixtures' own, in their letters


class StockVsFixed:
    """A measurement on stock binaries and on binaries with a fix; `proven` when the fault
    shows on stock and is gone with the fix."""

    stock: distribution.EngineResult
    fixed: distribution.EngineResult

    @property
    def proven(self) -> bool:
        return self.stock.verdict is Verdict.BROKEN and self.fixed.verdict is Verdict.PRESERVED


@dataclass
class ExamplePair(StockVsFixed):
    """llama-speculative, stock and with the `speculative-fix` patch, on one fixture and prompt."""

    fixture: str  # the fixture's name
    kind: str  # "last-token" or "context"
    prompt: str
    stock: distribution.EngineResult
    fixed: distribution.EngineResult


def example_pairs(
    ctx: AuditContext,
    *,
    stock_seeds: range = EXAMPLE_SEEDS,
    fixed_seeds: range = EXAMPLE_SEEDS,
    tolerance: float = distribution.DEFAULT_TOLERANCE,
    prompts: Sequence[str | None] = (None, SECOND_PROMPT),
    stock_sequential: bool = False,
) -> list[ExamplePair]:
    """`dist` of stock and fixed llama-speculative on both fixtures, for each prompt (None: the
    fixture's own); empty when the build has no `speculative-fix` patch. Each measurement is
    one `DistRequest` of the speculative-example engine on the given binaries.

    `stock_sequential`: test the stock example sequentially (anytime-valid e-values at alpha
    1e-3, `stock_seeds` the maximum): its bias is gross, so it stops after a few dozen runs.
    """
    if SPECULATIVE_FIX not in llama.available_patches(ctx.build):
        return []
    stock_bins, fixed_bins = ctx.binaries(), ctx.binaries(SPECULATIVE_FIX)
    out = []
    for kind, fs in (("last-token", ctx.fixture), ("context", ctx.context_fixture)):
        for prompt in prompts:
            res = []
            for bins, seeds, label, seq in (
                (stock_bins, stock_seeds, "llama-speculative", stock_sequential),
                (fixed_bins, fixed_seeds, f"llama-speculative [{SPECULATIVE_FIX}]", False),
            ):
                if seeds.step != 1:
                    raise ValueError(f"seeds must be consecutive, got {seeds}")
                req = distribution.make_request(
                    ["speculative-example"], fixture=fs, prompt=prompt, binaries=bins,
                    seeds=len(seeds), seed_start=seeds.start,
                    alpha=1e-3 if seq else distribution.DEFAULT_ALPHA, tolerance=tolerance,
                    sequential=seq,
                )  # fmt: skip
                ctx.progress(
                    f"patched: dist {label} on {fs.spec.name}, prompt {req.workload.prompt}"
                )
                (eng,) = distribution.run(req).engines
                res.append(eng)
            out.append(ExamplePair(fs.spec.name, kind, req.workload.prompt, res[0], res[1]))
    return out


# The probabilistic replay's fault shows only in rounds verified after a replay (position 4 on,
# so 8 tokens) and is small (prefix-averaged TV ~0.02 at position 4), so 15000 seeds: stock
# BROKEN, the fix PRESERVED, with the same counts in every run measured (docs/replay-fix.md).
REPLAY_SEEDS = range(1, 15001)
REPLAY_TOKENS = 8
REPLAY_PATH = "replay-rejection"


@dataclass
class ReplayPair(StockVsFixed):
    """llama-server's probabilistic checkpoint replay (`replay-rejection` on the replay
    fixture), stock and with the `replay-fix` patch, on the same seeds and tokens."""

    fixture: str  # the fixture's name
    tokens: int
    stock: distribution.EngineResult
    fixed: distribution.EngineResult


def replay_run(
    ctx: AuditContext, variant: str, *, seeds: range = REPLAY_SEEDS, tokens: int = REPLAY_TOKENS
) -> distribution.EngineResult:
    """`dist` of the `replay-rejection` path on the replay fixture with the binaries of
    `variant` ("stock" or `REPLAY_FIX`)."""
    if seeds.step != 1:
        raise ValueError(f"seeds must be consecutive, got {seeds}")
    fs = ctx.replay_fixture
    req = distribution.make_request(
        ("server",), fixture=fs, binaries=ctx.binaries(variant), seeds=len(seeds),
        seed_start=seeds.start, tokens=tokens, paths=[REPLAY_PATH],
    )  # fmt: skip
    ctx.progress(f"patched: dist {REPLAY_PATH} on {fs.spec.name}, {variant} llama-server")
    (eng,) = distribution.run(req).engines
    return eng


def replay_pair(
    ctx: AuditContext, *, seeds: range = REPLAY_SEEDS, tokens: int = REPLAY_TOKENS
) -> ReplayPair | None:
    """`replay_run` on stock and on the `replay-fix` build, same seeds and tokens; None when
    the build has no `replay-fix` patch."""
    if REPLAY_FIX not in llama.available_patches(ctx.build):
        return None
    stock, fixed = (replay_run(ctx, v, seeds=seeds, tokens=tokens) for v in ("stock", REPLAY_FIX))
    return ReplayPair(ctx.replay_fixture.spec.name, tokens, stock, fixed)


def _rejecting(e: distribution.EngineResult) -> str:
    """The tests that reject, with their Holm p-values; "none" if none does."""
    names = [f"{t.name} ({t.p_holm:.2g})" for t in e.tests if t.rejected]
    return ", ".join(names) or "none"


def _example_cell(e: distribution.EngineResult) -> str:
    bound = f", TV <= {e.tv_bound:.3f}" if e.tv_bound is not None else ""
    return f"{e.verdict.value} ({e.n_samples} seeds{bound})"


def _counts(r: check.CheckResult) -> tuple[int, int]:
    """(real, placeholder) tokens over the endpoints that gave a decision."""
    return r.real, r.placeholders


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def section(ctx: AuditContext) -> Section:
    pairs = [check_pair(ctx, s, p, e) for s, p, e in PAIRS]
    rows = []
    for pr in pairs:
        sr, sp = _counts(pr.stock)
        pr_, pp = _counts(pr.patched)
        rows.append(
            (
                pr.model,
                pr.endpoint,
                f"{sr} real / {sp} placeholder",
                f"{pr_} real / {pp} placeholder",
                f"{pr.stock.verdict} (exit {pr.stock.exit_code})",
                f"{pr.patched.verdict} (exit {pr.patched.exit_code})",
                pr.patched.speculation.draft_n,
            )
        )
    ctx.progress("patched: ab Gemma plain vs patched spec")
    ab_res = ab.run(
        ctx.server("gemma-plain").url,
        ctx.server("gemma-spec-patched").url,
        ab.Settings(seeds=5, tokens=64),
        plot=ctx.out_dir / "ab-gemma-patched.png",
    )
    ctx.progress("patched: dist on the patched speculating server")
    fs = ctx.fixture
    wl = distribution.make_workload(fs.spec)
    eng = distribution.ServerEngine(
        ctx.server("fixture-spec-patched").url,
        fs.spec,
        wl,
        label="patched llama-server + draft",
        kind="server-spec",
    )
    d = distribution.measure(eng, fs.spec, wl, list(range(1, 1001)))

    md = [
        f"Patch `{PATCH}` against b{ctx.build}: the same measurements on the stock and the "
        "patched speculating server.",
        "",
        md_table(
            [
                "model",
                "endpoints",
                "stock: tokens",
                "patched: tokens",
                "stock check",
                "patched check",
                "patched draft_n",
            ],
            rows,
        ),
        "",
        md_table(
            ["measurement", "patched result"],
            [
                (
                    "ab, Gemma plain vs patched spec (5 seeds x 64 tokens)",
                    f"{ab_res.verdict.kind.value}: naive {_f(ab_res.plain.naive_mean)} plain vs "
                    f"{_f(ab_res.spec.naive_mean)} spec, spec coverage {ab_res.spec.coverage:.0%}",
                ),
                (
                    "dist, fixture through the patched server + draft (1000 seeds)",
                    f"{d.verdict.value}",
                ),
            ],
        ),
    ]
    ok = (
        all(p.patched.exit_code == 0 for p in pairs)
        and ab_res.outcome is Outcome.OK
        and d.verdict is Verdict.PRESERVED
    )
    summary = (
        "patched: "
        + ", ".join(f"{p.model} check exit {p.patched.exit_code}" for p in pairs)
        + f"; ab {ab_res.verdict.kind.value}; dist {d.verdict.value}"
    )
    return Section(
        key="patched",
        title=f"The fix: stock vs patched ({PATCH}) speculating llama-server",
        markdown="\n".join(md),
        data={
            "check": [
                {
                    "model": p.model,
                    "stock": _counts(p.stock),
                    "patched": _counts(p.patched),
                    "stock_exit": p.stock.exit_code,
                    "patched_exit": p.patched.exit_code,
                }
                for p in pairs
            ],
            "ab": to_jsonable(ab_res),
            "dist": to_jsonable(d),
        },
        plots=[ab_res.plot] if ab_res.plot else [],
        status=Outcome.OK if ok else Outcome.FINDING,
        summary=summary,
    )


def fix_section(ctx: AuditContext, examples: list[ExamplePair]) -> Section:
    """The speculative-fix section from measured pairs (see `example_pairs`)."""
    md = [
        f"`{SPECULATIVE_FIX}` against b{ctx.build}: `dist` of llama.cpp's llama-speculative "
        "example, stock and fixed, on both fixtures and two prompts.",
        "",
    ]
    if examples:
        md.append(
            md_table(
                ["fixture", "prompt", "stock llama-speculative", "fixed llama-speculative"],
                [
                    (
                        f"{x.fixture} ({x.kind})",
                        x.prompt,
                        _example_cell(x.stock),
                        _example_cell(x.fixed),
                    )
                    for x in examples
                ],
            )  # fmt: skip
        )
    else:
        md.append(f"No `{SPECULATIVE_FIX}` patch for b{ctx.build}: not measured.")
    ok = all(x.fixed.verdict is Verdict.PRESERVED for x in examples)
    summary = "; ".join(
        f"{x.kind}/{x.prompt}: {x.stock.verdict.value} -> {x.fixed.verdict.value}" for x in examples
    )
    return Section(
        key="speculative",
        title=f"The llama-speculative fix: stock vs fixed ({SPECULATIVE_FIX})",
        markdown="\n".join(md),
        data={"pairs": to_jsonable(examples)},
        plots=[],
        status=Outcome.OK if ok else Outcome.FINDING,
        summary=summary or f"no {SPECULATIVE_FIX} patch for b{ctx.build}",
    )


def replay_section(ctx: AuditContext, pair: ReplayPair | None) -> Section:
    """The replay-fix section from a measured pair (see `replay_pair`)."""
    md = [
        f"`{REPLAY_FIX}` against b{ctx.build}: `dist` of llama-server's probabilistic checkpoint "
        f"replay (`{REPLAY_PATH}`: `--spec-draft-sampling probabilistic` on the replay fixture's "
        "Mamba target), stock and fixed. Stock reuses the rejection sampler's draws after a "
        "restore, so the rounds verified after a replay leave the target distribution.",
        "",
    ]
    if pair is None:
        md.append(f"No `{REPLAY_FIX}` patch for b{ctx.build}: not measured.")
        ok, summary = True, f"no {REPLAY_FIX} patch for b{ctx.build}"
    else:
        rows = []
        for name, e in (("stock", pair.stock), (REPLAY_FIX, pair.fixed)):
            rows.append(
                (
                    name,
                    _example_cell(e),
                    f"{e.drafted} / {e.accepted}",
                    _rejecting(e),
                )
            )
        md.append(f"{pair.fixture}, {pair.tokens} tokens per sample:")
        md.append("")
        md.append(
            md_table(["llama-server", "verdict", "drafted / accepted", "rejecting tests"], rows)
        )
        ok = pair.fixed.verdict is Verdict.PRESERVED
        summary = (
            f"{REPLAY_PATH}, {pair.tokens} tokens, {pair.fixed.n_samples} seeds: "
            f"{pair.stock.verdict.value} -> {pair.fixed.verdict.value}"
        )
    return Section(
        key="replay",
        title=f"The checkpoint replay fix: stock vs fixed ({REPLAY_FIX}) llama-server",
        markdown="\n".join(md),
        data={"pair": to_jsonable(pair)},
        plots=[],
        status=Outcome.OK if ok else Outcome.FINDING,
        summary=summary,
    )
