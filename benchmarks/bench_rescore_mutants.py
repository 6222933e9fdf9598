"""The power table of `specaudit rescore`: every rejection-sampler mutant (docs/mutants.md)
re-scored on the fixture and on Gemma 3 270M, at T = 1 and T = 0.7, today's statistics beside
the first generation's on the very same draws, with the controls' false alarms and the cost.

Every build (stock and spec-logprobs as controls, then each bundled rejection-sampler mutant of
b11434) serves ``--spec-draft-sampling probabilistic`` on the default fixture (its own draft)
and on Gemma 3 270M with itself as its draft, and is re-scored (`specaudit.rescore`) against a
plain stock server of the same model, with the draft's q as the second reference (the fixture's
closed form; on Gemma the plain server asked at llama.cpp's draft chain, top-k 10). Samples are
drawn in looks (``LOOKS``: 32, 64, 128, 200, ... samples, seed ranges that continue each other)
and at every look three rules read the pooled draws:

- **today, fixed**: `rescore.analysis.analyse`, the Holm family a run of that many samples
  decides with (KS, surprisal, rank bins, two-sided favourite, exact per-prefix, position
  bands, the draft-aimed e-process, the outside count; the flag tests where the build flags);
- **today, anytime**: the same call with ``sequential=True``: where its anytime-valid evidence
  first crossed (a token count valid however often it is read);
- **first generation**: the rule rescore shipped with (`first_generation` below: KS of the PIT
  values, the one-sided favourite, per-prefix asymptotic G-tests, Bonferroni at alpha / 3, an
  impossible token BROKEN on its own), kept here only as the baseline.

"samples to BROKEN" is the first look at which a rule says BROKEN (a fixed rule read at several
looks is a power figure, not a level: the controls, read at the same looks, show what that
costs). A mutant stops once every rule has decided or at ``--max-samples``; controls run every
look. Goal: every mutant BROKEN (or loud) within 200 samples on Gemma by today's rules, no
control BROKEN, and no statistic over its level on the exact null; exit 1 otherwise.

Cost, side by side in the same run: the stock control on Gemma at T = 1 is also sampled alone
(the engine only, the same seeds and concurrency) and the ratio printed (goal <= 2x).

The null rate of each of today's statistics, alone at alpha: the exact null by simulation first
(``--null-runs`` runs of ``tests/rescore_synthetic.py``'s dependent top-k 40 generations with the
draft's q, one-sided binomial test that a rate exceeds alpha), the noisy null from the Gemma
controls' p-values at their last look (several seed ranges and 4,000-token runs:
``bench_rescore_noisy_null.py``).

    .venv/bin/python benchmarks/bench_rescore_mutants.py [--max-samples 200]
        [--fixture-max-samples 500] [--only NAME ...] [--json FILE] [--rows FILE]
        [--simulated-only] [--null-runs 10000 --null-seed 8] [--synthetic-runs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as sps

from bench_rescore import sample_only  # the engine alone, as the cost benchmark times it

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import rescore_synthetic as rs  # noqa: E402
from specaudit import distribution, llama, models
from specaudit.fixtures import REPORT_SAMPLER, SamplerSettings
from specaudit.llama import LlamaServer
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import resolve
from specaudit.llama.presets import draft_chain
from specaudit.rescore import analysis, outside, request, runner
from specaudit.rescore import fixture as fixture_ref
from specaudit.rescore.outside import EdgeLeak
from specaudit.rescore.pit import favourite_of, pit, poisson_binomial_sf
from specaudit.rescore.records import RescoreError, TokenDraw
from specaudit.stats import Verdict

ALPHA = 0.01
GEMMA_SAMPLER = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=1.0)
GEMMA_PROMPTS = ("Once upon a time", "The capital of France is")
GEMMA_TOKENS = 8  # per sample: rescore's default
FIXTURE_TOKENS = 4
TEMPERATURES = (1.0, 0.7)
CONTROLS = ("stock", "spec-logprobs")
LOOKS = (32, 64, 128, 200, 400, 500, 1000)  # 32 x 4 tokens: the fewest a run decides on
GOAL_SAMPLES = 200


def log(msg: str) -> None:
    print(f"[bench_rescore_mutants] {msg}", file=sys.stderr, flush=True)


# -- the first generation's rule, the baseline ----------------------------------------------


def first_generation(draws: Sequence[TokenDraw], alpha: float, seed: int = 0) -> tuple[bool, str]:
    """BROKEN or not by the rule rescore first shipped: an impossible token; else KS of the
    randomised PIT values, the one-sided favourite (exact Poisson-binomial tail) and per-prefix
    G-tests (asymptotic chi-square, prefixes with 20+ draws, Bonferroni), each at alpha / 3."""
    level = alpha / 3
    v = np.random.default_rng(seed).random(len(draws))
    us, hits, fav_ps, impossible = [], [], [], 0
    for d, vi in zip(draws, v, strict=True):
        u = pit(d, float(vi))
        fav = favourite_of(d)
        hits.append(1.0 if d.token == fav else 0.0)
        fav_ps.append(d.ref.probs.get(fav, 0.0) / sum(d.ref.probs.values()))
        if u is None:
            impossible += 1
        else:
            us.append(u)
    if impossible:
        return True, f"{impossible} impossible"
    reasons = []
    ks_p = float(sps.kstest(np.array(us), "uniform").pvalue) if us else 1.0
    if ks_p < level:
        reasons.append(f"KS p={ks_p:.2g}")
    fav_p = poisson_binomial_sf(int(sum(hits)), np.array(fav_ps)) if hits else 1.0
    if fav_p < level:
        reasons.append(f"favourite p={fav_p:.2g}")
    g = _g_tests(draws)
    if g and min(g) * len(g) < level:
        reasons.append(f"G p={min(1.0, min(g) * len(g)):.2g}")
    return bool(reasons), "; ".join(reasons)


def _g_tests(draws: Sequence[TokenDraw]) -> list[float]:
    groups: dict[str, list[TokenDraw]] = defaultdict(list)
    for d in draws:
        groups[d.prefix_key].append(d)
    out = []
    for ds in groups.values():
        if len(ds) < 20:
            continue
        probs = ds[0].ref.probs
        total = sum(probs.values())
        n = len(ds)
        big = [t for t in probs if n * probs[t] / total >= 1.0]
        counts: dict[int, int] = defaultdict(int)
        for d in ds:
            counts[d.token if d.token in big else -1] += 1
        exp = [n * probs[t] / total for t in big]
        obs = [counts[t] for t in big]
        rest = n - sum(exp)
        if rest > 1e-9:
            exp.append(rest)
            obs.append(counts[-1])
        if len(exp) >= 2:
            out.append(float(sps.power_divergence(obs, exp, lambda_="log-likelihood").pvalue))
    return out


# -- the exact null, per statistic ----------------------------------------------------------


def exact_null(runs: int, tokens: int, seed: int = 7) -> dict[str, dict[str, float]]:
    """Each statistic of today's family alone at alpha, over `runs` simulated runs whose tokens
    really come from the reference (`rescore_synthetic.chain`: top-k 40 head distributions,
    generations of 8 dependent steps, the draft's q known, as on Gemma with a draft
    reference): its false alarms, the 95 % Clopper-Pearson upper bound, and the one-sided
    binomial p that its rate exceeds alpha; the whole family's BROKEN verdicts too."""
    rng = np.random.default_rng(seed)
    alarms: dict[str, int] = defaultdict(int)
    seen: dict[str, int] = defaultdict(int)
    for r in range(runs):
        draws = rs.chain(tokens, rng, with_draft=True)
        st = analysis.analyse(draws, alpha=ALPHA, seed=r)
        seen["family (BROKEN)"] += 1
        alarms["family (BROKEN)"] += st.verdict is Verdict.BROKEN
        for t in st.tests:
            name = "per-prefix (any)" if t.name.startswith("prefix") else t.name
            seen[name] += 1
            alarms[name] += t.p_value < ALPHA
    out = {}
    for name, n in seen.items():
        k = alarms[name]
        out[name] = {
            "runs": n, "alarms": k,
            "upper95": float(sps.binomtest(k, n).proportion_ci(0.95).high),
            "p_above": float(sps.binomtest(k, n, ALPHA, alternative="greater").pvalue),
        }  # fmt: skip
    return out


