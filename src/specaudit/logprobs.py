"""One token-record type for every logprobs schema llama-server (and OpenAI) speaks.

Why: the fault this project exists for is a *missing* value dressed as a certain one. A
speculating llama-server sends ``logprob: 0.0`` (or ``prob: 1.0``) with no candidates, and in
streams it sends the token with no probability entry at all. So a record's `logprob` is None
whenever the value is missing, never 0.0, and aggregates must say what to do with missing
values (`Missing`). A logprob of exactly 0 with candidates is real: small models are that sure.

Schemas normalised:
- OpenAI chat/completions: ``choices[0].logprobs.content[i] = {token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}]}`` (llama-server adds ``id``); streams carry one such
  list per chunk, or ``logprobs: null``.
- OpenAI legacy completions: ``logprobs = {tokens, token_logprobs, top_logprobs: [{tok: lp}]}``.
- llama-server native ``completion_probabilities[i] = {id, token, bytes, logprob,
  top_logprobs}`` or, with ``post_sampling_probs``, ``{..., prob, top_probs: [{.., prob}]}``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from specaudit.errors import SpecauditError

JSON = dict[str, Any]

# llama-server writes log(0) as the float32 lowest value so JSON has no -inf.
FLOAT32_LOWEST = -3.4028234663852886e38


class TokenClass(StrEnum):
    REAL = "real"  # candidates were returned: the value is the server's real number
    PLACEHOLDER = "placeholder"  # k>0 candidates requested, none returned: value is missing
    UNCHECKED = "unchecked"  # no candidates requested: cannot tell a placeholder from a value


class Missing(StrEnum):
    """What an aggregate does with tokens whose logprob is missing."""

    NAIVE = "naive"  # use what the server reported (what a trusting client computes)
    SKIP = "skip"  # leave them out
    RAISE = "raise"  # refuse to aggregate


class MissingLogprobError(ValueError):
    pass


@dataclass(frozen=True)
class Candidate:
    token: str
    logprob: float | None  # None when only a probability was sent and it is 0
    token_id: int | None = None
    prob: float | None = None  # post-sampling form


@dataclass(frozen=True)
class TokenRecord:
    """One generated token as the server reported it, with explicit missing-value semantics."""

    index: int  # position in the response, 0 = first generated token
    token: str
    token_id: int | None
    logprob: float | None  # natural log; None when missing (placeholder) or not sent
    reported_logprob: float | None  # exactly what the server sent (0.0 for a placeholder)
    candidates: tuple[Candidate, ...]
    requested: int  # number of candidates requested (top_logprobs / n_probs)
    klass: TokenClass
    form: str = "logprob"  # "logprob" or "prob" (post_sampling_probs)
    prob: float | None = None  # post-sampling probability when form == "prob"

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def n_candidates(self) -> int:
        return len(self.candidates)


def _f(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x)


def _log(p: float | None) -> float | None:
    if p is None:
        return None
    if p <= 0.0:
        return FLOAT32_LOWEST
    return math.log(p)


def classify(requested: int, n_candidates: int) -> TokenClass:
    if requested <= 0:
        return TokenClass.UNCHECKED if n_candidates == 0 else TokenClass.REAL
    return TokenClass.REAL if n_candidates > 0 else TokenClass.PLACEHOLDER


def _record(index: int, entry: JSON, requested: int) -> TokenRecord:
    """A record from one ``{token, logprob|prob, top_logprobs|top_probs}`` entry."""
    if "prob" in entry or "top_probs" in entry:
        form = "prob"
        prob = _f(entry.get("prob"))
        reported = _log(prob)
        cands = tuple(
            Candidate(
                token=str(c.get("token", "")),
                logprob=_log(_f(c.get("prob"))),
                token_id=c.get("id"),
                prob=_f(c.get("prob")),
            )
            for c in (entry.get("top_probs") or [])
            if isinstance(c, dict)
        )
    else:
        form = "logprob"
        prob = None
        reported = _f(entry.get("logprob"))
        cands = tuple(
            Candidate(
                token=str(c.get("token", "")), logprob=_f(c.get("logprob")), token_id=c.get("id")
            )
            for c in (entry.get("top_logprobs") or [])
            if isinstance(c, dict)
        )
    klass = classify(requested, len(cands))
    real = klass is not TokenClass.PLACEHOLDER
    return TokenRecord(
        index=index,
        token=str(entry.get("token", "")),
        token_id=entry.get("id") if isinstance(entry.get("id"), int) else None,
        logprob=reported if real else None,
        reported_logprob=reported,
        candidates=cands,
        requested=requested,
        klass=klass,
        form=form,
        prob=(prob if real else None) if form == "prob" else None,
    )


def _missing(index: int, token: str, token_id: int | None, requested: int) -> TokenRecord:
    """A streamed token that arrived with no probability entry at all."""
    klass = TokenClass.PLACEHOLDER if requested > 0 else TokenClass.UNCHECKED
    return TokenRecord(index, token, token_id, None, None, (), requested, klass)


def from_entries(entries: Sequence[JSON], requested: int, start: int = 0) -> list[TokenRecord]:
    return [_record(start + i, e, requested) for i, e in enumerate(entries) if isinstance(e, dict)]


def _legacy_completions(lp: JSON, requested: int) -> list[TokenRecord]:
    tokens = lp.get("tokens") or []
    lps = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    out = []
    for i, tok in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        entry = {
            "token": tok,
            "logprob": lps[i] if i < len(lps) else None,
            "top_logprobs": [{"token": k, "logprob": v} for k, v in top.items()],
        }
        out.append(_record(i, entry, requested))
    return out


def from_response(endpoint: str, body: JSON, requested: int) -> list[TokenRecord]:
    """Token records of a non-streamed response.

    `endpoint` is "chat", "completions" or "completion" (native).
    """
    if endpoint == "completion":
        return from_entries(body.get("completion_probabilities") or [], requested)
    choices = body.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return []
    lp = choices[0].get("logprobs")
    if not isinstance(lp, dict):
        return []
    if isinstance(lp.get("content"), list):
        return from_entries(lp["content"], requested)
    return _legacy_completions(lp, requested)


def _native_event(ev: JSON, requested: int, start: int) -> list[TokenRecord]:
    """Token records of one native /completion stream chunk, numbered from `start`."""
    entries = ev.get("completion_probabilities")
    if isinstance(entries, list) and entries:
        return from_entries(entries, requested, start=start)
    if not (ev.get("content") or ev.get("tokens")):
        return []
    ids = [t for t in (ev.get("tokens") or []) if isinstance(t, int)]
    if not ids:
        return [_missing(start, str(ev.get("content", "")), None, requested)]
    # one record per token id the chunk carried
    piece = str(ev.get("content", ""))
    return [
        _missing(start + j, piece if j == 0 else "", tid, requested) for j, tid in enumerate(ids)
    ]


def _unsent(ev: JSON, records: int, requested: int) -> list[TokenRecord]:
    """Missing records (ids unknown) for the tokens a native stream chunk's
    ``tokens_predicted`` counts beyond the `records` already read and the chunk's own."""
    done = ev.get("tokens_predicted")
    if not isinstance(done, int) or isinstance(done, bool):
        return []
    entries = ev.get("completion_probabilities")
    own = (
        len(_native_event(ev, requested, 0))
        if (entries or ev.get("content") or ev.get("tokens"))
        else 0
    )
    return [_missing(records + j, "", None, requested) for j in range(done - own - records)]


