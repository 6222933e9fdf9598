"""Coverage of the bounds a PRESERVED states (`rescore.certify`), by simulation, at fixed n
and at data-dependent stopping times.

Each simulated run samples `--tokens` steps; every step draws a reference distribution p
over 6 tokens from a pool (the PIT order: the favourite first, then by falling probability),
every 4th step is one repeated prefix, and the engine samples from q = (1 - s) p + s e_k: s of
the mass moved to the favourite (k = 0) or to the tail (k = 5). The true values are known in
closed form: G_i(t) - t = s_i (w_k(t) - t) (w_k the share of token k within the first t of
the mass), the favourite's excess s_i (1{k = 0} - p_fav), the repeated prefix's TV
s (1 - p_k). Scenarios: the exact null, mass moved toward the favourite, toward the tail, and
a streak (moved toward the favourite only after the favourite was sampled: dependent tokens,
the case the martingale argument is for).

Coverage is counted at three times: the end (fixed n), the first look (every `--look`
tokens) where the PIT and favourite bounds are within the tolerance (a user's natural
stopping rule; the end if never), and
"ever": a bound misses if it misses at any look (the worst stopping time of all; a bound that
covers there covers at every stopping time). Beside each sequential bound, the fixed-n bound
one would use without time-uniformity (DKW-Massart's sqrt(log(2 / a) / 2n) on the PIT CDF,
Hoeffding's on the favourite; the band's miss is sup_t |F_n(t) - G(t)| above it): each
covers at fixed n and misses far more often "ever".

Exit 1 when a certified miss count is above the binomial(runs, level) 99.9 % quantile (a
one-sided binomial test that coverage >= 1 - level; level alpha / 3 per bound, alpha for the
joint certificate): at every time for the PIT and favourite bounds and the joint certificate
of those two, at fixed n for the repeated-prefix TV (a fixed-n bound; its "ever" column is
printed only).

    .venv/bin/python benchmarks/bench_rescore_coverage.py [--runs 1000] [--tokens 1000]

Measured (defaults: 1000 runs of 1000 tokens per scenario, looks every 50, alpha 0.1, about
2 min on a shared 2-core machine): the certified bounds missed at most 8 / 1000 times at any
time (the favourite's, "ever", toward the tail; the PIT bound and the TV never), against the
99.9 % limit 52 at level 0.033: conservative. The fixed-n DKW band missed 40 / 1000 at the
end (its nominal 33) but 169-188 / 1000 "ever"; fixed-n Hoeffding on the favourite 17-32.
Mean upper bounds at 1000 tokens: PIT 0.110 (null) to 0.182, favourite 0.062 to 0.121.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from specaudit.rescore import certify

K = 6  # tokens per step
POOL = 64  # reference distributions steps draw from (the truth needs few breakpoints)


@dataclass(frozen=True)
class Scenario:
    name: str
    shift: float
    target: int  # the token mass moves to (0: the favourite, K - 1: the tail)
    streak: bool = False  # moved only after the favourite was sampled


SCENARIOS = (
    Scenario("null", 0.0, 0),
    Scenario("toward favourite", 0.1, 0),
    Scenario("toward tail", 0.1, K - 1),
    Scenario("streak", 0.2, 0, streak=True),
)
BOUNDS = ("pit", "fav", "tv", "joint", "band fixed-n", "fav fixed-n")


@dataclass
class Misses:
    """Miss counts per bound and time (end, stop, ever)."""

    counts: dict[str, dict[str, int]] = field(
        default_factory=lambda: {b: {"end": 0, "stop": 0, "ever": 0} for b in BOUNDS}
    )

    def add(self, time_: str, missed: dict[str, bool]) -> None:
        for b, m in missed.items():
            self.counts[b][time_] += int(m)


def pool(rng: np.random.Generator) -> np.ndarray:
    """POOL + 1 distributions sorted in PIT order; the last one is the repeated prefix."""
    return -np.sort(-rng.dirichlet(np.full(K, 0.7), size=POOL + 1), axis=1)


def sample(sc: Scenario, n: int, probs: np.ndarray, rng: np.random.Generator) -> dict:
    """One run: per step its type (row of `probs`), shift, token, u, hit."""
    types = rng.integers(0, POOL, size=n)
    types[::4] = POOL
    v, w = rng.random(n), rng.random(n)
    shifts, toks = np.zeros(n), np.zeros(n, dtype=int)
    prev_hit = True
    for i in range(n):
        p = probs[types[i]]
        s = sc.shift if (not sc.streak or prev_hit or types[i] == POOL) else 0.0
        q = (1 - s) * p
        q[sc.target] += s
        toks[i] = min(int(np.searchsorted(np.cumsum(q), w[i], side="right")), K - 1)
        shifts[i] = s
        prev_hit = toks[i] == 0
    p = probs[types]
    below = np.cumsum(p, axis=1) - p
    rows = np.arange(n)
    u = below[rows, toks] + v * p[rows, toks]
    return {"types": types, "shifts": shifts, "toks": toks, "u": u, "hits": (toks == 0) * 1.0}


def _shares(sc: Scenario, probs: np.ndarray, t: np.ndarray) -> np.ndarray:
    """w_k(t) - t per type (rows) and point t (columns)."""
    lo = np.cumsum(probs, axis=1)[:, sc.target] - probs[:, sc.target]
    pk = probs[:, sc.target]
    return np.clip((t[None, :] - lo[:, None]) / pk[:, None], 0, 1) - t[None, :]


def truth(sc: Scenario, run: dict, n: int, probs: np.ndarray) -> tuple[float, float, float]:
    """Over the first n steps: the true sup_t |G(t) - t|, the favourite's excess, and
    sup_t |F_n(t) - G(t)| (F_n the empirical CDF: what a DKW band must cover)."""
    weight = np.bincount(run["types"][:n], weights=run["shifts"][:n], minlength=POOL + 1) / n
    lo = np.cumsum(probs, axis=1)[:, sc.target] - probs[:, sc.target]
    # G(t) - t is piecewise linear, with its breaks where some type's token k starts or ends
    ts = np.unique(np.clip(np.concatenate([lo, lo + probs[:, sc.target]]), 0, 1))
    dist = float(np.max(np.abs(weight @ _shares(sc, probs, ts))))
    fav = float(weight @ ((1.0 if sc.target == 0 else 0.0) - probs[:, 0]))
    u = np.sort(run["u"][:n])
    g = u + weight @ _shares(sc, probs, u)  # G is continuous, F_n jumps at the u
    i = np.arange(1, n + 1)
    band = float(max(np.max(i / n - g), np.max(g - (i - 1) / n)))
    return dist, fav, band


def look(
    sc: Scenario, run: dict, n: int, probs: np.ndarray, alpha: float
) -> tuple[dict, bool, dict]:
    """Which bounds miss their true value over the first n steps; whether the sequential
    bounds (PIT and favourite) are within the tolerance; each bound's (truth, upper)."""
    start = run["types"][:n] == POOL
    counts = np.bincount(run["toks"][:n][start], minlength=K)
    cert = certify.certify(
        run["u"][:n], run["hits"][:n], probs[run["types"][:n], 0], [(counts, probs[POOL])],
        alpha=alpha,
    )  # fmt: skip
    true_pit, true_fav, band = truth(sc, run, n, probs)
    true_tv = sc.shift * (1 - probs[POOL][sc.target])
    pit, fav, tv = cert.bounds
    assert fav.interval is not None
    each = alpha / len(certify.SPLIT)
    naive_band = math.sqrt(math.log(2 / each) / (2 * n))  # DKW-Massart at fixed n
    naive_fav = math.sqrt(math.log(2 / each) / (2 * n))
    mean = float(np.mean(run["hits"][:n] - probs[run["types"][:n]][:, 0]))
    missed = {
        "pit": true_pit > pit.upper,
        "fav": not fav.interval[0] <= true_fav <= fav.interval[1],
        "tv": true_tv > tv.upper,
        "band fixed-n": band > naive_band,
        "fav fixed-n": abs(mean - true_fav) > naive_fav,
    }
    missed["joint"] = missed["pit"] or missed["fav"]
    values = {"pit": (true_pit, pit.upper), "fav": (abs(true_fav), fav.upper),
              "tv": (true_tv, tv.upper)}  # fmt: skip
    return missed, pit.within and fav.within, values


