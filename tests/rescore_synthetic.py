"""Simulated re-scored runs for the q-free tests (`specaudit.rescore.scores`): next-token
distributions shaped like a top-k 40 sampler's, tokens drawn from them or from a bug's
distortion of them, as `TokenDraw` records.

The unit tests (tests/unit/test_rescore_scores.py) run a few of these; the calibration and
power study (benchmarks/bench_rescore_scores.py) runs hundreds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specaudit.reference import NextToken
from specaudit.rescore.records import TokenDraw

TOP_K = 40
# Dirichlet weights of the ranks of a "head" distribution: rank j gets 2 j^-1.5, so the top
# token holds about 40 % of the mass on average, the second about 15 %, and the last ranks of
# the top 40 next to nothing (a trained model's next token at T = 1).
HEAD_WEIGHTS = 2.0 * np.arange(1, TOP_K + 1) ** -1.5

Shape = Callable[[np.random.Generator], np.ndarray]
# a bug: p (and the draft's q) -> the distribution the buggy engine samples from
Bug = Callable[[np.ndarray, np.ndarray], np.ndarray]


def head(rng: np.random.Generator) -> np.ndarray:
    """A top-k 40 distribution with a heavy head, token ids shuffled (rank is not id)."""
    p = np.maximum(rng.dirichlet(HEAD_WEIGHTS), 1e-12)
    return rng.permutation(p / p.sum())


def flat(rng: np.random.Generator) -> np.ndarray:
    """A flat top-k 40 distribution (Dirichlet(1)): many tokens of similar probability."""
    p = np.maximum(rng.dirichlet(np.ones(TOP_K)), 1e-12)
    return p / p.sum()


SHAPES: dict[str, Shape] = {"head": head, "flat": flat}


def draft_of(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A draft model's q for the same prefix: p flattened a little and perturbed (a smaller
    model of the family agrees on the head, not on the details)."""
    q = p**0.8 * np.exp(0.5 * rng.standard_normal(len(p)))
    return q / q.sum()


def none(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return p


def temperature(t: float) -> Bug:
    """The sampler applies temperature t on top of p (p^(1/t), renormalised)."""

    def bug(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        r = p ** (1.0 / t)
        return r / r.sum()

    return bug


def rank2_to_rank3(frac: float) -> Bug:
    """`frac` of the second most probable token's mass goes to the third."""

    def bug(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        r = p.copy()
        order = np.argsort(-p, kind="stable")
        moved = frac * r[order[1]]
        r[order[1]] -= moved
        r[order[2]] += moved
        return r

    return bug


def favourite_under(frac: float) -> Bug:
    """The favourite (p's argmax) sampled `frac` less often, the rest scaled up."""

    def bug(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        f = int(np.argmax(p))
        r = p * (1 - p[f] * (1 - frac)) / (1 - p[f])
        r[f] = p[f] * (1 - frac)
        return r / r.sum()

    return bug


def acceptance(c: float) -> Bug:
    """Speculative sampling that accepts the draft's token with min(1, c p / q) instead of
    min(1, p / q), the residual still max(0, p - q) normalised: the engine's distribution is
    min(q, c p) + (1 - sum min(q, c p)) residual."""

    def bug(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        acc = np.minimum(q, c * p)
        res = np.maximum(p - q, 0.0)
        left = 1.0 - acc.sum()
        r = acc + (left * res / res.sum() if res.sum() > 0 else 0.0)
        return r / r.sum()

    return bug


BUGS: dict[str, Bug] = {
    "temperature 0.8": temperature(0.8),
    "rank 2 -> 3 (30 %)": rank2_to_rank3(0.3),
    "favourite -10 %": favourite_under(0.1),
    "accept min(1, 1.25 p/q)": acceptance(1.25),
}


def _record(i: int, key: str, position: int, p: np.ndarray, tok: int, fav: int) -> TokenDraw:
    nt = NextToken(probs=dict(enumerate(p.tolist())))
    return TokenDraw(i, 0, position, key, tok, nt, draft_favourite=fav)


def run(
    n: int, rng: np.random.Generator, shape: Shape = head, bug: Bug = none, *, tag: str = ""
) -> list[TokenDraw]:
    """n tokens, each at its own prefix with its own distribution; the draft's favourite is
    the argmax of the draft's q (`draft_of`)."""
    out = []
    for i in range(n):
        p = shape(rng)
        q = draft_of(p, rng)
        tok = int(rng.choice(len(p), p=bug(p, q)))
        out.append(_record(i, f"{tag}{i}", 0, p, tok, int(np.argmax(q))))
    return out


def chain(
    n: int, rng: np.random.Generator, shape: Shape = head, bug: Bug = none, *, length: int = 8
) -> list[TokenDraw]:
    """n tokens in generations of `length`, each step's distribution a function of the token
    before it (a table of TOP_K distributions): the steps are dependent, as a real
    generation's are."""
    table = [shape(rng) for _ in range(TOP_K)]
    drafts = [draft_of(p, rng) for p in table]
    out = []
    prev = 0
    for i in range(n):
        pos = i % length
        if pos == 0:
            prev = int(rng.integers(TOP_K))
        p, q = table[prev], drafts[prev]
        tok = int(rng.choice(len(p), p=bug(p, q)))
        out.append(_record(i // length, f"{i // length}:{pos}", pos, p, tok, int(np.argmax(q))))
        prev = tok
    return out


def repeated(
    n: int, rng: np.random.Generator, shape: Shape = head, bug: Bug = none, *, key: str = "0:"
) -> list[TokenDraw]:
    """n draws at one prefix (every seed's first token)."""
    p = shape(rng)
    q = draft_of(p, rng)
    toks = rng.choice(len(p), size=n, p=bug(p, q))
    return [_record(i, key, 0, p, int(t), int(np.argmax(q))) for i, t in enumerate(toks)]
