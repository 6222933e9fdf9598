"""Logprob fidelity: is each number an engine reports the probability its token was drawn from?

Why: `specaudit.check` only tells a placeholder (``logprob: 0.0`` with no candidates) from a
number. An engine or patch that returns *plausible but wrong* numbers -- the neighbouring
position's logits, pre-sampling values labelled post-sampling, the draft's probabilities, the
temperature left out, top-k renormalised over the wrong set -- passes that test as "real". This
module compares what the engine reported for a token (`specaudit.logprobs.TokenRecord`) with a
reference's distribution for the same prefix (`specaudit.reference.NextToken`) and puts the
token in one of four classes (`Fidelity`).

The tolerance for "correct" is measured, never guessed: `noise_floor` takes repeated reference
answers for the same prefix (other batch sizes, other slots, the closed form next to a server)
and `tolerance` turns their largest spread into the bound (docs/fidelity.md, "The tolerance").

The reference is anything with ``next_token(ids) -> NextToken``: the llama-server reference
client (`specaudit.reference`) or, on the fixtures, `FixtureReference`, the closed form, so
fidelity runs without a reference server there.

The rules only: no request is sent from here. Asking a server for its logprobs and classifying
them is `specaudit.check.fidelity_probe`; so the rules are tested on hand-made records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol

import numpy as np

from specaudit import fixtures
from specaudit.errors import SpecauditError
from specaudit.logprobs import FLOAT32_LOWEST, TokenClass, TokenRecord
from specaudit.reference import NextToken

Mode = Literal[
    "pre", "post"
]  # pre-sampling logprobs (n_probs, top_logprobs) or post_sampling_probs
Where = Literal["sampled", "candidate", "absent"]

#: An honest engine's answer is one more answer of the reference's spread; allowing twice the
#: largest spread seen covers an answer as far beyond the observed range as the range is wide.
SPREAD_FACTOR = 2.0
#: The engine computes and sends float32: two exact computations of the same value can differ by
#: the rounding of its softmax sum and logarithm, a few units in the last place of the value.
FLOAT32_ULPS = 4
# The sampled token's value a placeholder carries (`specaudit.logprobs`): logprob 0 / prob 1.
_PLACEHOLDER_VALUE = 0.0


class FidelityError(SpecauditError):
    """Fidelity cannot be decided (one line, exit 2): a token without an id to look up, a
    reference that gave no pre-sampling logprobs, mismatched inputs."""


class Fidelity(StrEnum):
    """What a token's reported probability is, measured against the reference."""

    REAL_CORRECT = "real-correct"  # every compared value within tolerance of the reference
    REAL_WRONG = "real-wrong"  # a number, but not the distribution the token was drawn from
    PLACEHOLDER = "placeholder"  # a value dressed as certain (logprob 0 / prob 1), no candidates
    MISSING = "missing"  # no value at all (a streamed token without a probability entry)


# ---------------------------------------------------------------------------------------------
# the noise floor and the tolerance


@dataclass(frozen=True)
class NoiseFloor:
    """The largest spread of the reference's own answers for one prefix (or the largest over
    several prefixes: `noise_floor`).

    `prob`: of a post-sampling probability (over the union of the answers' supports; a token
    absent from one answer counts as probability 0 there); `logprob`: of a pre-sampling
    logprob (over the tokens every answer's top-n holds). `prob_token`/`logprob_token`: where
    the spread was largest. `answers`: the most answers seen for one prefix; `prefixes`: how
    many prefixes were measured.
    """

    prob: float
    logprob: float
    answers: int
    prefixes: int = 1
    prob_token: int | None = None
    logprob_token: int | None = None


def spread(answers: Sequence[NextToken]) -> NoiseFloor:
    """The noise floor of one prefix from repeated answers for it (at least two)."""
    if len(answers) < 2:
        raise FidelityError("a noise floor needs at least two answers for the same prefix")
    prob, prob_tok = 0.0, None
    support = sorted({t for a in answers for t in a.probs})
    for t in support:
        vals = [float(a.probs.get(t, 0.0)) for a in answers]
        s = max(vals) - min(vals)
        if s > prob:
            prob, prob_tok = s, t
    lp, lp_tok = 0.0, None
    common = set(answers[0].logprobs)
    for a in answers[1:]:
        common &= set(a.logprobs)
    for t in sorted(common):
        vals = [float(a.logprobs[t]) for a in answers]
        if any(v <= FLOAT32_LOWEST / 2 for v in vals):
            continue  # log(0) as the float32 lowest: not a measurement
        s = max(vals) - min(vals)
        if s > lp:
            lp, lp_tok = s, t
    return NoiseFloor(prob, lp, len(answers), 1, prob_tok, lp_tok)