def one_run(sc: Scenario, args: argparse.Namespace, rng: np.random.Generator) -> dict:
    """Misses of one run at the end, at its stopping time and ever."""
    probs = pool(rng)
    run = sample(sc, args.tokens, probs, rng)
    ever = dict.fromkeys(BOUNDS, False)
    stop: dict[str, bool] | None = None
    stop_n = None
    missed: dict[str, bool] = {}
    values: dict = {}
    for n in range(args.look, args.tokens + 1, args.look):
        missed, within, values = look(sc, run, n, probs, args.alpha)
        ever = {b: ever[b] or missed[b] for b in BOUNDS}
        if stop is None and within:
            stop, stop_n = missed, n
    return {"end": missed, "stop": stop if stop is not None else missed, "ever": ever,
            "stop_n": stop_n, "values": values}  # fmt: skip


SEQUENTIAL = ("pit", "fav", "joint")  # asserted at every time; "tv" at the end only


def level_of(bound: str, alpha: float) -> float:
    return alpha if bound == "joint" else alpha / len(certify.SPLIT)


def study(sc: Scenario, args: argparse.Namespace, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    misses = Misses()
    stops: list[int] = []
    values: dict[str, list] = {"pit": [], "fav": [], "tv": []}
    for _ in range(args.runs):
        out = one_run(sc, args, rng)
        for time_ in ("end", "stop", "ever"):
            misses.add(time_, out[time_])
        if out["stop_n"] is not None:
            stops.append(out["stop_n"])
        for b in values:
            values[b].append(out["values"][b])
    rows = []
    for b in BOUNDS:
        level = level_of(b, args.alpha)
        limit = int(stats.binom.ppf(0.999, args.runs, level))
        times = ("end", "stop", "ever") if b in SEQUENTIAL else ("end",) if b == "tv" else ()
        checked = [misses.counts[b][t] <= limit for t in times]
        rows.append({"bound": b, "level": level, "limit": limit, **misses.counts[b],
                     "checked": list(times), "passed": all(checked)})  # fmt: skip
    means = {b: np.mean(np.array(v), axis=0).tolist() for b, v in values.items()}
    median = float(np.median(stops)) if stops else None
    return {"scenario": sc.name, "runs": args.runs, "rows": rows, "stopped": len(stops),
            "median_stop": median, "end_means": means}  # fmt: skip


def print_table(result: dict, seconds: float) -> None:
    print(f"\n{result['scenario']} ({result['runs']} runs, {seconds:.0f} s)")
    means = ", ".join(f"{b} {t:.3f} / {u:.3f}" for b, (t, u) in result["end_means"].items())
    print(f"  at the end, mean true value / upper bound: {means}")
    print(
        f"  the PIT and favourite bounds came within the tolerance in {result['stopped']} runs "
        f"(median at {result['median_stop']} tokens)"
    )
    print(f"  {'bound':<12} {'level':>6} {'end':>5} {'stop':>5} {'ever':>5} {'limit':>5}  check")
    for r in result["rows"]:
        check = ("pass" if r["passed"] else "FAIL") + f" ({', '.join(r['checked'])})"
        if not r["checked"]:
            check = "printed only"
        print(
            f"  {r['bound']:<12} {r['level']:>6.3f} {r['end']:>5} {r['stop']:>5} {r['ever']:>5} "
            f"{r['limit']:>5}  {check}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000, help="simulated runs per scenario")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--look", type=int, default=50, help="tokens between looks")
    ap.add_argument("--alpha", type=float, default=0.1, help="the certificate's joint alpha")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    results = []
    for i, sc in enumerate(SCENARIOS):
        t0 = time.perf_counter()
        result = study(sc, args, args.seed * 1000 + i)
        print_table(result, time.perf_counter() - t0)
        results.append(result)
    failed = [
        f"{res['scenario']}: {r['bound']}"
        for res in results
        for r in res["rows"]
        if not r["passed"]
    ]
    print("\nmisses counted where the bound was below the true value; limit: the binomial(runs, "
          "level) 99.9 % quantile")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if failed:
        print(f"binomial check failed: {'; '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
