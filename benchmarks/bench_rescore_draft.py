"""The draft-aimed e-process (`rescore.draft_lr`) on an exactly simulated speculative sampler:
its false-alarm rate, and how many tokens each bug class needs to BROKEN.

The synthetic model: at every position, target logits over a 128-token vocabulary (standard
normal, scaled by a per-position factor in [0.5, 3]: peaked to flat), the reference's p their
top-k-40 softmax; the draft's logits are the target's plus N(0, sigma^2) noise (a similar
draft), q its own top-k-40 softmax (so the supports differ at the edge). The sampler is
speculative decoding itself, run token by token: the draft proposes k tokens from q, the
target accepts each with min(1, p/q) and on the first rejection draws from norm(max(0, p - q))
and drops the rest; when all k are kept a bonus token is drawn from p. Each bug changes one
step of that code (the catalogue's shapes, and `q-raw`, which is not in the catalogue: the
draft's untruncated softmax used as q in the acceptance and the residual). Tokens the
reference forbids (p = 0) are left out of the e-process and counted (`impossible / 1k`: the
re-scored analysis declares them BROKEN on its own).

    null     R runs of the correct sampler, N tokens each: how often the running maximum of
             the e-value reaches 1/alpha (must be <= alpha: Ville)
    bugs     R runs per bug: median tokens until the e-value first reached 1/alpha, the share
             of runs caught within N tokens, and how often the most evidence names the bug's
             family

    compare  (--compare) today's sequential PIT e-process (`rescore.analysis`, the draft's
             favourite taken as q's argmax) on the same bug runs, for scale

    .venv/bin/python benchmarks/bench_rescore_draft.py [--null-runs 500] [--runs 40]
        [--tokens 3000] [--alpha 0.01] [--compare] [--bugs NAME,...] [--json FILE]

Exit 1 when the null's alarms exceed the binomial(runs, alpha) 99.9 % quantile.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy import stats

from specaudit.reference import NextToken
from specaudit.rescore import analysis
from specaudit.rescore import draft_lr as dl
from specaudit.rescore.records import TokenDraw

VOCAB = 128
TOP_K = 40


@dataclass(frozen=True)
class Model:
    """One run's distributions, one row per position: the reference's p (top-k 40), the
    draft's processed q (its own top-k 40) and its raw softmax."""

    p: np.ndarray
    q: np.ndarray
    q_raw: np.ndarray


def _top_k_softmax(logits: np.ndarray, k: int) -> np.ndarray:
    kth = -np.sort(-logits, axis=1)[:, k - 1 : k]
    e = np.where(logits >= kth, np.exp(logits - logits.max(axis=1, keepdims=True)), 0.0)
    return e / e.sum(axis=1, keepdims=True)


def make_model(rng: np.random.Generator, n: int, sigma: float) -> Model:
    logits = rng.standard_normal((n, VOCAB)) * rng.uniform(0.5, 3.0, size=(n, 1))
    draft = logits + sigma * rng.standard_normal((n, VOCAB))
    raw = np.exp(draft - draft.max(axis=1, keepdims=True))
    return Model(
        _top_k_softmax(logits, TOP_K), _top_k_softmax(draft, TOP_K), raw / raw.sum(1, keepdims=True)
    )


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    excess = np.maximum(p - q, 0.0)
    return excess if excess.sum() > dl.EMPTY else p


@dataclass(frozen=True)
class Sampler:
    """Speculative sampling with (at most) one step changed. `keep(p, q, d)`: the acceptance
    probability of draft token d; `residual(p, q)`: what a rejection draws from
    (unnormalised); `target(p)`: the distribution the sampler believes is the target's;
    `argmax`: the draft proposes its argmax; `raw`: q is the draft's untruncated softmax in
    the acceptance and the residual. `family`: the catalogue family that should get the
    blame (None: not in the catalogue)."""

    name: str
    family: str | None
    keep: Callable[[np.ndarray, np.ndarray, int], float]
    residual: Callable[[np.ndarray, np.ndarray], np.ndarray] = _residual
    target: Callable[[np.ndarray], np.ndarray] = lambda p: p
    argmax: bool = False
    raw: bool = False


