"""The audit's "your model" section: Gemma 3 270M, the model people actually serve, re-scored
and its logprobs classified, with no closed form anywhere.

Why: the fixtures prove what llama.cpp's speculative paths do; this shows the same questions
answered on a real model with only a plain reference of the same file (`specaudit rescore`,
`check --reference`): does the stock speculating server sample from the model's distribution
(its verdict and PIT histogram), are its logprobs placeholders, are the patched server's real
and correct, and would a plausible-but-wrong fix be caught (a logprob mutant of the patch).
"""

from __future__ import annotations

from typing import Any

from specaudit import rescore
from specaudit.audit.context import AuditContext, Section
from specaudit.check import with_reference
from specaudit.fixtures import SamplerSettings
from specaudit.llama import presets
from specaudit.outcome import Outcome
from specaudit.report import md_table
from specaudit.rescore import render

SAMPLER = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=1.0)
LP_MUTANT = "mutants/lp-no-temperature"
MUTANT_LABEL = f"{LP_MUTANT} (spec-logprobs + one bug)"
FIDELITY: dict[str, Any] = {
    "prompt": "Once upon a time",
    "tokens": 12,
    "top_k": 5,
    "temperature": 0.7,
    "seed": 3,
}


def section(ctx: AuditContext, *, seeds: int = 45, tokens: int = 6) -> Section:
    """Re-score the stock speculating Gemma server; classify the stock, patched and one logprob
    mutant server's tokens. `seeds`/`tokens`: per prompt (3 prompts); 810 tokens by default,
    enough for the certificate's bounds to come within the default tolerance (PRESERVED, not
    only "nothing rejected")."""
    ref = ctx.server("gemma-plain").url
    ctx.progress("your model: re-scoring the speculating Gemma server")
    req = rescore.make_request(
        ctx.server("gemma-spec").url, reference_url=ref, seeds=seeds, tokens=tokens,
        sampler=SAMPLER, concurrency=2, timeout=600.0, label="gemma-spec (stock, draft-simple)",
    )  # fmt: skip
    res = rescore.run(req)
    png = render.plot_pit(res, ctx.out_dir / "rescore-gemma.png")
    rows: list[list[Any]] = []
    runs: dict[str, with_reference.FidelitySummary] = {}
    for label, url in (
        ("stock, speculating", ctx.server("gemma-spec").url),
        ("spec-logprobs, speculating", ctx.server("gemma-spec-patched").url),
    ):
        ctx.progress(f"your model: fidelity of {label}")
        runs[label] = with_reference.run(url, ref, **FIDELITY)
    bins = ctx.binaries(LP_MUTANT)
    ctx.log_dir.mkdir(parents=True, exist_ok=True)
    srv = presets.for_preset(
        presets.PRESETS["gemma-spec"], bins, ctx.gemma, ctx.gemma,
        log_path=ctx.log_dir / "gemma-lp-mutant.log", name="gemma-lp-mutant",
    )  # fmt: skip
    with srv:
        ctx.progress("your model: fidelity of a logprob mutant")
        runs[f"{LP_MUTANT} (spec-logprobs + one bug)"] = with_reference.run(
            srv.url, ref, **FIDELITY
        )
    for label, f in runs.items():
        c = f.counts
        rows.append([label, c.real_correct, c.real_wrong, c.placeholder, c.missing, c.total])
    s = res.stats
    verdict = s.verdict.value if s else f"no decision: {res.error}"
    md = [
        "Gemma 3 270M with itself as its draft, against a plain server of the same file: no "
        "fixture, no closed form.",
        "",
        f"**Re-scored sampling** ({len(res.samples)} samples, {res.rescored} tokens, top-k 40, "
        f"T = 1; drafted/accepted {res.drafted}/{res.accepted}): **{verdict}**"
        + (f": {s.reason}." if s else ""),
        "",
        f"![PIT histogram]({png.name})",
        "",
        f"**Logprob fidelity** (native /completion, pre- and post-sampling, streamed and not; "
        f"{FIDELITY['tokens']} tokens, T = {FIDELITY['temperature']}, top-k 40, "
        f"{FIDELITY['top_k']} candidates):",
        "",
        md_table(
            ["server", "real and correct", "real but wrong", "placeholder", "missing", "tokens"],
            rows,
        ),
    ]
    stock = runs["stock, speculating"].counts
    patched = runs["spec-logprobs, speculating"].counts
    mutant = runs[MUTANT_LABEL].counts
    found = (s is not None and s.verdict.value == "BROKEN") or stock.placeholder + stock.missing
    summary = (
        f"rescore {verdict}; stock {stock.placeholder + stock.missing} placeholder/missing; "
        f"patched {patched.real_correct}/{patched.total} real and correct; "
        f"{LP_MUTANT} {mutant.real_wrong} real but wrong"
    )
    return Section(
        key="model",
        title="Your model: Gemma 3 270M re-scored and its logprobs classified",
        markdown="\n".join(md),
        data={"rescore": render.to_json(res), "fidelity": {k: v.counts for k, v in runs.items()}},
        plots=[png],
        status=Outcome.FINDING if found else Outcome.OK,
        summary=summary,
    )
