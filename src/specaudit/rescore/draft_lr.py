"""The draft as a second reference: an e-process aimed at the bugs speculation really makes.

Why: the PIT tests (`rescore.analysis`) know only the reference's distribution p, so they must
guess which way a bug moves the mass. When the draft's processed next-token distribution q is
known at every prefix too (`TokenDraw.draft`), the bugs of speculative sampling have known
shapes: each is a buggy marginal r_b(p, q), the distribution the faulty sampler actually draws
the next token from. Standard rejection sampling draws d ~ q, keeps it with probability
min(1, p(d)/q(d)) and, on rejection, draws from norm(max(0, p - q)); its marginal is exactly p.
`CATALOGUE` holds the faulty versions, each a named `Bug` with a one-line description:
draft leakage, resampling from p after a rejection, a scaled or inverted acceptance ratio, an
argmax proposal, a residual that drops the tail, a wrong temperature, a floored target
probability. A likelihood ratio against a known alternative is the most powerful test there is
(Neyman-Pearson); a mixture over a small catalogue pays only the log of its size for not
knowing which bug it is.

The e-process. For bug b and mixing weight lambda, each sampled token x_i with prefix
distributions (p_i, q_i) multiplies

    E_{b,lambda}(n) = prod_{i <= n} (1 - lambda + lambda r_b(x_i) / p_i(x_i)),

and the e-value is the average of these products with fixed prior weights (each bug family
the same weight, split evenly over its members and over `LAMBDAS`). lambda is the share of
tokens that pass through the faulty path: bonus tokens (after all k drafts were kept) and
undrafted positions come from p, so a real bug shows as (1 - lambda) p + lambda r_b with
lambda unknown (at most k / (k + 1)); a grid that reaches 1.0 covers a bug on every token.

Why it is valid (the null: every x_i ~ p_i given everything before it). p_i and q_i are
functions of the prefix, so they are known before x_i is drawn (predictable). Each r_b is
taken conditional on the reference's support (`conditioned`: r_b restricted to {p_i > 0} and
renormalised), so E[r_b(x_i) / p_i(x_i) | past] = sum_{p_i(x) > 0} r_b(x) = 1, every factor
is >= 0 (lambda in (0, 1]) with conditional mean exactly 1, and each product is a nonnegative
martingale starting at 1. A fixed-weight average of such martingales is one too, and Ville's
inequality gives P(sup_n E_n >= 1 / alpha) <= alpha: valid under any dependence between
tokens (positions, seeds, prompts sharing a prefix), at every look, for a run stopped whenever
the caller likes. The running maximum against 1/alpha is therefore a valid test however often
it was read. Draws left out must be left out for reasons fixed by the prefix, not by the
token: a draw without a draft distribution is skipped (its factor is 1); a draw whose token the
reference forbids (p_i(x) = 0, an impossible token) never happens under the null, so skipping
it changes nothing there; it is BROKEN on its own elsewhere (`rescore.analysis`), and is
counted here (`DraftEvidence.excluded`), never divided by. Mass a bug puts on such tokens is
not identifiable here; only what it does on the reference's support is.

What breaks it: a p that is not the distribution the engine should sample. Quantisation
noise between the reference and the engine (the logits move with the batch shape) makes the
true p'_i differ from the reported p_i, and E_{p'}[r/p] is then not 1; tail tokens, where r/p
is largest, are where that noise weighs most. The caller must account for the measured noise:
`ratio_bound` rho, a bound on p'_i(x) / p_i(x) over every token (e.g. exp of twice the
measured logit spread), divides each factor by its worst-case mean 1 - lambda + lambda rho,
which keeps every product a nonnegative supermartingale for every engine distribution within
that bound (Ville holds for supermartingales), at a cost in power. With rho = 1 (the default)
the reference must be exact.

What it cannot see: bugs that are not a change of the next-token marginal given the prefix
(a draft seeded with the target's random stream: a dependence between tokens; a verification
off by one position or a context that loses a token: p itself is the wrong one). The draft's
raw softmax used in the acceptance (q-raw) is covered approximately: with a top-k draft its
q_raw = Z q (Z < 1, the raw mass of the draft's top-k), an acceptance min(1, p / (Z q)), a
member of the scaled-acceptance family with c = 1/Z (Z varies by prefix, and that bug's
residual max(0, p - q_raw) differs too; the benchmark simulates it as it is).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
from scipy import special

from specaudit.rescore.records import TokenDraw

# the mixing weights lambda: the share of tokens through the faulty path (1.0: every token).
# 0.65 / 0.8 / 0.9 are there because a bug in the draft's path spares the bonus token: with
# every draft kept, k drafts per verification put k / (k + 1) of tokens through it (2, 4, 9);
# without them a leak at 0.8 was fitted better by ratio-inverted at 1.0 (named 2/40 times,
# 40/40 with them, benchmarks/bench_rescore_draft.py)
LAMBDAS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 1.0)
ACCEPT_CS = (0.8, 1.25, 1.5, 2.0)  # acceptance min(1, c p / q)
TAIL_TOPS = (4, 16)  # the residual restricted to p's k most likely tokens
THETAS = (-0.4, -0.2, 0.2, 0.5)  # r proportional to p^(1 + theta)
FLOORS = (0.01, 0.05)  # the acceptance reads max(p, f) for p
# a residual max(0, p - q) with less mass than this is empty (p = q up to rounding): its
# normalisation would only amplify rounding noise, so a sampler that must draw from it is
# taken to draw from p
EMPTY = 1e-9


@dataclass(frozen=True)
class Parts:
    """What every rejection-sampling marginal is built from, over one aligned support (last
    axis): p and q normalised, their overlap min(p, q) (the correct accepted mass), its total
    (the acceptance rate, kept as a trailing axis of length 1) and the residual norm(max(0,
    p - q)), p where that is empty."""

    p: np.ndarray
    q: np.ndarray
    overlap: np.ndarray
    accept: np.ndarray
    residual: np.ndarray

    @classmethod
    def of(cls, p: np.ndarray, q: np.ndarray) -> Parts:
        p, q = _normalised(np.asarray(p, dtype=float)), _normalised(np.asarray(q, dtype=float))
        overlap = np.minimum(p, q)
        excess = np.maximum(p - q, 0.0)
        mass = excess.sum(axis=-1, keepdims=True)
        residual = np.where(mass > EMPTY, excess / np.where(mass > EMPTY, mass, 1.0), p)
        return cls(p, q, overlap, overlap.sum(axis=-1, keepdims=True), residual)


def _normalised(a: np.ndarray) -> np.ndarray:
    total = a.sum(axis=-1, keepdims=True)
    return np.divide(a, total, out=np.zeros_like(a), where=total > 0)


def after_rejection(
    accepted: np.ndarray, s: Parts, residual: np.ndarray | None = None
) -> np.ndarray:
    """The marginal of a sampler that outputs `accepted` (the draft's probability times its
    acceptance probability, per token) and, with the rest of the mass, draws from `residual`
    (the correct one by default)."""
    rest = np.maximum(1.0 - accepted.sum(axis=-1, keepdims=True), 0.0)  # rounding: never < 0
    return accepted + rest * (s.residual if residual is None else residual)


def _leak(s: Parts) -> np.ndarray:
    return s.q


def _resample_target(s: Parts) -> np.ndarray:
    return s.overlap + (1.0 - s.accept) * s.p


def acceptance(s: Parts, c: float) -> np.ndarray:
    """Acceptance min(1, c p/q): accepted mass min(q, c p), the correct residual. c = 1 is the
    correct sampler (its marginal is p)."""
    return after_rejection(np.minimum(s.q, c * s.p), s)


def _ratio_inverted(s: Parts) -> np.ndarray:
    # min(1, q/p); where p = 0 the inverted ratio is infinite: such draft tokens are all kept
    ratio = np.divide(s.q, s.p, out=np.full_like(s.p, np.inf), where=s.p > 0)
    return after_rejection(s.q * np.minimum(1.0, ratio), s)


def _argmax_proposal(s: Parts) -> np.ndarray:
    d = np.argmax(s.q, axis=-1)[..., None]
    pd = np.take_along_axis(s.p, d, axis=-1)
    qd = np.take_along_axis(s.q, d, axis=-1)
    keep = np.minimum(1.0, np.divide(pd, qd, out=np.zeros_like(pd), where=qd > 0))
    onehot = np.zeros_like(s.p)
    np.put_along_axis(onehot, d, 1.0, axis=-1)
    return keep * onehot + (1.0 - keep) * s.residual


def _tail_residual(s: Parts, k: int) -> np.ndarray:
    """Rejections draw from max(0, p - q) on p's k most likely tokens (ties: the first in the
    support's order), renormalised; where those have no residual mass the buggy sampler has
    nothing to truncate and is taken to draw from the full residual."""
    top = np.argsort(-s.p, axis=-1, kind="stable")[..., :k]
    mask = np.zeros_like(s.p)
    np.put_along_axis(mask, top, 1.0, axis=-1)
    excess = np.maximum(s.p - s.q, 0.0) * mask
    mass = excess.sum(axis=-1, keepdims=True)
    res = np.where(mass > EMPTY, excess / np.where(mass > EMPTY, mass, 1.0), s.residual)
    return s.overlap + (1.0 - s.accept) * res


def _temperature(s: Parts, theta: float) -> np.ndarray:
    return _normalised(np.power(s.p, 1.0 + theta))


def _floor(s: Parts, f: float) -> np.ndarray:
    return after_rejection(np.minimum(s.q, np.maximum(s.p, f)), s)


@dataclass(frozen=True)
class Bug:
    """One bug of speculative sampling: `marginal(p, q)` is the distribution its faulty sampler
    draws the next token from (aligned arrays over one support, last axis; a batch of
    prefixes along the leading axes), before conditioning on the reference's support."""

    name: str
    family: str
    description: str
    build: Callable[[Parts], np.ndarray] = field(repr=False)

    def marginal(self, p: np.ndarray, q: np.ndarray) -> np.ndarray:
        return self.build(Parts.of(p, q))