def noise_floor(groups: Iterable[Sequence[NextToken]]) -> NoiseFloor:
    """The largest `spread` over several prefixes, each a group of repeated answers."""
    floors = [spread(g) for g in groups]
    if not floors:
        raise FidelityError("a noise floor needs at least one prefix answered twice")
    p = max(floors, key=lambda f: f.prob)
    lp = max(floors, key=lambda f: f.logprob)
    return NoiseFloor(
        p.prob,
        lp.logprob,
        max(f.answers for f in floors),
        len(floors),
        p.prob_token,
        lp.logprob_token,
    )


def widest(a: NoiseFloor, b: NoiseFloor) -> NoiseFloor:
    """Two measurements of one reference's floor as one: the larger spread of each mode."""
    p = a if a.prob >= b.prob else b
    lp = a if a.logprob >= b.logprob else b
    return NoiseFloor(
        p.prob,
        lp.logprob,
        max(a.answers, b.answers),
        a.prefixes + b.prefixes,
        p.prob_token,
        lp.logprob_token,
    )


def float32_resolution(x: float) -> float:
    """`FLOAT32_ULPS` units in the last place of float32 `x`: the finest a float32 engine's
    number can be compared at."""
    return FLOAT32_ULPS * float(np.spacing(np.float32(abs(x))))


@dataclass(frozen=True)
class Tolerance:
    """How far a reported value may lie from the reference's and still be correct.

    The bound for a value is ``factor * floor + float32_resolution(max(|reported|,
    |expected|))`` with `floor` the measured noise floor of its mode (`prob` for
    post-sampling probabilities, `logprob` for pre-sampling logprobs).
    """

    floor: NoiseFloor
    factor: float = SPREAD_FACTOR

    @property
    def prob(self) -> float:
        return self.factor * self.floor.prob

    @property
    def logprob(self) -> float:
        return self.factor * self.floor.logprob

    def limit(self, mode: Mode, reported: float, expected: float) -> float:
        """The bound for one comparison (see the class)."""
        base = self.prob if mode == "post" else self.logprob
        return base + float32_resolution(max(abs(reported), abs(expected)))


def tolerance(floor: NoiseFloor, factor: float = SPREAD_FACTOR) -> Tolerance:
    """The tolerance the rule derives from a measured noise floor (docs/fidelity.md)."""
    if not (math.isfinite(factor) and factor >= 1.0):
        raise FidelityError(f"the spread factor must be a finite number >= 1, got {factor}")
    if not (math.isfinite(floor.prob) and math.isfinite(floor.logprob)):
        raise FidelityError("the noise floor is not finite: the reference disagrees with itself")
    return Tolerance(floor, factor)


#: The tolerance of a reference that cannot disagree with itself (a closed form answered twice):
#: float32 resolution alone. Measure the floor against a server (`noise_floor`) where there is one.
EXACT = Tolerance(NoiseFloor(0.0, 0.0, 0, 0))


# ---------------------------------------------------------------------------------------------
# one token


@dataclass(frozen=True)
class Deviation:
    """One comparison of a reported value with the reference's.

    `where`: the sampled token's own value, a reported candidate, or a token the reference
    ranks among the top but the engine left out (`absent`: `reported` is the smallest value the
    engine did report, or None if it reported fewer than asked). `score`: the error over its
    bound; above 1 the value is wrong.
    """

    where: Where
    token_id: int | None
    reported: float | None
    expected: float | None
    error: float
    limit: float

    @property
    def score(self) -> float:
        return self.error / self.limit if self.limit > 0 else math.inf if self.error else 0.0

    @property
    def wrong(self) -> bool:
        return self.error > self.limit


@dataclass(frozen=True)
class TokenFidelity:
    """One token's class, with the largest deviation found (None when nothing was compared)."""

    index: int
    token_id: int | None
    mode: Mode
    klass: Fidelity
    worst: Deviation | None = None
    compared: int = 0  # values compared with the reference