# -- the synthetic bug classes ---------------------------------------------------------------

SYNTHETIC_LOOKS = (256, 512, 1024, 1600, 3200)  # tokens; 1600 = 200 Gemma samples of 8 tokens
GOAL_TOKENS = GOAL_SAMPLES * GEMMA_TOKENS


def _topk44(n: int, rng: np.random.Generator) -> tuple[list[TokenDraw], EdgeLeak]:
    """A top-k 44-instead-of-40 engine on a model whose 40th and 41st tokens swap places in
    5 % of batch shapes (a correct engine on a quantised model leaks that much), the
    reference's own leak measured as a run measures it (`bench_rescore_edge.py`)."""
    draws, rows = rs.topk_run(n, rng, k_engine=44, swap=0.05)
    picked = outside.sample_draws(n, seed=int(rng.integers(1 << 30)))
    leaks = rs.topk_leaks(rows, picked, rng, 0.05)
    return draws, EdgeLeak(leaks, ALPHA * outside.BOUND_SHARE)


def _chain_of(bug: rs.Bug = rs.none, stale: float = 0.0) -> Any:
    return lambda n, rng: (rs.chain(n, rng, bug=bug, with_draft=True, stale=stale), None)


# the bug classes of the review that asked for this table (docs/rescore.md, "Power"), simulated
# exactly: top-k 40 head distributions in dependent generations of 8 with the draft's q known
SYNTHETIC: dict[str, Any] = {
    "accept min(1, 1.25 p/q)": _chain_of(rs.acceptance(1.25)),
    "residual from p (rejected drafts only)": _chain_of(rs.residual_target),
    "temperature 0.8": _chain_of(rs.temperature(0.8)),
    "rank 2 -> 3 (30 %)": _chain_of(rs.rank2_to_rank3(0.3)),
    "favourite -10 %": _chain_of(rs.favourite_under(0.1)),
    "stale context after a rejection (history)": _chain_of(stale=0.5),
    "top-k 44 instead of 40 (5 % edge swaps)": _topk44,
}


