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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

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


def from_stream(endpoint: str, events: Iterable[JSON], requested: int) -> list[TokenRecord]:
    """Token records of a streamed response; a token sent without probabilities is missing."""
    out: list[TokenRecord] = []
    for ev in events:
        if endpoint == "completion":
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
