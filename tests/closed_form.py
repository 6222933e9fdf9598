"""Samples from a fixture's closed form (`distribution.Truth`): the one sampler every test and
calibration benchmark draws from, so that "what a correct engine outputs" means the same thing
everywhere.

`draw` makes many samples at once (vectorised over the distinct prefixes: one uniform per
sample and position, inverse cdf per prefix), optionally bent by `bend(prefix, p)` to model
a bug. `text` is one sample from its own seed, as an engine answering one request would make
it (a stand-in engine's `sample(seed)`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specaudit import distribution

Bend = Callable[[str, np.ndarray], np.ndarray]


def draw(
    truth: distribution.Truth,
    n: int,
    rng: np.random.Generator,
    bend: Bend | None = None,
) -> list[distribution.Sample]:
    """n samples (seeds 1..n) from `truth`'s closed form, each next-token distribution bent by
    `bend(prefix, p)` when given."""
    texts = np.array([""] * n, dtype=object)
    for _ in range(truth.workload.tokens):
        u = rng.random(n)
        out = np.empty(n, dtype=object)
        for prefix in sorted(set(texts)):
            idx = np.flatnonzero(texts == prefix)
            p = truth.next(prefix)
            if bend is not None:
                p = bend(prefix, p)
            cum = np.cumsum(p)
            cum[-1] = 1.0
            picks = np.searchsorted(cum, u[idx], side="right")
            out[idx] = [prefix + truth.labels[j] for j in picks]
        texts = out
    return [distribution.Sample(i + 1, str(t)) for i, t in enumerate(texts)]


def text(truth: distribution.Truth, seed: int) -> str:
    """One sample's text from its own seed: the same seed always gives the same text, whatever
    order the seeds are asked in (as a server with a per-request seed does)."""
    rng = np.random.default_rng(seed)
    out = ""
    for _ in range(truth.workload.tokens):
        p = truth.next(out)
        out += truth.labels[int(rng.choice(len(p), p=p))]
    return out
