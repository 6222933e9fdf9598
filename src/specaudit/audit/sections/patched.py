"""The audit's patched section: stock vs patched llama-server, proven with specaudit's own
instruments.

The `spec-logprobs` patch (src/specaudit/patches/llama.cpp/b11434/, explained in
docs/spec-logprobs-patch.md) makes a speculating llama-server report the target's real
probabilities for every token. A fix is only as good as its proof, so this section runs the
same `check`, `ab` and `dist` measurements that find the fault on the stock server against the
patched one, side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specaudit import ab, check, dist
from specaudit.audit.context import AuditContext, Section
from specaudit.llama.presets import PATCH
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
    wl = dist.make_workload(fs.spec)
    eng = dist.ServerEngine(
        ctx.server("fixture-spec-patched").url,
        fs.spec,
        wl,
        label="patched llama-server + draft",
        kind="server-spec",
    )
    d = dist.measure(eng, fs.spec, wl, list(range(1, 1001)))

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