def _ratio(p: np.ndarray, q: np.ndarray, d: int) -> float:
    return min(1.0, p[d] / q[d])


def _scaled(c: float) -> Callable[[np.ndarray, np.ndarray, int], float]:
    return lambda p, q, d: min(1.0, c * p[d] / q[d])


def _inverted(p: np.ndarray, q: np.ndarray, d: int) -> float:
    return 1.0 if p[d] == 0 else min(1.0, q[d] / p[d])


def _floor(f: float) -> Callable[[np.ndarray, np.ndarray, int], float]:
    return lambda p, q, d: min(1.0, max(p[d], f) / q[d])


def _top_residual(k: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        top = np.argsort(-p, kind="stable")[:k]
        excess = np.zeros_like(p)
        excess[top] = np.maximum(p[top] - q[top], 0.0)
        return excess if excess.sum() > dl.EMPTY else _residual(p, q)

    return residual


def _tempered(theta: float) -> Callable[[np.ndarray], np.ndarray]:
    def target(p: np.ndarray) -> np.ndarray:
        t = p ** (1.0 + theta)
        return t / t.sum()

    return target


CORRECT = Sampler("correct", None, _ratio)
BUGGED = (
    Sampler("leak-draft", "leak", lambda p, q, d: 1.0),
    Sampler("residual-target", "residual", _ratio, residual=lambda p, q: p),
    Sampler("accept-c0.8", "acceptance", _scaled(0.8)),
    Sampler("accept-c1.25", "acceptance", _scaled(1.25)),
    Sampler("ratio-inverted", "ratio-inverted", _inverted),
    Sampler("argmax-proposal", "argmax-proposal", _ratio, argmax=True),
    Sampler("residual-top4", "tail-residual", _ratio, residual=_top_residual(4)),
    Sampler("temperature+0.2", "temperature", _ratio, target=_tempered(0.2)),
    Sampler("temperature-0.2", "temperature", _ratio, target=_tempered(-0.2)),
    Sampler("p-floor0.05", "support", _floor(0.05)),
    Sampler("q-raw", None, _ratio, raw=True),
)


def _draw(rng: np.random.Generator, w: np.ndarray) -> int:
    c = np.cumsum(w)
    return min(int(np.searchsorted(c, rng.random() * c[-1], side="right")), len(w) - 1)


def speculate(
    rng: np.random.Generator, m: Model, s: Sampler, k: int
) -> tuple[np.ndarray, int, int]:
    """One generation of m's length by speculative decoding with draft length k: the tokens,
    and how many draft tokens were proposed and kept."""
    n = len(m.p)
    out = np.empty(n, dtype=int)
    drafted = kept = t = 0
    while t < n:
        for i in range(t, min(t + k, n)):
            p, q = s.target(m.p[i]), (m.q_raw if s.raw else m.q)[i]
            d = int(np.argmax(m.q[i])) if s.argmax else _draw(rng, m.q[i])
            drafted += 1
            if rng.random() < s.keep(p, q, d):
                out[i] = d
                kept += 1
                continue
            out[i] = _draw(rng, s.residual(p, q))
            t = i + 1
            break
        else:
            t = min(t + k, n)
            if t < n:
                out[t] = _draw(rng, s.target(m.p[t]))
                t += 1
    return out, drafted, kept


def evidence(m: Model, tokens: np.ndarray, alpha: float) -> dl.DraftEvidence:
    """The e-process over one run, impossible tokens (p = 0) left out and counted."""
    possible = m.p[np.arange(len(tokens)), tokens] > 0
    idx = np.flatnonzero(possible)
    ratios = dl.likelihood_ratios(m.p[idx], m.q[idx], tokens[idx])
    return dl.evidence_from_ratios(ratios, alpha, index=idx + 1, excluded=int((~possible).sum()))


@dataclass(frozen=True)
class Row:
    """One bug's runs: tokens to BROKEN (None: not within the run), the family named at the
    end of each run, impossible tokens, the draft's acceptance rate."""

    name: str
    family: str | None
    crossings: list[int | None]
    named: list[str | None]
    impossible: int
    tokens: int
    accept_rate: float
    pit_crossings: list[int | None] | None = None  # today's sequential PIT e-process (--compare)

    def median(self) -> float:
        """Median tokens to BROKEN, runs that never crossed counted as infinite."""
        return _median(self.crossings)

    def to_json(self) -> dict[str, object]:
        med = self.median()
        return {
            "bug": self.name,
            "family": self.family,
            "median_tokens_to_broken": None if math.isinf(med) else med,
            "caught": sum(c is not None for c in self.crossings),
            "runs": len(self.crossings),
            "named_family": sum(f == self.family for f in self.named) if self.family else None,
            "impossible_per_1k": 1000 * self.impossible / self.tokens,
            "accept_rate": self.accept_rate,
            "crossings": self.crossings,
            "pit_median_tokens_to_broken": (
                None if self.pit_crossings is None else _finite(_median(self.pit_crossings))
            ),
            "pit_crossings": self.pit_crossings,
        }


def _median(crossings: list[int | None]) -> float:
    return float(np.median([math.inf if c is None else c for c in crossings]))


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


def pit_crossing(m: Model, tokens: np.ndarray, alpha: float) -> int | None:
    """Tokens until today's sequential e-process (`rescore.analysis`, on PIT values and the
    draft's favourite, here the argmax of q) first reached 1/alpha, on the same run."""
    draws = []
    for i, x in enumerate(tokens):
        nz = np.flatnonzero(m.p[i])
        ref = NextToken({int(j): float(m.p[i, j]) for j in nz})
        fav = int(np.argmax(m.q[i]))
        draws.append(TokenDraw(0, 0, i, str(i), int(x), ref, draft_favourite=fav))
    return analysis.analyse(draws, alpha=alpha, sequential=True).crossed_at


def run_bug(s: Sampler, args: argparse.Namespace, seed: int) -> Row:
    rng = np.random.default_rng(seed)
    crossings: list[int | None] = []
    named: list[str | None] = []
    pit: list[int | None] = []
    impossible = drafted = kept = 0
    for _ in range(args.runs):
        m = make_model(rng, args.tokens, args.sigma)
        toks, dr, kp = speculate(rng, m, s, args.draft_k)
        ev = evidence(m, toks, args.alpha)
        if args.compare:
            pit.append(pit_crossing(m, toks, args.alpha))
        crossings.append(ev.crossed_at)
        named.append(dl.BUGS[ev.best_bug].family if ev.best_bug else None)
        impossible += ev.excluded
        drafted, kept = drafted + dr, kept + kp
    total = args.runs * args.tokens
    compared = pit if args.compare else None
    return Row(s.name, s.family, crossings, named, impossible, total, kept / drafted, compared)


@dataclass(frozen=True)
class Null:
    """The correct sampler's runs: how often sup E reached 1/alpha, and the check on it."""

    runs: int
    tokens: int
    alarms: int
    alpha: float
    sup_e: tuple[float, float, float]  # the running maximum's 50, 90, 99 % quantiles
    accept_rate: float

    @property
    def limit(self) -> int:
        """The binomial(runs, alpha) 99.9 % quantile."""
        return int(stats.binom.ppf(0.999, self.runs, self.alpha))

    @property
    def passed(self) -> bool:
        return self.alarms <= self.limit

    def line(self) -> str:
        ci = stats.binomtest(self.alarms, self.runs).proportion_ci(0.95)
        return (
            f"null ({self.runs} runs of the correct sampler, {self.tokens} tokens, draft kept "
            f"{self.accept_rate:.0%}): sup E >= 1/alpha in {self.alarms}/{self.runs} = "
            f"{self.alarms / self.runs:.2%} [{ci.low:.2%}, {ci.high:.2%}] at alpha = "
            f"{self.alpha}; sup E quantiles 50/90/99 %: "
            + ", ".join(f"{v:.3g}" for v in self.sup_e)
            + f"; binomial check {self.alarms} <= {self.limit}: "
            + ("pass" if self.passed else "FAIL")
        )

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "limit": self.limit, "passed": self.passed}