def _catalogue() -> tuple[Bug, ...]:
    bugs = [
        Bug(
            "leak-draft",
            "leak",
            "tokens come from the draft's q unverified (a draft token kept without the "
            "acceptance test, a bonus token drawn from q)",
            _leak,
        ),
        Bug(
            "residual-target",
            "residual",
            "after a rejection the token is resampled from p, not from norm(max(0, p - q)) "
            "(the '- q' dropped): mass moves toward the draft's tokens",
            _resample_target,
        ),
        Bug(
            "ratio-inverted",
            "ratio-inverted",
            "the acceptance test compares with q/p instead of p/q: a draft token the target "
            "rates below the draft is always kept",
            _ratio_inverted,
        ),
        Bug(
            "argmax-proposal",
            "argmax-proposal",
            "the draft proposes its argmax while reporting its sampled q: the favourite is "
            "accepted with min(1, p/q) and nothing else is proposed",
            _argmax_proposal,
        ),
    ]
    bugs += [
        Bug(
            f"accept-c{c:g}",
            "acceptance",
            f"acceptance min(1, {c:g} p/q) instead of min(1, p/q) (a ratio of probabilities "
            "normalised over different supports, e.g. q the draft's raw softmax)",
            partial(acceptance, c=c),
        )
        for c in ACCEPT_CS
    ]
    bugs += [
        Bug(
            f"residual-top{k}",
            "tail-residual",
            f"after a rejection the residual max(0, p - q) is taken over p's {k} most likely "
            "tokens only (a truncated candidate list), so the tail never follows a rejection",
            partial(_tail_residual, k=k),
        )
        for k in TAIL_TOPS
    ]
    bugs += [
        Bug(
            f"temperature{theta:+g}",
            "temperature",
            f"tokens drawn from p^{1 + theta:g} renormalised: a temperature applied twice, "
            "or not at all, on the speculative path",
            partial(_temperature, theta=theta),
        )
        for theta in THETAS
    ]
    bugs += [
        Bug(
            f"p-floor{f:g}",
            "support",
            f"the acceptance reads max(p, {f:g}) for p (a clamped log-probability, a default "
            "for a token missing from a truncated list): draft tokens in the target's tail are "
            "kept too often",
            partial(_floor, f=f),
        )
        for f in FLOORS
    ]
    return tuple(bugs)