def from_stream(
    endpoint: str, events: Iterable[JSON], requested: int, *, unsent: bool = False
) -> list[TokenRecord]:
    """Token records of a streamed response; a token sent without probabilities is missing.

    ``unsent=True`` (native ``/completion``): also a missing record, id unknown, for each token
    the server generated but never sent. Why: a streaming llama-server sends no chunk for a
    token held back inside a UTF-8 character (`held_back`); the chunk completing the character
    names only its own token, but every chunk's ``tokens_predicted`` counts them all."""
    out: list[TokenRecord] = []
    for ev in events:
        if endpoint == "completion":
            if unsent:
                out += _unsent(ev, len(out), requested)
            out += _native_event(ev, requested, start=len(out))
            continue
        choices = ev.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            continue
        ch = choices[0]
        lp = ch.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("content"), list) and lp["content"]:
            out += from_entries(lp["content"], requested, start=len(out))
            continue
        if isinstance(lp, dict) and isinstance(lp.get("tokens"), list) and lp["tokens"]:
            # OpenAI legacy completions stream: one {tokens, token_logprobs, top_logprobs} per chunk
            out += [
                dataclasses.replace(r, index=len(out) + r.index)
                for r in _legacy_completions(lp, requested)
            ]
            continue
        delta = ch.get("delta")
        # reasoning models stream their thinking tokens as reasoning_content
        text: Any = (
            (delta.get("content") or delta.get("reasoning_content"))
            if isinstance(delta, dict)
            else ch.get("text")
        )
        if text:
            out.append(_missing(len(out), str(text), None, requested))
    return out


