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

Shape = Callable[[np.random.Generator, int], np.ndarray]  # (rng, n) -> n x TOP_K rows
# a bug: rows of p and of the draft's q -> the rows the buggy engine samples from
Bug = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _norm(r: np.ndarray) -> np.ndarray:
    return np.asarray(r / r.sum(axis=-1, keepdims=True))


def head(rng: np.random.Generator, n: int) -> np.ndarray:
    """n top-k 40 distributions with a heavy head, token ids shuffled (rank is not id)."""
    p = _norm(np.maximum(rng.dirichlet(HEAD_WEIGHTS, size=n), 1e-12))
    return np.take_along_axis(p, np.argsort(rng.random(p.shape), axis=1), axis=1)


def flat(rng: np.random.Generator, n: int) -> np.ndarray:
    """n flat top-k 40 distributions (Dirichlet(1)): many tokens of similar probability."""
    return _norm(np.maximum(rng.dirichlet(np.ones(TOP_K), size=n), 1e-12))


SHAPES: dict[str, Shape] = {"head": head, "flat": flat}


def draft_of(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A draft model's q for the same prefixes: p flattened a little and perturbed (a smaller
    model of the family agrees on the head, not on the details)."""
    return _norm(p**0.8 * np.exp(0.5 * rng.standard_normal(p.shape)))


def none(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return p


def temperature(t: float) -> Bug:
    """The sampler applies temperature t on top of p (p^(1/t), renormalised)."""

    def bug(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        return _norm(p ** (1.0 / t))

    return bug


def rank2_to_rank3(frac: float) -> Bug:
    """`frac` of the second most probable token's mass goes to the third."""

    def bug(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        r = p.copy()
        order = np.argsort(-p, axis=-1, kind="stable")
        rows = np.arange(len(p))
        moved = frac * r[rows, order[:, 1]]
        r[rows, order[:, 1]] -= moved
        r[rows, order[:, 2]] += moved
        return r

    return bug


def favourite_under(frac: float) -> Bug:
    """The favourite (p's argmax) sampled `frac` less often, the rest scaled up."""

    def bug(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        rows, f = np.arange(len(p)), p.argmax(axis=-1)
        pf = p[rows, f]
        r = p * ((1 - pf * (1 - frac)) / (1 - pf))[:, None]
        r[rows, f] = pf * (1 - frac)
        return _norm(r)

    return bug


def acceptance(c: float) -> Bug:
    """Speculative sampling that accepts the draft's token with min(1, c p / q) instead of
    min(1, p / q), the residual still max(0, p - q) normalised: the engine's distribution is
    min(q, c p) + (1 - sum min(q, c p)) residual."""

    def bug(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        acc = np.minimum(q, c * p)
        res = np.maximum(p - q, 0.0)
        left = 1.0 - acc.sum(axis=-1, keepdims=True)
        mass = res.sum(axis=-1, keepdims=True)
        return _norm(acc + left * res / np.maximum(mass, 1e-300))

    return bug


def residual_target(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Speculative sampling whose residual after a rejection is drawn from p itself instead of
    max(0, p - q) normalised (docs/mutants.md, residual-target): min(q, p) + (1 - sum min(q, p))
    p. It acts only at rejected drafts, so its distance from p is the rejection rate's share."""
    acc = np.minimum(q, p)
    return _norm(acc + (1.0 - acc.sum(axis=-1, keepdims=True)) * p)


BUGS: dict[str, Bug] = {
    "temperature 0.8": temperature(0.8),
    "rank 2 -> 3 (30 %)": rank2_to_rank3(0.3),
    "favourite -10 %": favourite_under(0.1),
    "accept min(1, 1.25 p/q)": acceptance(1.25),
}


def sample(rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token from each row (inverse CDF)."""
    cum = np.cumsum(rows, axis=-1)
    u = rng.random((len(rows), 1)) * cum[:, -1:]
    return np.minimum((u >= cum).sum(axis=-1), rows.shape[-1] - 1)


def _record(
    i: int, key: str, position: int, p: np.ndarray, tok: int, fav: int, q: np.ndarray | None = None
) -> TokenDraw:
    nt = NextToken(probs=dict(enumerate(p.tolist())))
    draft = None if q is None else NextToken(probs=dict(enumerate(q.tolist())))
    return TokenDraw(i, 0, position, key, tok, nt, draft_favourite=fav, draft=draft)


def run(
    n: int, rng: np.random.Generator, shape: Shape = head, bug: Bug = none, *, tag: str = ""
) -> list[TokenDraw]:
    """n tokens, each at its own prefix with its own distribution; the draft's favourite is
    the argmax of the draft's q (`draft_of`)."""
    p = shape(rng, n)
    q = draft_of(p, rng)
    toks = sample(bug(p, q), rng)
    favs = q.argmax(axis=1)
    return [_record(i, f"{tag}{i}", 0, p[i], int(toks[i]), int(favs[i])) for i in range(n)]


def chain(
    n: int,
    rng: np.random.Generator,
    shape: Shape = head,
    bug: Bug = none,
    *,
    length: int = 8,
    with_draft: bool = False,
    stale: float = 0.0,
) -> list[TokenDraw]:
    """n tokens in generations of `length`, each step's distribution a function of the token
    before it (a table of TOP_K distributions): the steps are dependent, as a real
    generation's are. `with_draft`: each record carries the draft's q, as a run with a draft
    reference does. `stale`: a history-dependent bug: once a draft has been rejected in a
    generation (each step with the rejection rate 1 - sum min(p, q) of its prefix), the
    engine's next steps are tilted by exp(stale z), z a fixed normal vector of the token two
    back, as an engine reading a stale context would: its direction changes with the history,
    the support and the scale of the ratios stay (stale 0.5: total variation about 0.14)."""
    table = shape(rng, TOP_K)
    drafts = draft_of(table, rng)
    engine = bug(table, drafts)
    cum = np.cumsum(engine, axis=1)
    reject = 1.0 - np.minimum(table, drafts).sum(axis=1)
    # the bug's own draws come from a child stream: the tokens' stream stays the bug-free one
    seq = rng.bit_generator.seed_seq
    assert isinstance(seq, np.random.SeedSequence)
    side = np.random.default_rng(seq.spawn(1)[0]) if stale else None
    tilt = None if side is None else np.exp(stale * side.standard_normal((TOP_K, TOP_K)))
    favs = drafts.argmax(axis=1)
    out = []
    prev = back = 0
    rejected = False
    for i, u in enumerate(rng.random(n)):
        pos = i % length
        if pos == 0:
            prev = back = int(u * TOP_K)
            rejected = False
            u = rng.random()
        if rejected and tilt is not None:
            row = np.cumsum(engine[prev] * tilt[back])
            tok = min(int((u * row[-1] >= row).sum()), TOP_K - 1)
        else:
            tok = min(int((u * cum[prev, -1] >= cum[prev]).sum()), TOP_K - 1)
        key = f"{i // length}:{pos}"
        q = drafts[prev] if with_draft else None
        out.append(_record(i // length, key, pos, table[prev], tok, int(favs[prev]), q))
        if side is not None and not rejected:
            rejected = bool(side.random() < reject[prev])
        back, prev = prev, tok
    return out


def repeated(
    n: int, rng: np.random.Generator, shape: Shape = head, bug: Bug = none, *, key: str = "0:"
) -> list[TokenDraw]:
    """n draws at one prefix (every seed's first token)."""
    p = shape(rng, 1)
    q = draft_of(p, rng)
    toks = sample(np.repeat(bug(p, q), n, axis=0), rng)
    fav = int(q[0].argmax())
    return [_record(i, key, 0, p[0], int(t), fav) for i, t in enumerate(toks)]


def topk_rows(
    n: int, rng: np.random.Generator, *, vocab: int = 64, exponent: float = 1.3
) -> np.ndarray:
    """n model distributions over `vocab` tokens, sorted by falling probability (token id =
    rank): rank j gets j^-exponent, perturbed by a log-normal factor and sorted again (a
    trained model's tail, whose ranks beyond 40 still hold a little mass)."""
    w = np.arange(1, vocab + 1) ** -exponent * np.exp(0.3 * rng.standard_normal((n, vocab)))
    return _norm(-np.sort(-w, axis=1))


def top_of(rows: np.ndarray, k: int) -> np.ndarray:
    """Rows cut to their top k (rows sorted by falling probability) and renormalised."""
    cut = rows.copy()
    cut[:, k:] = 0.0
    return _norm(cut)


def swapped_top(rows: np.ndarray, k: int = TOP_K) -> np.ndarray:
    """The top k of a batch shape where the k-th and (k+1)-th tokens swapped places."""
    cut = rows.copy()
    cut[:, k + 1 :] = 0.0
    cut[:, k - 1] = 0.0
    return _norm(cut)


def topk_run(
    n: int,
    rng: np.random.Generator,
    *,
    k_engine: int = TOP_K,
    swap: float = 0.0,
    vocab: int = 64,
) -> tuple[list[TokenDraw], np.ndarray]:
    """n tokens, each at its own prefix: the reference reports the top-40 of `topk_rows`; the
    engine samples from its top `k_engine` (44: a top-k off by four), and, with probability
    `swap` per prefix, from a batch shape whose 40th and 41st tokens swapped (a correct engine
    on a quantised model). Returns the draws and the model rows (for `topk_leaks`)."""
    rows = topk_rows(n, rng, vocab=vocab)
    ref = top_of(rows, TOP_K)
    eng = top_of(rows, k_engine)
    moved = rng.random(n) < swap
    eng[moved] = swapped_top(rows[moved])
    toks = sample(eng, rng)
    draws = [
        TokenDraw(i, 0, 0, f"{i}", int(toks[i]), NextToken(probs=_support(ref[i])))
        for i in range(n)
    ]
    return draws, rows


def _support(row: np.ndarray) -> dict[int, float]:
    return {int(t): float(p) for t, p in enumerate(row) if p > 0.0}


def topk_leaks(
    rows: np.ndarray, picked: list[int], rng: np.random.Generator, swap: float, shapes: int = 9
) -> tuple[float, ...]:
    """The reference's own leak (`outside.leak_units`) measured at the `picked` prefixes in
    `shapes` batch shapes, each swapping its 40th and 41st tokens with probability `swap`."""
    from specaudit.rescore.outside import leak_units

    out = []
    for i in picked:
        whole = _support(top_of(rows[i : i + 1], TOP_K)[0])
        hit = rng.random(shapes) < swap
        shape = [_support(swapped_top(rows[i : i + 1])[0]) if h else whole for h in hit]
        out.append(leak_units(whole, shape))
    return tuple(out)
