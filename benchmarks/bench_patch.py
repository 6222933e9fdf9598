"""Decode speed of the spec-logprobs patch: patched vs stock speculating llama-server.

Gemma 3 270M as its own draft (``--spec-type draft-simple``), native ``/completion``, a fixed
seed and ``ignore_eos`` so every run decodes the same number of tokens. For each request kind
(no probabilities, ``n_probs: 3``, ``n_probs: 3`` with ``post_sampling_probs``) the stock and
patched servers are run alternately, round after round, so a change in machine load hits both
alike; the figure is the median over the rounds of the server's own decode rate
(``timings.predicted_per_second``, which excludes prompt processing). A plain server without
speculation is measured the same way for context.

    .venv/bin/python benchmarks/bench_patch.py [--runs 5] [--n-predict 128]

Both speculating servers draw the same tokens (same seed, same arithmetic, greedy drafting),
so they verify the same drafts: the difference is the cost of the probabilities alone.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from specaudit import llama, models
from specaudit.llama import LlamaServer

PATCH = "spec-logprobs"
PROMPT = (
    "<start_of_turn>user\nWrite a short story about a lighthouse keeper.<end_of_turn>\n"
    "<start_of_turn>model\n"
)
KINDS: dict[str, dict[str, Any]] = {
    "no probs": {},
    "n_probs 3": {"n_probs": 3},
    "n_probs 3 + post": {"n_probs": 3, "post_sampling_probs": True},
}


def decode(url: str, n_predict: int, seed: int, extra: dict[str, Any]) -> tuple[float, int, int]:
    """One request; returns (decode tok/s, draft tokens, accepted draft tokens)."""
    body = {
        "prompt": PROMPT,
        "n_predict": n_predict,
        "seed": seed,
        "temperature": 1.0,
        "ignore_eos": True,
        **extra,
    }
    r = httpx.post(url + "/completion", json=body, timeout=600)
    r.raise_for_status()
    t = r.json()["timings"]
    if t["predicted_n"] != n_predict:
        raise RuntimeError(f"decoded {t['predicted_n']} tokens, wanted {n_predict}")
    return (
        float(t["predicted_per_second"]),
        int(t.get("draft_n", 0)),
        int(t.get("draft_n_accepted", 0)),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="rounds per configuration (median)")
    ap.add_argument("--n-predict", type=int, default=128, help="tokens decoded per request")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    def progress(pct: float, msg: str) -> None:
        print(f"  building llama.cpp: {pct:3.0f}% {msg[-60:]}", file=sys.stderr, flush=True)

    stock = llama.ensure(progress=progress)
    patched = llama.ensure(patches=(PATCH,), progress=progress)
    gemma = models.gemma_270m().path
    logs = Path(tempfile.mkdtemp(prefix="specaudit-bench-"))
    print(f"stock   {stock.bin_dir}\npatched {patched.bin_dir}\nmodel   {gemma}\nlogs    {logs}")
    print(f"{args.runs} rounds x {args.n_predict} tokens, seed {args.seed}, temperature 1\n")

    spec = {"draft": gemma, "spec_type": "draft-simple", "ctx_size": 2048}
    servers = {
        "plain": (stock, {"ctx_size": 2048}),
        "stock": (stock, spec),
        "patched": (patched, spec),
    }
    rates: dict[tuple[str, str], list[float]] = {}
    drafts: dict[tuple[str, str], tuple[int, int]] = {}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, (bins, kw) in servers.items():
            srv = LlamaServer(
                bins, gemma, name=f"bench-{name}", log_path=logs / f"{name}.log", **kw
            )
            urls[name] = stack.enter_context(srv).url
        for url in urls.values():  # warm up: first-touch page faults, caches
            decode(url, 16, args.seed, {})
        t0 = time.monotonic()
        for rnd in range(args.runs):
            for kind, extra in KINDS.items():
                for name, url in urls.items():
                    rate, dn, da = decode(url, args.n_predict, args.seed, extra)
                    rates.setdefault((name, kind), []).append(rate)
                    drafts[(name, kind)] = (da, dn)
            print(f"  round {rnd + 1}/{args.runs} done ({time.monotonic() - t0:.0f} s)", flush=True)

    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\ndecode tok/s, median of {args.runs} (min-max)")
    cols = ("plain", "stock spec", "patched spec")
    header = f"{'request':<18} " + " ".join(f"{c:>16}" for c in cols) + f" {'patched/stock':>14}"
    print(header)
    print("-" * len(header))

    def cell(name: str, kind: str) -> str:
        v = rates[(name, kind)]
        return f"{med[(name, kind)]:6.2f} ({min(v):.1f}-{max(v):.1f})"

    for kind in KINDS:
        ratio = med[("patched", kind)] / med[("stock", kind)]
        print(
            f"{kind:<18} {cell('plain', kind):>16} {cell('stock', kind):>16} "
            f"{cell('patched', kind):>16} {ratio:>13.3f}x"
        )
    # on a shared machine the fastest run is the least disturbed one: show its ratios too
    best = {k: max(v) for k, v in rates.items()}
    print(
        "\npatched/stock, fastest run of each: "
        + ", ".join(
            f"{kind}: {best[('patched', kind)] / best[('stock', kind)]:.3f}x" for kind in KINDS
        )
    )
    print("\ncost of the probabilities relative to the same server without them (medians):")
    for name in ("plain", "stock", "patched"):
        parts = [
            f"{kind}: {med[(name, kind)] / med[(name, 'no probs')]:.3f}x"
            for kind in KINDS
            if kind != "no probs"
        ]
        print(f"  {name:<8} " + ", ".join(parts))
    for kind in KINDS:
        for name in ("stock", "patched"):
            acc, n = drafts[(name, kind)]
            print(f"  draft acceptance, {name} / {kind}: {acc}/{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
