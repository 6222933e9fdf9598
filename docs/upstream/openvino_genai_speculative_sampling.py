"""Reproducer: OpenVINO GenAI's speculative sampling (a draft model, do_sample=True) does not
sample from the target's distribution, and the log-probabilities it reports for accepted draft
tokens are another token's.

Needs only openvino-genai (2026.4.1 here; `pip install openvino-genai==2026.4.1.0`) and a tiny
fixture model whose next-token distribution is known exactly: a one-layer llama whose logits
depend only on the previous token (`TARGET` below, rows = previous letter, columns = next
letter, all values exact in F16). Write it with specaudit (https://pypi.org/ is not needed for
that step if you have the repository):

    python -m specaudit.fixtures.openvino DIR      # DIR/target.gguf, DIR/draft/draft.gguf

then run:

    python openvino_genai_speculative_sampling.py DIR [--seeds 1000]

The script checks first that the plain pipeline reproduces the fixture exactly (its reported
log-probabilities equal log-softmax of `TARGET`), then samples seeds 1..N with top_k=3,
temperature=1, 4 new tokens, prompt ids [1, 2, 3, 1, 2] ("bcdbc") on the plain pipeline and
on the same pipeline with the draft model, and prints:
  1. tokens outside the top-3 of their previous letter (impossible under top_k=3);
  2. position 2 after a first token "f": tokens outside e / g / h (impossible), and the counts
     of e / g / h against the exact 0.3450 / 0.4520 / 0.2030, with the G-test's p-value
     (2 degrees of freedom: p = exp(-G/2));
  3. how many reported generated_log_probs differ from the exact value for their prefix
     (logprobs=1: OpenVINO reports raw log-softmax; logprobs=0: the top-k distribution's);
  4. how many seeds give another sample alone than in a batch of all seeds.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import openvino
import openvino_genai as ovg

LETTERS = "abcdefgh"
# logits[previous][next] of the target, as stored (F16) in target.gguf
TARGET = np.array(
    [
        [-1.0, 1.25, 0.5, -0.5, 0.0, -1.5, 0.75, -2.0],
        [-0.75, -1.25, 2.0, 0.25, -0.5, 0.5, -2.0, 1.0],
        [-2.5, -1.0, -3.0, 0.25, 0.0, 2.5, -1.75, -0.5],
        [0.25, 1.5, -0.5, -2.25, 0.75, -1.0, 0.0, -1.5],
        [1.0, -0.5, 0.25, 0.5, -2.0, -1.25, 1.75, -0.75],
        [-1.5, -2.25, -1.25, -1.75, -0.274169921875, -3.0, -0.00406646728515625, -0.8046875],
        [0.5, 0.0, -1.0, 1.25, -0.25, 0.75, -1.5, 2.0],
        [2.25, 0.75, 1.0, -1.0, 0.5, -0.5, 0.25, -2.5],
    ]
)
PROMPT = [1, 2, 3, 1, 2]  # "bcdbc"
TOP_K = 3
F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def raw_logprob(prev: int, tok: int) -> float:
    """log-softmax of the logits (what OpenVINO reports with logprobs=1)."""
    row = TARGET[prev]
    return float(row[tok] - np.log(np.exp(row).sum()))


def processed_logprob(prev: int, tok: int) -> float:
    """log-probability under top-k 3, temperature 1 (what it reports with logprobs=0)."""
    keep = sorted(top_k(prev))
    if tok not in keep:
        return -math.inf
    row = TARGET[prev][keep]
    return float(TARGET[prev][tok] - np.log(np.exp(row).sum()))


def top_k(prev: int) -> set[int]:
    return set(np.argsort(-TARGET[prev])[:TOP_K].tolist())


def config(seed: int, logprobs: int = 0, draft: bool = False) -> ovg.GenerationConfig:
    c = ovg.GenerationConfig()
    c.max_new_tokens = 4
    c.do_sample = True
    c.top_k = TOP_K
    c.temperature = 1.0
    c.top_p = 1.0
    c.rng_seed = seed
    c.logprobs = logprobs
    if draft:
        c.num_assistant_tokens = 3
    return c


def run(pipe: ovg.ContinuousBatchingPipeline, configs: list[ovg.GenerationConfig]) -> list:
    """All requests in one batch; (ids, log-probabilities) per request."""
    ids = openvino.Tensor(np.array([PROMPT], dtype=np.int64))
    handles = [pipe.add_request(i, ids, c) for i, c in enumerate(configs)]
    while pipe.has_non_finished_requests():
        pipe.step()
    outs = [h.read_all()[0] for h in handles]
    return [(list(o.generated_ids), list(o.generated_log_probs)) for o in outs]


def one_by_one(pipe: ovg.ContinuousBatchingPipeline, configs: list[ovg.GenerationConfig]) -> list:
    return [run(pipe, [c])[0] for c in configs]


def report(name: str, samples: list, raw: bool) -> None:
    exact = raw_logprob if raw else processed_logprob
    impossible = 0
    after_f: Counter[int] = Counter()
    wrong_lp = total_lp = 0
    for ids, lps in samples:
        prev = PROMPT[-1]
        for i, tok in enumerate(ids):
            if tok not in top_k(prev):
                impossible += 1
            if i < len(lps):
                total_lp += 1
                if not abs(lps[i] - exact(prev, tok)) <= 1e-4:
                    wrong_lp += 1
            prev = tok
        if ids[0] == LETTERS.index("f"):
            after_f[ids[1]] += 1
    keep = sorted(top_k(LETTERS.index("f")))
    other = sum(c for t, c in after_f.items() if t not in keep)
    n = sum(after_f.values()) - other
    z = TARGET[LETTERS.index("f")][keep]
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    g = 2 * sum(
        after_f[t] * math.log(after_f[t] / (n * q))
        for t, q in zip(keep, p, strict=True)
        if after_f[t]
    )
    cells = "  ".join(
        f"{LETTERS[t]} {after_f[t] / n:.3f} ({q:.4f})" for t, q in zip(keep, p, strict=True)
    )
    print(f"{name}: {len(samples)} samples")
    print(f"  tokens outside top-{TOP_K} of their previous letter: {impossible}")
    print(
        f"  position 2 after 'f': {other} outside the top-3; the other {n}, observed (exact): "
        f"{cells}; G={g:.2f}, p={math.exp(-g / 2):.3g}"
    )
    kind = "raw" if raw else "top-k"
    print(
        f"  reported log-probabilities off the exact {kind} value by > 1e-4: {wrong_lp}/{total_lp}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="the fixture: DIR/target.gguf, DIR/draft/draft.gguf")
    ap.add_argument("--seeds", type=int, default=1000)
    a = ap.parse_args()
    draft_dir = a.dir / "draft"
    if not (draft_dir / "openvino_model.xml").is_file():  # the draft must be an IR folder
        ovg.LLMPipeline(str(draft_dir / "draft.gguf"), "CPU", enable_save_ov_model=True)
    sc = ovg.SchedulerConfig()
    sc.cache_size = 1
    target = str(a.dir / "target.gguf")
    plain = ovg.ContinuousBatchingPipeline(target, sc, "CPU", F32)
    spec = ovg.ContinuousBatchingPipeline(
        target, sc, "CPU", {"draft_model": ovg.draft_model(str(draft_dir), "CPU", **F32), **F32}
    )
    print(f"openvino-genai {ovg.__version__}")
    seeds = range(1, a.seeds + 1)
    control = run(plain, [config(s, logprobs=1) for s in seeds])
    report("plain (no draft), logprobs=1", control, raw=True)
    report("draft model, logprobs=1", run(spec, [config(s, 1, True) for s in seeds]), raw=True)
    report("draft model, logprobs=0", run(spec, [config(s, 0, True) for s in seeds]), raw=False)
    few = [config(s, 0, True) for s in range(1, 51)]
    alone = [ids for ids, _ in one_by_one(spec, few)]
    batch = [ids for ids, _ in run(spec, few)]
    differ = [s for s, x, y in zip(range(1, 51), alone, batch, strict=True) if x != y]
    print(f"draft model: seeds 1..50 alone vs in one batch: {len(differ)} differ {differ[:10]}")
    plain_alone = [ids for ids, _ in one_by_one(plain, [config(s) for s in range(1, 51)])]
    plain_batch = [ids for ids, _ in run(plain, [config(s) for s in range(1, 51)])]
    n_plain = sum(x != y for x, y in zip(plain_alone, plain_batch, strict=True))
    print(f"plain: seeds 1..50 alone vs in one batch: {n_plain} differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
