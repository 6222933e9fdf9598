"""Cost of re-scoring: sampling alone vs sampling plus re-scoring, side by side on Gemma 3 270M.

The engine under test is Gemma speculating with itself as its draft (``--spec-type
draft-simple``); the reference is a plain llama-server on the same file. Each round runs both
arms on the same seeds (a fresh seed range per round, so no prompt cache carries over), in an
order that alternates from round to round, so load changes hit both alike:

- ``sampling``: the engine's samples alone (`rescore.sampling.ServerSampler`, the same
  concurrency as a re-scored run);
- ``rescored``: `rescore.run`: the same samples, and a reference request for every sampled
  token whose prefix is new (prefix cache, prompt cache, interleaved with sampling);
- ``+draft``: the same with the draft's q as the second reference (the reference server asked
  at llama.cpp's draft chain, as ``rescore --draft-url`` does; the e-process and the draft
  tests need it);
- ``+draft+control``: and the control arm `rescore` runs by default (the reference sampled at
  the same seeds as if it were the engine, through the same test).

Goal (docs/rescore.md): the re-scored run takes at most 2x sampling alone. The control arm
samples the reference as many times again: its cost is printed, not held to the goal.

    .venv/bin/python benchmarks/bench_rescore.py [--rounds 5] [--seeds 20] [--tokens 8]
        [--arms sampling rescored +draft +draft+control]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence

from specaudit import llama, models
from specaudit.fixtures import SamplerSettings
from specaudit.llama import LlamaServer
from specaudit.reference import Reference
from specaudit.rescore import request, runner
from specaudit.rescore.sampling import ServerSampler

SAMPLER = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=1.0)


async def sample_only(
    url: str,
    ref_url: str,
    seeds: range,
    tokens: int,
    conc: int,
    sampler: SamplerSettings = SAMPLER,
    texts: Sequence[str] = request.DEFAULT_PROMPTS,
) -> float:
    """Seconds to draw every (seed, prompt) sample from the engine, `conc` at a time."""
    async with Reference(ref_url, sampler) as ref:  # tokenises the prompts, untimed
        prompts = [await ref.tokenize(p) for p in texts]
    smp = ServerSampler(url, sampler, tokens, concurrency=conc)
    sem = asyncio.Semaphore(conc)

    async def one(seed: int, p: int) -> None:
        async with sem:
            await smp.sample(p, prompts[p], seed)

    t0 = time.monotonic()
    try:
        jobs = request.seed_jobs(seeds.start, len(seeds), len(prompts))  # as rescore.run draws
        await asyncio.gather(*(one(s, p) for s, p in jobs))
    finally:
        await smp.aclose()
    return time.monotonic() - t0


ARMS = ("sampling", "rescored", "+draft", "+draft+control")


def rescored(
    url: str, ref_url: str, seeds: range, tokens: int, conc: int, arm: str = "rescored"
) -> tuple[float, int]:
    req = request.make_request(
        url,
        reference_url=ref_url,
        seeds=len(seeds),
        seed_start=seeds.start,
        tokens=tokens,
        sampler=SAMPLER,
        concurrency=conc,
        timeout=600.0,  # a request may queue behind the reference's noise probe on 2 cores
        draft_url=ref_url if "draft" in arm else None,
        control="control" in arm,
    )
    t0 = time.monotonic()
    res = runner.run(req)
    if res.error or res.stats is None:
        raise RuntimeError(res.error)
    return time.monotonic() - t0, res.reference_requests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=20, help="seeds per prompt per round")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per server (two servers share the machine: on 2 cores, 2 threads "
        "each spin against each other and a 6-token prompt took 4 s instead of 50 ms)",
    )
    args = ap.parse_args(argv)
    bins = llama.ensure()
    gemma = models.gemma_270m().path
    conc = args.concurrency
    threads = ("-t", str(args.threads))
    eng = LlamaServer(
        bins, gemma, draft=gemma, spec_type="draft-simple", parallel=2, ctx_size=8192,
        extra_args=threads, name="engine",
    )  # fmt: skip
    ref = LlamaServer(bins, gemma, parallel=2, ctx_size=8192, extra_args=threads, name="reference")
    times: dict[str, list[float]] = {a: [] for a in args.arms}
    reqs: dict[str, list[int]] = {a: [] for a in args.arms}
    with eng, ref:
        for r in range(args.rounds):
            # seeds per prompt; each prompt draws its own seeds (request.seed_jobs)
            first = 1 + r * args.seeds * len(request.DEFAULT_PROMPTS)
            seeds = range(first, first + args.seeds)
            # the order rotates from round to round: load changes hit every arm alike
            turn = r % len(args.arms)
            for arm in args.arms[turn:] + args.arms[:turn]:
                if arm == "sampling":
                    t = asyncio.run(sample_only(eng.url, ref.url, seeds, args.tokens, conc))
                    n = 0
                else:
                    t, n = rescored(eng.url, ref.url, seeds, args.tokens, conc, arm)
                times[arm].append(t)
                reqs[arm].append(n)
            print(
                f"round {r + 1}: " + ", ".join(f"{a} {v[-1]:.2f} s" for a, v in times.items()),
                file=sys.stderr,
                flush=True,
            )
    n_tok = args.seeds * len(request.DEFAULT_PROMPTS) * args.tokens
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\nGemma 3 270M, draft-simple with itself; {args.seeds} seeds x "
        f"{len(request.DEFAULT_PROMPTS)} prompts x {args.tokens} tokens = {n_tok} tokens per "
        f"round, concurrency {conc}, {args.threads} thread(s) per server, {args.rounds} rounds\n"
    )
    print("| arm | median s | min-max s | reference requests |")
    print("|---|---|---|---|")
    for k, v in times.items():
        rq = f"{statistics.median(reqs[k]):.0f}"
        print(f"| {k} | {med[k]:.2f} | {min(v):.2f}-{max(v):.2f} | {rq} |")
    if "sampling" not in med:
        return 0
    for k in med:
        if k != "sampling":
            goal = "" if "control" in k else " (goal <= 2)"
            print(f"{k} / sampling = {med[k] / med['sampling']:.2f}{goal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