CATALOGUE = _catalogue()
BUGS = {b.name: b for b in CATALOGUE}


def conditioned(r: np.ndarray, p: np.ndarray) -> np.ndarray:
    """r restricted to the reference's support {p > 0} and renormalised (p itself where r has
    no mass there): the part of a bug that tokens the reference allows can show, and what
    makes every factor's mean under p exactly 1."""
    on = np.where(p > 0, np.maximum(r, 0.0), 0.0)
    mass = on.sum(axis=-1, keepdims=True)
    return np.where(mass > 0, on / np.where(mass > 0, mass, 1.0), _normalised(p))


def likelihood_ratios(
    p: np.ndarray, q: np.ndarray, tokens: np.ndarray, bugs: Sequence[Bug] = CATALOGUE
) -> np.ndarray:
    """r_b(x) / p(x) for each draw (rows) and bug (columns), r_b conditioned on p's support.

    `p`, `q`: (n, V) aligned over one support per row (zeros where a side has no mass; each
    row is normalised here), `tokens`: (n,) column indices of the sampled tokens, each with
    p > 0 (an impossible token is the caller's to exclude: ValueError)."""
    s = Parts.of(np.atleast_2d(p), np.atleast_2d(q))
    x = np.asarray(tokens, dtype=int).reshape(-1, 1)
    px = np.take_along_axis(s.p, x, axis=-1)[:, 0]
    if np.any(px <= 0):
        raise ValueError("a sampled token has reference probability 0: exclude it first")
    cols = [np.take_along_axis(conditioned(b.build(s), s.p), x, axis=-1)[:, 0] for b in bugs]
    return np.stack(cols, axis=1) / px[:, None]