# ---------------------------------------------------------------------------------------------
# alignment with the response's token ids


class AlignmentError(SpecauditError):
    """The probability entries cannot be matched to the response's token ids (one line,
    exit 2): an entry names a token the response did not generate there, or two placements
    explain the entries equally well."""


def utf8_complete(text: bytes) -> bool:
    """Whether `text` ends on a whole UTF-8 character, by llama-server's rule
    (``validate_utf8``: a lead byte in the last four bytes that announces more bytes than
    follow it makes the text incomplete; anything else, invalid sequences included, is
    complete)."""
    n = len(text)
    for back in range(1, min(4, n) + 1):
        c = text[n - back]
        need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 0
        if back < need:
            return False
    return True


def held_back(ids: Sequence[int], pieces: Mapping[int, bytes]) -> list[bool]:
    """For each generated token, whether llama-server holds it back (records no probability
    entry for it): the generated text ends inside a UTF-8 character after it. The character's
    last token gets the entry; a token that never completes one gets none."""
    text = b""
    out = []
    for t in ids:
        text += pieces[t]
        out.append(not utf8_complete(text))
    return out


def align(
    records: Sequence[TokenRecord],
    ids: Sequence[int],
    requested: int,
    pieces: Mapping[int, bytes] | None = None,
) -> list[TokenRecord]:
    """One record per generated token id: each probability entry placed at the token it names,
    every token without an entry a missing record (index = position in `ids`).

    Why: llama-server writes no entry for a token whose text ends inside a UTF-8 character
    (`held_back`), so entry ``i`` is not token ``i`` once a byte token was generated; compared
    at the entry's position, every later token would be compared at the wrong prefix.

    Entries are matched to `ids` by their ``id`` in order. A token id can occur both held back
    and completing a character (the bytes ``E3 80 80`` as three byte tokens: the entry is the
    last ``80``'s); `pieces` (token id -> its bytes) decides such a tie by the server's rule. An
    `AlignmentError` when no placement matches, or several do and `pieces` cannot decide."""
    recs = list(records)
    if len(recs) == len(ids) and all(
        r.token_id in (None, t) for r, t in zip(recs, ids, strict=True)
    ):
        return [dataclasses.replace(r, index=i) for i, r in enumerate(recs)]
    if any(r.token_id is None for r in recs):
        raise AlignmentError(
            f"{len(recs)} probability entries for {len(ids)} tokens, and an entry without a "
            "token id to place it by"
        )
    try:
        complete = [not h for h in held_back(ids, pieces)] if pieces else [False] * len(ids)
    except KeyError as e:
        raise AlignmentError(f"no bytes for generated token id {e.args[0]}") from None
    slots = _place([int(r.token_id) for r in recs if r.token_id is not None], ids, complete)
    out = [_missing(i, "", t, requested) for i, t in enumerate(ids)]
    for r, i in zip(recs, slots, strict=True):
        out[i] = dataclasses.replace(r, index=i)
    return out