def synthetic_power(runs: int, seed: int = 11) -> dict[str, dict[str, Any]]:
    """Tokens to BROKEN for each synthetic bug class, by the three rules read at
    `SYNTHETIC_LOOKS` on the same draws, over `runs` runs: the median (None when under half the
    runs decided by the last look) and the share decided within `GOAL_TOKENS`."""
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, Any]] = {}
    for name, make in SYNTHETIC.items():
        firsts: dict[str, list[float]] = {"today": [], "anytime": [], "first_gen": []}
        for r in range(runs):
            draws, edge = make(SYNTHETIC_LOOKS[-1], rng)
            first: dict[str, float] = dict.fromkeys(firsts, math.inf)
            for look in SYNTHETIC_LOOKS:
                part = draws[:look]
                if first["today"] == math.inf:
                    st = analysis.analyse(part, alpha=ALPHA, seed=r, edge=edge)
                    if st.verdict is Verdict.BROKEN:
                        first["today"] = look
                if first["anytime"] == math.inf:
                    seq = analysis.analyse(part, alpha=ALPHA, seed=r, edge=edge, sequential=True)
                    if seq.crossed_at is not None:
                        first["anytime"] = seq.crossed_at
                if first["first_gen"] == math.inf and first_generation(part, ALPHA, r)[0]:
                    first["first_gen"] = look
                if all(v < math.inf for v in first.values()):
                    break
            for k, v in first.items():
                firsts[k].append(v)
        out[name] = {
            k: {
                "median": None if math.isinf(m := float(np.median(v))) else m,
                "within_goal": float(np.mean([x <= GOAL_TOKENS for x in v])),
            }
            for k, v in firsts.items()
        }
        log(f"synthetic {name}: {_synthetic_cell(out[name])}")
    return out