def log_weights(bugs: Sequence[Bug] = CATALOGUE, lambdas: Sequence[float] = LAMBDAS) -> np.ndarray:
    """The prior weight of each (bug, lambda) component, as logs of shape (bugs, lambdas):
    each family the same weight, split evenly over its members and the lambdas. Fixed before
    any data, so the average stays a test martingale."""
    families: dict[str, int] = {}
    for b in bugs:
        families[b.family] = families.get(b.family, 0) + 1
    w = np.array([1.0 / (len(families) * families[b.family]) for b in bugs])
    return np.log(np.repeat(w[:, None] / len(lambdas), len(lambdas), axis=1))


def log_paths(
    ratios: np.ndarray, lambdas: Sequence[float] = LAMBDAS, ratio_bound: float = 1.0
) -> np.ndarray:
    """log E_{b,lambda}(n) after each draw, shape (n, bugs, lambdas): the cumulative sums of
    log((1 - lambda + lambda r/p) / (1 - lambda + lambda rho)) (-inf: a lambda = 1 component
    a token refuted)."""
    lam = np.asarray(lambdas, dtype=float)
    if lam.size == 0 or np.any(lam <= 0) or np.any(lam > 1):
        raise ValueError("lambdas must lie in (0, 1]")
    if not ratio_bound >= 1.0:
        raise ValueError(f"ratio_bound {ratio_bound} < 1: it bounds p'(x)/p(x) from above")
    factors = (1.0 - lam + lam * ratios[:, :, None]) / (1.0 - lam + lam * ratio_bound)
    with np.errstate(divide="ignore"):
        return np.cumsum(np.log(factors), axis=0)


@dataclass(frozen=True)
class DraftEvidence:
    """What the draft-aimed e-process found.

    `e_value`: the running maximum of the mixture (the number to hold against 1/alpha);
    `final_e_value`: its value after the last draw; `crossed_at`: how many draws (counted in
    the input, skipped ones included) had been read when it first reached 1/alpha (None:
    never); `log_e_by_bug`: each bug's log e-value after the last draw (its lambdas averaged);
    `best_bug` / `best_lambda`: the component carrying most evidence at the end, the likely bug
    when BROKEN; `used`: draws in the product; `excluded`: draws of a token the reference gives
    probability 0 (impossible: decided elsewhere); `without_draft`: draws with no draft
    distribution."""

    e_value: float
    final_e_value: float
    crossed_at: int | None
    log_e_by_bug: dict[str, float]
    best_bug: str | None
    best_lambda: float | None
    used: int
    excluded: int
    without_draft: int
    alpha: float

    @property
    def broken(self) -> bool:
        return self.e_value >= 1.0 / self.alpha

    def summary(self) -> str:
        """The finding in words, naming the likely bug when there is one."""
        head = (
            f"draft-aimed e-process over {self.used} tokens: max {self.e_value:.3g} "
            f"({'>=' if self.broken else '<'} 1/alpha = {1 / self.alpha:.3g})"
        )
        if self.crossed_at is not None:
            head += f", crossed after {self.crossed_at} draws"
        if self.broken and self.best_bug is not None:
            head += (
                f"; most evidence: {self.best_bug} ({BUGS[self.best_bug].description}) on "
                f"about {self.best_lambda:.0%} of tokens"
            )
        return head