class NextTokenSource(Protocol):
    """A reference: the processed next-token distribution after the exact token ids."""

    def next_token(self, ids: Sequence[int]) -> NextToken: ...


def mode_of(record: TokenRecord) -> Mode:
    """post for ``prob``/``top_probs`` records (post_sampling_probs), pre otherwise."""
    return "post" if record.form == "prob" else "pre"


def _id(token_id: int | None, text: str, ids: Mapping[str, int] | None, what: str) -> int:
    if token_id is not None:
        return token_id
    if ids is not None and text in ids:
        return ids[text]
    raise FidelityError(
        f"{what} {text!r} came without a token id; pass the vocabulary (piece -> id) to look it up"
    )


def _lp(x: float | None) -> float | None:
    """A logprob, None for the log(0) stand-in (the float32 lowest) or nothing."""
    return None if x is None or x <= FLOAT32_LOWEST / 2 else x


def _reported(
    record: TokenRecord, mode: Mode, ids: Mapping[str, int] | None
) -> tuple[float | None, list[tuple[int, float | None]]]:
    """The sampled token's value and the candidates' (id, value), in the record's mode."""
    what = f"candidate of token {record.index}"
    if mode == "post":
        return record.prob, [
            (_id(c.token_id, c.token, ids, what), c.prob) for c in record.candidates
        ]
    cands = [(_id(c.token_id, c.token, ids, what), _lp(c.logprob)) for c in record.candidates]
    return _lp(record.logprob), cands


def _expected(ref: NextToken, mode: Mode) -> dict[int, float]:
    """The reference's values in the record's mode: the processed distribution (a token
    outside it has probability 0), or the raw top-n logprobs."""
    if mode == "post":
        return {t: float(p) for t, p in ref.probs.items()}
    if not ref.logprobs:
        raise FidelityError("the reference gave no pre-sampling logprobs to compare with")
    return {t: float(v) for t, v in ref.logprobs.items() if _lp(v) is not None}


def _compare(
    record: TokenRecord, ref: NextToken, tol: Tolerance, ids: Mapping[str, int] | None
) -> list[Deviation]:
    mode = mode_of(record)
    sampled, cands = _reported(record, mode, ids)
    expected = _expected(ref, mode)
    ranked = sorted(expected.items(), key=lambda kv: -kv[1])
    out: list[Deviation] = []

    def check(where: Where, t: int, got: float | None) -> None:
        if got is None:
            return
        if t in expected or mode == "post":
            exp = expected.get(t, 0.0)
            out.append(Deviation(where, t, got, exp, abs(got - exp), tol.limit(mode, got, exp)))
        elif ranked:
            # a pre-sampling value outside the reference's top-n: wrong only if it claims to
            # rank above the reference's n-th value
            nth = ranked[-1][1]
            out.append(
                Deviation(where, t, got, None, max(0.0, got - nth), tol.limit(mode, got, nth))
            )

    check("sampled", _id(record.token_id, record.token, ids, f"token {record.index}"), sampled)
    for t, v in cands:
        check("candidate", t, v)

    if record.requested > 0:
        out += _absent(record.requested, cands, ranked, mode, tol)
    return out


def _absent(
    requested: int,
    cands: list[tuple[int, float | None]],
    ranked: list[tuple[int, float]],
    mode: Mode,
    tol: Tolerance,
) -> list[Deviation]:
    """The top set: a token among the reference's top `requested` that the engine left out must
    rank no higher than the engine's smallest reported candidate; if fewer candidates came
    back than were asked for, the whole post-sampling support must be there."""
    out: list[Deviation] = []
    got_ids = {t for t, _ in cands}
    shown = [v for _, v in cands if v is not None]
    full = len(cands) >= requested
    for t, v in ranked[:requested]:
        if t in got_ids or (mode == "post" and v <= 0.0):
            continue
        if full and shown:
            least = min(shown)
            out.append(
                Deviation("absent", t, least, v, max(0.0, v - least), tol.limit(mode, v, least))
            )
        elif not full and mode == "post":
            out.append(Deviation("absent", t, None, v, v, tol.limit(mode, v, 0.0)))
    return out