def run_null(args: argparse.Namespace) -> Null:
    rng = np.random.default_rng(args.seed)
    alarms, tops, drafted, kept = 0, [], 0, 0
    for _ in range(args.null_runs):
        m = make_model(rng, args.null_tokens, args.sigma)
        toks, dr, kp = speculate(rng, m, CORRECT, args.draft_k)
        ev = evidence(m, toks, args.alpha)
        alarms += ev.broken
        tops.append(ev.e_value)
        drafted, kept = drafted + dr, kept + kp
    q50, q90, q99 = (float(v) for v in np.quantile(tops, [0.5, 0.9, 0.99]))
    return Null(
        args.null_runs, args.null_tokens, alarms, args.alpha, (q50, q90, q99), kept / drafted
    )


def _table(rows: list[Row], tokens: int) -> None:
    compare = any(r.pit_crossings is not None for r in rows)
    extra = " today's PIT e-process |" if compare else ""
    print(
        f"| bug | family | median tokens to BROKEN | caught <= {tokens} | family named | "
        f"impossible / 1k | draft kept |{extra}"
    )
    print("|---|---|---|---|---|---|---|" + ("---|" if compare else ""))
    for r in rows:
        j = r.to_json()
        named = f"{j['named_family']}/{j['runs']}" if r.family else "-"
        line = (
            f"| {r.name} | {r.family or '(not in catalogue)'} | {_cell(r.median(), tokens)} | "
            f"{j['caught']}/{j['runs']} | {named} | {j['impossible_per_1k']:.1f} | "
            f"{r.accept_rate:.0%} |"
        )
        if r.pit_crossings is not None:
            caught = sum(c is not None for c in r.pit_crossings)
            line += f" {_cell(_median(r.pit_crossings), tokens)} ({caught}/{j['runs']}) |"
        print(line, flush=True)