def evidence_from_ratios(
    ratios: np.ndarray,
    alpha: float,
    *,
    bugs: Sequence[Bug] = CATALOGUE,
    lambdas: Sequence[float] = LAMBDAS,
    ratio_bound: float = 1.0,
    index: np.ndarray | None = None,
    excluded: int = 0,
    without_draft: int = 0,
) -> DraftEvidence:
    """The e-process of `likelihood_ratios` rows (in sampling order). `index`: each row's
    1-based position in the caller's sequence (for `crossed_at`; default 1..n)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha {alpha} is not in (0, 1)")
    n = ratios.shape[0]
    if n and ratios.shape[1] != len(bugs):
        raise ValueError(f"{ratios.shape[1]} ratio columns for {len(bugs)} bugs")
    if n == 0:
        return DraftEvidence(1.0, 1.0, None, {}, None, None, 0, excluded, without_draft, alpha)
    paths = log_paths(ratios, lambdas, ratio_bound)
    mix = special.logsumexp(paths + log_weights(bugs, lambdas)[None], axis=(1, 2))
    top = float(np.max(mix))
    over = np.nonzero(mix >= math.log(1.0 / alpha))[0]
    rows = np.arange(1, n + 1) if index is None else np.asarray(index)
    last = paths[-1]
    by_bug = special.logsumexp(last, axis=1) - math.log(len(lambdas))
    best = int(np.argmax(by_bug))
    return DraftEvidence(
        e_value=math.exp(min(top, 700.0)),
        final_e_value=math.exp(min(float(mix[-1]), 700.0)),
        crossed_at=int(rows[over[0]]) if len(over) else None,
        log_e_by_bug={b.name: float(v) for b, v in zip(bugs, by_bug, strict=True)},
        best_bug=bugs[best].name,
        best_lambda=float(lambdas[int(np.argmax(last[best]))]),
        used=n,
        excluded=excluded,
        without_draft=without_draft,
        alpha=alpha,
    )


@dataclass(frozen=True)
class Aligned:
    """Draws as aligned arrays: `p`, `q` (used draws x widest union support, zero-padded),
    `tokens` (column of each sampled token), `index` (1-based position in the input) and the
    counts of draws left out."""

    p: np.ndarray
    q: np.ndarray
    tokens: np.ndarray
    index: np.ndarray
    excluded: int
    without_draft: int


def align(draws: Sequence[TokenDraw]) -> Aligned:
    """Each usable draw's p and q over the union of their supports (token ids sorted). Left
    out: a draw without a draft distribution (or an empty one), and a draw whose token the
    reference gives probability 0 (impossible)."""
    rows: list[tuple[list[float], list[float], int, int]] = []
    excluded = without = 0
    for i, d in enumerate(draws, start=1):
        if d.draft is None or sum(d.draft.probs.values()) <= 0:
            without += 1
            continue
        if d.ref.probs.get(d.token, 0.0) <= 0:
            excluded += 1
            continue
        ids = sorted(set(d.ref.probs) | set(d.draft.probs))
        p = [d.ref.probs.get(t, 0.0) for t in ids]
        q = [d.draft.probs.get(t, 0.0) for t in ids]
        rows.append((p, q, ids.index(d.token), i))
    width = max((len(r[0]) for r in rows), default=1)
    p_arr, q_arr = np.zeros((len(rows), width)), np.zeros((len(rows), width))
    for j, (p, q, _x, _i) in enumerate(rows):
        p_arr[j, : len(p)], q_arr[j, : len(q)] = p, q
    tokens = np.array([r[2] for r in rows], dtype=int)
    index = np.array([r[3] for r in rows], dtype=int)
    return Aligned(p_arr, q_arr, tokens, index, excluded, without)


def draft_e_process(
    draws: Sequence[TokenDraw], alpha: float, *, ratio_bound: float = 1.0
) -> DraftEvidence:
    """The draft-aimed e-process over re-scored draws (in sampling order) that carry the
    draft's distribution (`TokenDraw.draft`): BROKEN when `e_value` >= 1/alpha, valid at every
    look (module docstring). `ratio_bound`: the caller's bound on p_engine(x) / p_ref(x) from
    the measured reference noise (1: the reference is exact)."""
    a = align(draws)
    ratios = likelihood_ratios(a.p, a.q, a.tokens) if len(a.tokens) else np.zeros((0, 0))
    return evidence_from_ratios(
        ratios,
        alpha,
        ratio_bound=ratio_bound,
        index=a.index,
        excluded=a.excluded,
        without_draft=a.without_draft,
    )


__all__ = [
    "ACCEPT_CS",
    "BUGS",
    "CATALOGUE",
    "EMPTY",
    "FLOORS",
    "LAMBDAS",
    "TAIL_TOPS",
    "THETAS",
    "Aligned",
    "Bug",
    "DraftEvidence",
    "Parts",
    "acceptance",
    "after_rejection",
    "align",
    "conditioned",
    "draft_e_process",
    "evidence_from_ratios",
    "likelihood_ratios",
    "log_paths",
    "log_weights",
]