def classify_token(
    record: TokenRecord,
    ref: NextToken | None,
    tol: Tolerance,
    ids: Mapping[str, int] | None = None,
) -> TokenFidelity:
    """One token's class. `ref` is the reference for the token's prefix (needed only when the
    engine sent a real number); `ids` maps token text to id for records without ids (OpenAI
    legacy completions)."""
    mode = mode_of(record)
    if not _has_value(record):
        return TokenFidelity(record.index, record.token_id, mode, Fidelity.MISSING)
    if record.klass is TokenClass.PLACEHOLDER:
        return TokenFidelity(record.index, record.token_id, mode, Fidelity.PLACEHOLDER)
    if ref is None:
        raise FidelityError(f"token {record.index} has a value but no reference to compare with")
    devs = _compare(record, ref, tol, ids)
    worst = max(devs, key=lambda d: d.score) if devs else None
    if worst is None or not worst.wrong:
        klass = Fidelity.REAL_CORRECT
    elif (
        record.klass is TokenClass.UNCHECKED
        and record.reported_logprob == _PLACEHOLDER_VALUE
        and worst.where == "sampled"
    ):
        # no candidates were asked for, and the value is the placeholder's exact signature
        klass = Fidelity.PLACEHOLDER
    else:
        klass = Fidelity.REAL_WRONG
    return TokenFidelity(record.index, record.token_id, mode, klass, worst, len(devs))


# ---------------------------------------------------------------------------------------------
# many tokens


@dataclass(frozen=True)
class FidelityCounts:
    real_correct: int = 0
    real_wrong: int = 0
    placeholder: int = 0
    missing: int = 0

    @property
    def total(self) -> int:
        return self.real_correct + self.real_wrong + self.placeholder + self.missing

    def __add__(self, other: FidelityCounts) -> FidelityCounts:
        return FidelityCounts(
            self.real_correct + other.real_correct,
            self.real_wrong + other.real_wrong,
            self.placeholder + other.placeholder,
            self.missing + other.missing,
        )

    def of(self, klass: Fidelity) -> int:
        return int(getattr(self, klass.value.replace("-", "_")))


def count(tokens: Iterable[TokenFidelity]) -> FidelityCounts:
    """Counts per class."""
    n = {k: 0 for k in Fidelity}
    for t in tokens:
        n[t.klass] += 1
    return FidelityCounts(
        n[Fidelity.REAL_CORRECT],
        n[Fidelity.REAL_WRONG],
        n[Fidelity.PLACEHOLDER],
        n[Fidelity.MISSING],
    )


@dataclass(frozen=True)
class FidelityResult:
    """Every token's class, the counts, and the largest deviation of a real token.

    `uncompared`: tokens with a value that came after a token whose id the response does not
    name (a streamed token held back inside a UTF-8 character): their prefix is unknown, so they
    are counted here and not classified."""

    tokens: tuple[TokenFidelity, ...]
    tolerance: Tolerance
    uncompared: int = 0
    counts: FidelityCounts = field(init=False)
    worst: TokenFidelity | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", count(self.tokens))
        scored = [t for t in self.tokens if t.worst is not None]
        object.__setattr__(
            self,
            "worst",
            max(scored, key=lambda t: t.worst.score if t.worst else 0.0, default=None),
        )

    def wrong(self) -> list[TokenFidelity]:
        return [t for t in self.tokens if t.klass is Fidelity.REAL_WRONG]


def _has_value(r: TokenRecord) -> bool:
    return not (r.reported_logprob is None and r.prob is None)


def classify(
    records: Sequence[TokenRecord],
    prompt_ids: Sequence[int],
    reference: NextTokenSource,
    tol: Tolerance,
    ids: Mapping[str, int] | None = None,
) -> FidelityResult:
    """Classify one response's tokens: token ``i``'s reference is the reference's answer after
    `prompt_ids` and the ids of tokens ``0..i-1`` (asked once per prefix).

    `records` must be one per generated token, in order (`specaudit.logprobs.align`): a token
    without a probability entry is a missing record, never left out, so no later token is
    compared at a shorter prefix. A missing record without an id (and not in `ids`) leaves the
    later prefixes unknown: the later tokens with values are counted as uncompared."""
    prefix: list[int] | None = list(prompt_ids)
    cache: dict[tuple[int, ...], NextToken] = {}
    out: list[TokenFidelity] = []
    uncompared = 0
    for r in records:
        needs_ref = _has_value(r) and r.klass is not TokenClass.PLACEHOLDER
        if needs_ref and prefix is None:
            uncompared += 1
            continue
        ref = None
        if needs_ref and prefix is not None:
            key = tuple(prefix)
            ref = cache.get(key)
            if ref is None:
                ref = cache[key] = reference.next_token(key)
        out.append(classify_token(r, ref, tol, ids))
        if prefix is None:
            continue
        if r.token_id is None and not _has_value(r) and (ids is None or r.token not in ids):
            prefix = None  # an unsent token: which one is not known
        else:
            prefix.append(_id(r.token_id, r.token, ids, f"token {r.index}"))
    return FidelityResult(tuple(out), tol, uncompared)