def _cell(median: float, tokens: int) -> str:
    return f">{tokens}" if math.isinf(median) else f"{median:.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--null-runs", type=int, default=500)
    ap.add_argument("--null-tokens", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=40, help="runs per bug")
    ap.add_argument("--tokens", type=int, default=3000, help="tokens per bug run")
    ap.add_argument("--draft-k", type=int, default=4, help="draft tokens per verification")
    ap.add_argument("--sigma", type=float, default=0.5, help="the draft's logit noise")
    ap.add_argument("--alpha", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--compare",
        action="store_true",
        help="also run today's sequential PIT e-process (rescore.analysis) on every bug run",
    )
    ap.add_argument("--bugs", help="comma-separated bug names (default: all)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    names = args.bugs.split(",") if args.bugs else [s.name for s in BUGGED]
    unknown = set(names) - {s.name for s in BUGGED}
    if unknown:
        ap.error(f"unknown bugs: {', '.join(sorted(unknown))}")
    t0 = time.perf_counter()
    null = run_null(args)
    print(f"{null.line()} ({time.perf_counter() - t0:.0f} s)", flush=True)
    t1 = time.perf_counter()
    rows = [run_bug(s, args, args.seed + 1 + i) for i, s in enumerate(BUGGED) if s.name in names]
    print(
        f"\nbugs ({args.runs} runs each, up to {args.tokens} tokens, draft length "
        f"{args.draft_k}, alpha = {args.alpha}, {time.perf_counter() - t1:.0f} s):\n",
        flush=True,
    )
    _table(rows, args.tokens)
    if args.json:
        out = {"null": null.to_json(), "bugs": [r.to_json() for r in rows], "args": vars(args)}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if not null.passed:
        print("binomial check failed: null")
    return 0 if null.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
