"""The verdict in words: the reason line, the evidence for a forbidden token, the power.

Pure formatting of what `analysis.analyse` decided; no test is run here.
"""

from __future__ import annotations

from specaudit import fixtures
from specaudit.distribution.coverage import too_rarely
from specaudit.distribution.render import fmt_gof_p, p_eq
from specaudit.distribution.results import EngineResult, GenericPower, ImpossibleOutcome, Workload
from specaudit.stats import GofResult, Verdict


def power_sentence(g: GenericPower, workload: Workload) -> str:
    """'80% power against any deviation of prefix-averaged next-token TV >= .08/.09/.. at
    positions 1-4, of the whole sequence's TV >= .35'."""

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    out = (
        f"{g.power:.0%} power against any deviation of prefix-averaged next-token TV >= "
        f"{'/'.join(f(x) for x in g.tv_by_position)} at positions 1-{workload.positions}"
    )
    if g.tv_joint is not None:
        out += f", of joint (1-{workload.joint}) TV >= {f(g.tv_joint)}"
    return out + f", of the whole tested sequence's TV >= {f(g.tv_sequence)}"


def evidence_sentence(e: ImpossibleOutcome, prompt: str, spec: fixtures.FixtureSpec) -> str:
    """'seed 17: '</s>' at position 2 after bcdbc+f'."""
    after = f"{prompt}+{e.prefix}" if e.prefix else prompt
    what = "the output ended" if e.token == "<end>" else f"{e.token!s}"
    out = f"seed {e.seed}: {what} at position {e.position} after {after}"
    if e.token.startswith("'") or e.token == "<other>":
        out += f" (not a token of fixture {spec.name}: is the engine running it?)"
    return out


def _p_words(g: GofResult) -> str:
    """'= 0.0042', '< 1e-300' or '~ 1e-1381' (the exact test's log-space tail)."""
    f = fmt_gof_p(g)
    return f"~ {f[1:]}" if f.startswith("~") else p_eq(g.p_value)


def reason(result: EngineResult, workload: Workload, spec: fixtures.FixtureSpec) -> str:
    """The verdict's line: why BROKEN, PRESERVED or INCONCLUSIVE; unless a forbidden token
    settled it, the power the tests had, and for PRESERVED the whole sequence's bound."""
    if result.impossible:
        return _impossible_reason(result, workload, spec)
    out = _decision_reason(result, workload)
    if result.power is not None:
        out += "; " + power_sentence(result.power, workload)
    if result.verdict is Verdict.PRESERVED and result.sequence_tv_bound is not None:
        out += (
            f"; the whole tested sequence (positions 1-{workload.positions}) has TV <= "
            f"{result.sequence_tv_bound:.3f} (one-sided, at {1 - result.alpha:.4g})"
        )
    rare = too_rarely(result) if result.verdict is not Verdict.BROKEN else None
    if rare is not None:
        out += f"; but {rare}"
    return out


def _impossible_reason(result: EngineResult, workload: Workload, spec: fixtures.FixtureSpec) -> str:
    e = result.evidence
    seen = evidence_sentence(e[0], workload.prompt, spec) if e else "?"
    return (
        f"{result.impossible} sampled token(s) have true probability 0 under the sampler "
        f"({seen}): broken with certainty, p = 0"
    )


def _decision_reason(result: EngineResult, workload: Workload) -> str:
    """BROKEN: the test that rejects; otherwise what the certified bounds rule out."""
    alpha, tolerance, m = result.alpha, result.tolerance, len(result.tests)
    if result.verdict is Verdict.BROKEN:
        top = min(result.tests, key=lambda x: x.p_holm)
        return (
            f"{top.name} rejects: p {_p_words(top.gof)} "
            f"(Holm over {m}: p {p_eq(top.p_holm)}), alpha {alpha:g}"
        )
    # the verdict's bounds, in `bounds.certified_bounds`' order: positions 1.., the joint
    bounds = [x.tv_bound for x in result.tests if x.tv_bound is not None]
    if result.verdict is Verdict.PRESERVED:
        worst_pos = max(b.upper for b in bounds[: workload.positions])
        what = f"prefix-averaged next-token TV <= {worst_pos:.3f} at every position"
        if workload.joint:
            what += f", joint TV (1-{workload.joint}) <= {bounds[-1].upper:.3f}"
        return (
            f"no test rejects at {alpha:g} (Holm over {m}); {what} "
            f"(one-sided, together at {1 - alpha:.4g}; tolerance {tolerance:g})"
        )
    worst = max(bounds, key=lambda b: b.upper)
    i = bounds.index(worst)
    name = f"joint 1-{workload.joint}" if i >= workload.positions else f"position {i + 1}"
    tail = (
        f"more samples needed, about {result.samples_needed} samples in all if what remains "
        "is sampling noise (the bounds and the plug-in's bias shrink like 1/sqrt(n))"
    )
    return (
        f"no test rejects at {alpha:g} (Holm over {m}), but {name}'s TV up to "
        f"{worst.upper:.3f} is not ruled out (tolerance {tolerance:g}): {tail}"
    )


__all__ = [
    "evidence_sentence",
    "power_sentence",
    "reason",
]