Score = tuple[int, int]  # (entries on character-completing tokens, placements: 0, 1 or 2+)
_NONE: Score = (-1, 0)


def _best(
    entry_ids: Sequence[int], ids: Sequence[int], complete: Sequence[bool]
) -> list[list[Score]]:
    """best[k][i]: the best score of placing entries k.. within ids[i:], and how many
    placements reach it (capped at 2)."""
    m, n = len(entry_ids), len(ids)
    best = [[_NONE] * (n + 1) for _ in range(m)] + [[(0, 1)] * (n + 1)]
    for k in range(m - 1, -1, -1):
        for i in range(n - 1, -1, -1):
            skip = best[k][i + 1]
            take = _NONE
            if ids[i] == entry_ids[k] and best[k + 1][i + 1][0] >= 0:
                s, w = best[k + 1][i + 1]
                take = (s + int(complete[i]), w)
            if take[0] != skip[0]:
                best[k][i] = max(take, skip)
            else:
                best[k][i] = (skip[0], min(2, skip[1] + take[1]) if skip[0] >= 0 else 0)
    return best


def _place(entry_ids: Sequence[int], ids: Sequence[int], complete: Sequence[bool]) -> list[int]:
    """Increasing positions p with ``ids[p[k]] == entry_ids[k]`` that put the most entries on
    tokens that complete a character; an AlignmentError when none or more than one does."""
    m, n = len(entry_ids), len(ids)
    best = _best(entry_ids, ids, complete)
    score, ways = best[0][0] if m else (0, 1)
    if score < 0:
        raise AlignmentError(
            f"the {m} probability entries do not name the response's tokens in order "
            f"({n} token ids)"
        )
    if ways > 1:
        raise AlignmentError(
            f"the {m} probability entries fit the response's {n} token ids in more than one "
            "way (a token id repeats around a split character; give the token bytes)"
        )
    out: list[int] = []
    i = 0
    for k in range(m):
        after = best[k + 1]
        while not (
            ids[i] == entry_ids[k]
            and after[i + 1][0] >= 0
            and after[i + 1][0] + int(complete[i]) == best[k][i][0]
        ):
            i += 1
        out.append(i)
        i += 1
    return out


def response_ids(body: JSON) -> list[int] | None:
    """The generated token ids of a native ``/completion`` answer (``return_tokens``), None
    when it carries none."""
    toks = body.get("tokens")
    if not isinstance(toks, list) or not toks or not all(isinstance(t, int) for t in toks):
        return None
    return [int(t) for t in toks]


# ---------------------------------------------------------------------------------------------
# aggregation


@dataclass(frozen=True)
class Counts:
    total: int
    real: int
    placeholder: int
    unchecked: int

    @property
    def coverage(self) -> float:
        """Share of tokens whose logprob is known to be real (0.0 for an empty response)."""
        return self.real / self.total if self.total else 0.0


def counts(records: Sequence[TokenRecord]) -> Counts:
    real = sum(r.klass is TokenClass.REAL for r in records)
    ph = sum(r.klass is TokenClass.PLACEHOLDER for r in records)
    return Counts(len(records), real, ph, len(records) - real - ph)


def values(records: Sequence[TokenRecord], missing: Missing = Missing.SKIP) -> list[float]:
    """Logprob values under a missing-value policy."""
    out: list[float] = []
    for r in records:
        if r.logprob is not None:
            out.append(r.logprob)
        elif missing is Missing.NAIVE:
            # what a trusting client computes: the reported number, 0.0 if nothing was sent
            out.append(r.reported_logprob if r.reported_logprob is not None else 0.0)
        elif missing is Missing.RAISE:
            raise MissingLogprobError(f"token {r.index} ({r.token!r}) has no real logprob")
    return out


def mean_logprob(records: Sequence[TokenRecord], missing: Missing = Missing.SKIP) -> float | None:
    """Mean logprob under a missing-value policy; None when no value is left to average."""
    vals = values(records, missing)
    return sum(vals) / len(vals) if vals else None