def _synthetic_cell(row: dict[str, Any]) -> str:
    def one(k: str) -> str:
        m = row[k]["median"]
        median = f">{SYNTHETIC_LOOKS[-1]}" if m is None else f"{m:.0f}"
        return f"{median} ({row[k]['within_goal']:.0%})"

    return " / ".join(one(k) for k in ("today", "anytime", "first_gen"))


def synthetic_table(syn: dict[str, dict[str, Any]], runs: int) -> str:
    lines = [
        f"Synthetic bug classes: median tokens to BROKEN (share of {runs} runs BROKEN within "
        f"{GOAL_TOKENS} tokens = {GOAL_SAMPLES} Gemma samples), today fixed / today anytime / "
        "first generation",
        "",
        "| bug class | tokens to BROKEN |",
        "|---|---|",
    ]
    lines += [f"| {name} | {_synthetic_cell(row)} |" for name, row in syn.items()]
    return "\n".join(lines)


# -- sampling in looks ----------------------------------------------------------------------


def binaries(build: str) -> LlamaBinaries:
    """A build by name: "stock", a bundled patch or mutant, or patches joined by "+"."""
    if build == "stock":
        return llama.ensure()
    return llama.ensure(patches=tuple(resolve(p) for p in build.split("+")))


@contextlib.contextmanager
def gemma_server(bins: LlamaBinaries, gemma: Path) -> Iterator[LlamaServer]:
    srv = LlamaServer(
        bins, gemma, draft=gemma, spec_type="draft-simple", parallel=2, ctx_size=4096,
        extra_args=("--spec-draft-sampling", "probabilistic", "-t", "1"), name="gemma-rejection",
    )  # fmt: skip
    with srv:
        yield srv


def _pool(pooled: runner.RescoreResult | None, res: runner.RescoreResult) -> runner.RescoreResult:
    if pooled is None:
        return res
    pooled.samples += res.samples
    pooled.draws += res.draws
    pooled.rescored += res.rescored
    pooled.boundary += res.boundary
    pooled.far |= res.far
    pooled.seeds += res.seeds
    pooled.total_seconds += res.total_seconds
    pooled.drafted = (pooled.drafted or 0) + (res.drafted or 0)
    pooled.accepted = (pooled.accepted or 0) + (res.accepted or 0)
    pooled.error = pooled.error or res.error
    return pooled


def _decide(res: runner.RescoreResult, sequential: bool) -> analysis.RescoreStats:
    """Today's rule on the pooled draws, with the reference's measured noise of the first
    look (the same reference throughout)."""
    return analysis.analyse(
        res.draws, alpha=ALPHA, sequential=sequential,
        ratio_bound=math.exp(2 * (res.noise_logprob or 0.0)), edge=res.edge, far=res.far,
    )  # fmt: skip