def merge(results: Iterable[FidelityResult]) -> FidelityResult:
    """Several responses' tokens as one result (the first one's tolerance)."""
    rs = list(results)
    if not rs:
        raise FidelityError("nothing to merge")
    return FidelityResult(
        tuple(t for r in rs for t in r.tokens), rs[0].tolerance, sum(r.uncompared for r in rs)
    )


# ---------------------------------------------------------------------------------------------
# references without a server round trip: a plain server's first token, the closed form


def next_token_from_records(pre: TokenRecord, post: TokenRecord) -> NextToken:
    """A `NextToken` from a plain server's first generated token, asked once without and once
    with ``post_sampling_probs`` (``n_predict: 1``, ``n_probs`` at least the sampler's support):
    its post-sampling candidates are the processed distribution, its pre-sampling ones the raw
    top-n."""
    if mode_of(pre) != "pre" or mode_of(post) != "post":
        raise FidelityError("need one pre-sampling and one post-sampling record")
    probs = {
        _id(c.token_id, c.token, None, "candidate"): float(c.prob)
        for c in post.candidates
        if c.prob is not None and c.prob > 0.0
    }
    logprobs = {
        _id(c.token_id, c.token, None, "candidate"): float(c.logprob)
        for c in pre.candidates
        if c.logprob is not None
    }
    return NextToken(probs, logprobs)


@dataclass
class FixtureReference:
    """The closed form as a reference: a fixture's exact next-token distribution after token
    ids, under the sampler settings the engine was asked to use (`specaudit.fixtures.truth`).

    `probs`: the processed distribution's support; `logprobs`: the raw softmax of every token
    (the fixture's vocabulary is small, so top-n is all of it).
    """

    spec: fixtures.FixtureSpec
    sampler: fixtures.SamplerSettings
    _cache: dict[str, NextToken] = field(default_factory=dict, repr=False)

    def text(self, ids: Sequence[int]) -> str:
        """The fixture context the ids spell (letters only; fixtures add no BOS)."""
        toks = self.spec.tokens
        letters = set(self.spec.letters)
        out = []
        for i in ids:
            if not (0 <= i < len(toks)) or toks[i] not in letters:
                raise FidelityError(f"token id {i} is not a letter of fixture {self.spec.name!r}")
            out.append(toks[i])
        if not out:
            raise FidelityError("a fixture prefix needs at least one letter")
        return "".join(out)

    def next_token(self, ids: Sequence[int]) -> NextToken:
        text = self.text(ids)
        key = self.spec.state_key(text)
        got = self._cache.get(key)
        if got is None:
            d = fixtures.next_token_distribution(self.spec, text, self.sampler)
            raw = fixtures.raw_distribution(self.spec, text)
            index = {t: i for i, t in enumerate(self.spec.tokens)}
            got = NextToken(
                {index[t]: p for t, p in d.items() if p > 0.0},
                {index[t]: math.log(p) for t, p in raw.items() if p > 0.0},
            )
            self._cache[key] = got
        return got

    @property
    def vocabulary(self) -> dict[str, int]:
        """Piece -> id, for records that carry no ids."""
        return {t: i for i, t in enumerate(self.spec.tokens)}


__all__ = [
    "EXACT",
    "FLOAT32_ULPS",
    "SPREAD_FACTOR",
    "Deviation",
    "Fidelity",
    "FidelityCounts",
    "FidelityError",
    "FidelityResult",
    "FixtureReference",
    "NextTokenSource",
    "NoiseFloor",
    "TokenFidelity",
    "Tolerance",
    "classify",
    "classify_token",
    "count",
    "float32_resolution",
    "merge",
    "mode_of",
    "next_token_from_records",
    "noise_floor",
    "spread",
    "tolerance",
    "widest",
]
