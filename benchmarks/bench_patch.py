"""Cost of the spec-logprobs patch: patched vs stock speculating llama-server, per request kind.

Gemma 3 270M as its own draft (``--spec-type draft-simple``), native ``/completion``, a fixed
seed and ``ignore_eos`` so every run decodes the same tokens. Three speculating servers run
side by side: two stock ones (``stock-a``, ``stock-b``: the same binary, so their ratio is the
noise floor of this very run) and the patched one. Each round sends every request kind to all
three, in an order that rotates from round to round, so load changes hit each alike.

Two measures per request:
- decode rate (``timings.predicted_per_second``): what users see, but it moves with load;
- the server process's CPU time (utime + stime from ``/proc/<pid>/stat``) per generated token:
  what the work costs, which contention on a shared machine barely moves.

Table: medians over the rounds with min-max, and the ratios patched/stock-a and
stock-b/stock-a of the medians. Request kinds: no probabilities; ``n_probs: 3``;
``post_sampling_probs`` with ``top_k: 40``; ``post_sampling_probs`` with
``top_k: 0, top_p: 1, min_p: 0`` (the chain keeps the whole 262k vocabulary).

    .venv/bin/python benchmarks/bench_patch.py [--runs 5] [--n-predict 128] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from specaudit import llama, models
from specaudit.llama import LlamaServer
from specaudit.llama.patches import resolve

PATCH = "spec-logprobs"
PROMPT = (
    "<start_of_turn>user\nWrite a short story about a lighthouse keeper.<end_of_turn>\n"
    "<start_of_turn>model\n"
)
KINDS: dict[str, dict[str, Any]] = {
    "no probs": {},
    "n_probs 3": {"n_probs": 3},
    "post, top_k 40": {"n_probs": 3, "post_sampling_probs": True, "top_k": 40},
    "post, top_k 0": {
        "n_probs": 3,
        "post_sampling_probs": True,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
    },
}
SERVERS = ("stock-a", "stock-b", "patched")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), in seconds, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14, 15 of proc(5)


def decode(
    url: str, pid: int, n_predict: int, seed: int, extra: dict[str, Any]
) -> tuple[float, float, int, int]:
    """One request: (decode tok/s, server CPU ms per generated token, drafted, accepted)."""
    body = {
        "prompt": PROMPT,
        "n_predict": n_predict,
        "seed": seed,
        "temperature": 1.0,
        "ignore_eos": True,
        "cache_prompt": False,
        **extra,
    }
    c0 = cpu_seconds(pid)
    r = httpx.post(url + "/completion", json=body, timeout=600)
    c1 = cpu_seconds(pid)
    r.raise_for_status()
    t = r.json()["timings"]
    if t["predicted_n"] != n_predict:
        raise RuntimeError(f"decoded {t['predicted_n']} tokens, wanted {n_predict}")
    return (
        float(t["predicted_per_second"]),
        1000.0 * (c1 - c0) / n_predict,
        int(t.get("draft_n", 0)),
        int(t.get("draft_n_accepted", 0)),
    )


def _cell(v: list[float], fmt: str) -> str:
    return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"


def table(rates: dict[str, list[float]], cpu: dict[str, list[float]], runs: int) -> str:
    """The markdown table: per kind and server, medians (min-max) and the median ratios."""
    lines = [
        f"| request | measure | {' | '.join(SERVERS)} | patched/stock-a | stock-b/stock-a |",
        "|---|---|" + "---|" * (len(SERVERS) + 2),
    ]
    for kind in KINDS:
        for what, data, fmt in (("tok/s", rates, ".1f"), ("CPU ms/token", cpu, ".2f")):
            cells = [_cell(data[f"{s}|{kind}"], fmt) for s in SERVERS]
            med = {s: statistics.median(data[f"{s}|{kind}"]) for s in SERVERS}
            lines.append(
                f"| {kind} | {what} | {' | '.join(cells)} | "
                f"{med['patched'] / med['stock-a']:.3f} | {med['stock-b'] / med['stock-a']:.3f} |"
            )
    lines.append("")
    lines.append(f"Medians of {runs} rounds (min-max); ratios are of the medians.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="rounds (A/B pairs per kind), >= 5")
    ap.add_argument("--n-predict", type=int, default=128, help="tokens decoded per request")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="llama-server -t (default 1)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    args = ap.parse_args(argv)

    def progress(pct: float, msg: str) -> None:
        print(f"  building llama.cpp: {pct:3.0f}% {msg[-60:]}", file=sys.stderr, flush=True)

    stock = llama.ensure(progress=progress)
    patched = llama.ensure(patches=(resolve(PATCH),), progress=progress)
    gemma = models.gemma_270m().path
    logs = Path(tempfile.mkdtemp(prefix="specaudit-bench-"))
    print(f"stock   {stock.bin_dir}\npatched {patched.bin_dir}\nmodel   {gemma}\nlogs    {logs}")
    print(
        f"{args.runs} rounds x {args.n_predict} tokens, seed {args.seed}, temperature 1, "
        f"-t {args.threads}\n"
    )

    # one thread per server: with more, ggml's threads spin at their barriers while a sibling
    # waits for a core, and that spinning would count as CPU time on a loaded machine
    spec: dict[str, Any] = {"draft": gemma, "spec_type": "draft-simple", "ctx_size": 2048,
            "extra_args": ["-t", str(args.threads)]}  # fmt: skip
    bins = {"stock-a": stock, "stock-b": stock, "patched": patched}
    rates: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    drafts: dict[str, list[tuple[int, int]]] = {}
    with contextlib.ExitStack() as stack:
        srv = {}
        for name in SERVERS:
            s = LlamaServer(bins[name], gemma, name=f"bench-{name}", log_path=logs / name, **spec)
            srv[name] = stack.enter_context(s)
        pids = {}
        for name, s in srv.items():
            assert s.proc is not None
            pids[name] = s.proc.pid
            decode(s.url, pids[name], 16, args.seed, {})  # warm up: page faults, caches
        t0 = time.monotonic()
        for rnd in range(args.runs):
            order = SERVERS[rnd % len(SERVERS) :] + SERVERS[: rnd % len(SERVERS)]
            for kind, extra in KINDS.items():
                for name in order:
                    url, pid = srv[name].url, pids[name]
                    rate, ms, dn, da = decode(url, pid, args.n_predict, args.seed, extra)
                    rates.setdefault(f"{name}|{kind}", []).append(rate)
                    cpu.setdefault(f"{name}|{kind}", []).append(ms)
                    drafts.setdefault(f"{name}|{kind}", []).append((da, dn))
            print(f"  round {rnd + 1}/{args.runs} done ({time.monotonic() - t0:.0f} s)", flush=True)

    print()
    print(table(rates, cpu, args.runs))
    print("\ndraft tokens accepted/drafted, first round:")
    for kind in KINDS:
        print(
            f"  {kind:<16} "
            + ", ".join(
                f"{s} {drafts[f'{s}|{kind}'][0][0]}/{drafts[f'{s}|{kind}'][0][1]}" for s in SERVERS
            )
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"runs": args.runs, "n_predict": args.n_predict, "rates": rates,
                        "cpu_ms_per_token": cpu, "drafts": drafts}, indent=1)
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