def run_looks(base: dict[str, Any], max_samples: int, n_prompts: int, control: bool) -> dict:
    """Sample look by look up to `max_samples` samples (every prompt counted), reading the
    three rules at each look; a mutant stops once all three have said BROKEN."""
    pooled: runner.RescoreResult | None = None
    start, drawn = 1, 0
    first: dict[str, int | None] = {"today": None, "anytime": None, "first_gen": None}
    why: dict[str, str] = {}
    looks: list[dict[str, Any]] = []
    for look in [n for n in LOOKS if n <= max_samples] or [max_samples]:
        seeds = math.ceil((look - drawn) / n_prompts)
        try:
            res = runner.run(request.make_request(**base, seeds=seeds, seed_start=start))
        except RescoreError as e:  # a server died: the cell says so, the table goes on
            if pooled is None:
                return {"error": str(e), "samples": drawn, "tokens": 0, "first": {}, "why": {},
                        "looks": [], "final": None}  # fmt: skip
            pooled.error = str(e)
            break
        start += seeds
        drawn += seeds * n_prompts
        pooled = _pool(pooled, res)
        if pooled.error or not pooled.draws:
            break
        today = _decide(pooled, sequential=False)
        seq = _decide(pooled, sequential=True)
        old, old_why = first_generation(pooled.draws, ALPHA)
        per = len(pooled.draws) / max(1, drawn)
        if first["today"] is None and today.verdict is Verdict.BROKEN:
            first["today"], why["today"] = drawn, today.reason
        if first["anytime"] is None and seq.crossed_at is not None:
            first["anytime"] = math.ceil(seq.crossed_at / per)
            why["anytime"] = seq.reason
        if first["first_gen"] is None and old:
            first["first_gen"], why["first_gen"] = drawn, old_why
        looks.append({
            "samples": drawn, "tokens": len(pooled.draws), "today": today.verdict.value,
            "first_gen": "BROKEN" if old else "PRESERVED",
            "tests": {t.name: t.p_value for t in today.tests},
        })  # fmt: skip
        if not control and all(v is not None for v in first.values()):
            break
    assert pooled is not None
    return {
        "error": pooled.error, "samples": drawn, "tokens": len(pooled.draws),
        "first": first, "why": why, "looks": looks, "drafted": pooled.drafted,
        "accepted": pooled.accepted, "seconds": round(pooled.total_seconds, 1),
        "final": looks[-1] if looks else None,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--max-samples", type=int, default=GOAL_SAMPLES, help="Gemma, per arm")
    ap.add_argument("--fixture-max-samples", type=int, default=500)
    ap.add_argument("--only", nargs="*", default=None, help="builds to run (default: all)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--rows", type=Path, default=None, help="a JSON of rows already measured")
    ap.add_argument(
        "--flags", action="store_true", help="also each mutant on top of spec-logprobs (flags)"
    )
    ap.add_argument("--null-runs", type=int, default=300, help="simulated exact-null runs")
    ap.add_argument("--null-tokens", type=int, default=1600, help="tokens per null run")
    ap.add_argument("--null-seed", type=int, default=7, help="the exact null's random seed")
    ap.add_argument(
        "--synthetic-runs", type=int, default=20, help="simulated runs per synthetic bug class"
    )
    ap.add_argument(
        "--simulated-only",
        action="store_true",
        help="the exact null and the synthetic bug classes alone (no server, no build)",
    )
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    null = exact_null(args.null_runs, args.null_tokens, args.null_seed) if args.null_runs else {}
    if null:
        log(f"exact null: {args.null_runs} runs in {time.monotonic() - t0:.0f} s")
        print(null_table(null, args.null_runs, args.null_tokens))
    t0 = time.monotonic()
    syn = synthetic_power(args.synthetic_runs) if args.synthetic_runs else {}
    if syn:
        log(f"synthetic bug classes: {args.synthetic_runs} runs each in "
            f"{time.monotonic() - t0:.0f} s")  # fmt: skip
        print(synthetic_table(syn, args.synthetic_runs))
    if args.simulated_only:
        if args.json:
            args.json.write_text(json.dumps({"rows": [], "null": null, "synthetic": syn}, indent=2))
        return verdict([], null, syn)
    # Ctrl-C stops at once, the servers with it (they die with their parent)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    mutants = [m for m in llama.available_mutants() if not _logprob_only(m)]
    builds = [*CONTROLS, *mutants]
    if args.flags:
        # the same bugs on the build that flags each speculated token (`rescore.flags`)
        builds += [f"spec-logprobs+{m}" for m in mutants]
    if args.only:
        builds = [b for b in builds if b in args.only or b.replace("mutants/", "") in args.only]
    fs = distribution.load_fixture(None)
    spec = fs.spec
    gemma = models.gemma_270m().path
    stock = llama.ensure()
    rows: list[dict[str, Any]] = json.loads(args.rows.read_text())["rows"] if args.rows else []
    builds = [b for b in builds if b not in {r["build"] for r in rows}]
    with (
        distribution.spawn_server(stock, fs, draft=False) as fref,
        # one thread each: two servers at their default threads spin against each other on
        # 2 cores (docs/rescore.md, "Cost")
        LlamaServer(
            stock, gemma, parallel=2, ctx_size=4096, extra_args=("-t", "1"), name="gemma-reference"
        ) as gref,
    ):
        for build in builds:
            log(f"{build}: building (or from the cache)")
            bins = binaries(build)
            control = build in CONTROLS
            row: dict[str, Any] = {"build": build}
            t0 = time.monotonic()
            with distribution.spawn_server(
                bins, fs, draft=True, draft_sampling="probabilistic"
            ) as srv:
                for temp in TEMPERATURES:
                    sampler = replace(REPORT_SAMPLER, temperature=temp)
                    base = dict(
                        url=srv.url, reference_url=fref.url,
                        prompt_ids=[spec.tokenize(spec.prompt)], tokens=FIXTURE_TOKENS,
                        sampler=sampler, alpha=ALPHA,
                        draft=fixture_ref.FixtureDraft(spec, draft_chain(sampler)),
                    )  # fmt: skip
                    row[f"fixture T={temp:g}"] = run_looks(
                        base, args.fixture_max_samples, 1, control
                    )
            with gemma_server(bins, gemma) as srv:
                for temp in TEMPERATURES:
                    sampler = replace(GEMMA_SAMPLER, temperature=temp)
                    base = dict(
                        url=srv.url, reference_url=gref.url, draft_url=gref.url,
                        prompts=list(GEMMA_PROMPTS), tokens=GEMMA_TOKENS, sampler=sampler,
                        alpha=ALPHA, concurrency=4, timeout=600.0,
                    )  # fmt: skip
                    cell = run_looks(base, args.max_samples, len(GEMMA_PROMPTS), control)
                    row[f"gemma T={temp:g}"] = cell
                    if build == "stock" and temp == 1.0 and not cell["error"]:
                        # the same number of samples again, the engine alone, fresh seeds
                        seeds = math.ceil(cell["samples"] / len(GEMMA_PROMPTS))
                        alone = asyncio.run(sample_only(
                            srv.url, gref.url, range(10_001, 10_001 + seeds), GEMMA_TOKENS, 4,
                            sampler, GEMMA_PROMPTS,
                        ))  # fmt: skip
                        row["cost"] = {"rescored_s": cell["seconds"], "sampling_s": alone}
                        log(f"cost: re-scored {cell['seconds']:.0f} s, sampling alone "
                            f"{alone:.0f} s: {cell['seconds'] / alone:.2f}x")  # fmt: skip
            log(f"{build}: {summary(row)} ({time.monotonic() - t0:.0f} s)")
            for ref in (fref, gref):
                if not ref.alive():  # its log stays (ManagedServer keeps a dead server's log)
                    log(f"the reference {ref.name} died (log {ref.log_path}); resume with --rows")
                    row["reference_died"] = str(ref.log_path)
            rows.append(row)
            if args.json:  # after every row: a cut-off run keeps what it measured
                args.json.write_text(
                    json.dumps({"rows": rows, "null": null, "synthetic": syn}, indent=2)
                )
            if "reference_died" in row:
                break
    print(table(rows, args.max_samples))
    print(noisy_table(rows))
    return verdict(rows, null, syn)


ARMS = ("fixture T=1", "fixture T=0.7", "gemma T=1", "gemma T=0.7")


def _logprob_only(mutant: str) -> bool:
    """The logprob and MTP mutants: nothing rejection sampling runs on (docs/mutants.md)."""
    return mutant.removeprefix("mutants/").startswith(("lp-", "mtp-"))


def summary(row: dict[str, Any]) -> str:
    return ", ".join(f"{a}: {_cell(row.get(a))}" for a in ARMS)


def _cell(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    if c.get("error"):
        return f"error: {c['error'][:60]}"
    f = c["first"]

    def one(k: str) -> str:
        return str(f[k]) if f[k] is not None else f">{c['samples']}"

    return f"{one('today')} / {one('anytime')} / {one('first_gen')}"


def table(rows: list[dict[str, Any]], max_samples: int) -> str:
    lines = [
        f"Samples to BROKEN, today fixed / today anytime / first generation (alpha = {ALPHA}; "
        f"fixture {FIXTURE_TOKENS} tokens per sample, Gemma {GEMMA_TOKENS} tokens per sample "
        f"over {len(GEMMA_PROMPTS)} prompts, at most {max_samples} Gemma samples per arm)",
        "",
        "| build | " + " | ".join(ARMS) + " | Gemma T=1 drafted/accepted |",
        "|---|" + "---|" * (len(ARMS) + 1),
    ]
    for r in rows:
        g = r.get("gemma T=1") or {}
        lines.append(
            f"| {r['build']} | "
            + " | ".join(_cell(r.get(a)) for a in ARMS)
            + f" | {g.get('drafted')}/{g.get('accepted')} |"
        )
    return "\n".join(lines)


def null_table(null: dict[str, dict[str, float]], runs: int, tokens: int) -> str:
    lines = [
        f"Exact null, each statistic alone at alpha = {ALPHA} ({runs} simulated runs of {tokens} "
        "tokens, top-k 40, generations of 8, the draft's q known)",
        "",
        "| statistic | false alarms | rate | 95 % upper | p (rate > alpha) |",
        "|---|---|---|---|---|",
    ]
    for name, r in sorted(null.items()):
        lines.append(
            f"| {name} | {r['alarms']}/{r['runs']} | {r['alarms'] / r['runs']:.2%} | "
            f"{r['upper95']:.2%} | {r['p_above']:.2g} |"
        )
    return "\n".join(lines)


def noisy_table(rows: list[dict[str, Any]]) -> str:
    """The controls on Gemma are the noisy null: each statistic's p-value at the last look."""
    lines = ["Gemma controls (the noisy null): each statistic's p-value at the last look", ""]
    for r in rows:
        if r["build"] not in CONTROLS:
            continue
        for a in ("gemma T=1", "gemma T=0.7"):
            c = r.get(a)
            if not c or not c.get("final"):
                continue
            tests = c["final"]["tests"]
            low = sorted(tests.items(), key=lambda kv: kv[1])[:4]
            lines.append(
                f"- {r['build']} {a}, {c['tokens']} tokens: verdict {c['final']['today']}; "
                f"smallest p: " + ", ".join(f"{k} {v:.2g}" for k, v in low)
            )
    return "\n".join(lines)


def verdict(
    rows: list[dict[str, Any]],
    null: dict[str, dict[str, float]],
    syn: dict[str, dict[str, Any]] | None = None,
) -> int:
    """Exit 1 when a control is BROKEN by today's fixed rule at its last look, a mutant is
    neither BROKEN (fixed or anytime) within `GOAL_SAMPLES` on Gemma nor loud, a statistic's
    exact-null rate exceeds alpha (one-sided binomial p < 0.001), or today's rules catch a
    synthetic bug class within `GOAL_TOKENS` in fewer runs than the first generation did
    (top-k 44 aside: the first generation called every token past the edge impossible, and so
    every quantised control BROKEN too)."""
    bad = []
    for name, row in (syn or {}).items():
        today = max(row["today"]["within_goal"], row["anytime"]["within_goal"])
        if not name.startswith("top-k") and today < row["first_gen"]["within_goal"]:
            bad.append(f"synthetic {name}: today's rules weaker than the first generation's")
    for r in rows:
        arms = [r.get(a) for a in ARMS]
        if r["build"] in CONTROLS:
            bad += [
                f"control {r['build']} {a} BROKEN"
                for a, c in zip(ARMS, arms, strict=True)
                if c and c.get("final") and c["final"]["today"] == "BROKEN"
            ]
            continue
        gemma = [r.get("gemma T=1"), r.get("gemma T=0.7")]
        caught = any(
            c and (c.get("error") or _within(c["first"]["today"]) or _within(c["first"]["anytime"]))
            for c in gemma
        )
        if not caught:
            bad.append(f"{r['build']} not BROKEN within {GOAL_SAMPLES} Gemma samples")
    bad += [f"exact null: {k} over alpha" for k, v in null.items() if v["p_above"] < 1e-3]
    for b in bad:
        log(b)
    return 1 if bad else 0


def _within(samples: int | None) -> bool:
    return samples is not None and samples <= GOAL_SAMPLES


if __name__ == "__main__":
    raise SystemExit(main())
