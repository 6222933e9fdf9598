"""Probability entries placed at the token ids they belong to.

llama-server writes no ``completion_probabilities`` entry for a token whose text ends inside a
UTF-8 character (a byte token), and a streaming one sends no chunk for it at all. The ids and
bytes below are Gemma 3 270M's (byte tokens: id = byte + 238), taken from a real b11434
response: ``[465, 366, 366, 237064]`` is ``E3 80 80`` (U+3000) then ``…``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from specaudit import fidelity, logprobs
from specaudit.check import fidelity_probe
from specaudit.fidelity import Fidelity, NoiseFloor
from specaudit.logprobs import AlignmentError, align, held_back, utf8_complete
from specaudit.reference import NextToken

PIECES = {
    465: b"\xe3",
    366: b"\x80",
    237064: "…".encode(),
    478: b"\xf0",
    398: b"\xa0",
    367: b"\x81",
}
IDS = [465, 366, 366, 237064]  # E3 80 80 (U+3000), then "…"
PROMPT = [2, 100]
TOL = fidelity.tolerance(NoiseFloor(prob=1e-3, logprob=1e-3, answers=3))


class PrefixReference:
    """A reference whose distribution depends on the prefix's length (so a value compared at a
    wrong prefix is wrong), recording every prefix it is asked about."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, ...]] = []

    def dist(self, ids: Sequence[int]) -> dict[int, float]:
        a = 0.2 + 0.1 * (len(ids) % 5)  # 0.2 .. 0.6
        return {366: a, 237064: 0.9 - a, 465: 0.1}

    def next_token(self, ids: Sequence[int]) -> NextToken:
        self.asked.append(tuple(ids))
        d = self.dist(ids)
        return NextToken(d, {t: math.log(p) for t, p in d.items()})


def entry(tok: int, prefix: Sequence[int], post: bool = True) -> dict[str, Any]:
    """The entry an honest server writes for `tok` drawn after `prefix`."""
    d = PrefixReference().dist(prefix)
    top = sorted(d.items(), key=lambda kv: -kv[1])
    if post:
        cands = [{"id": t, "token": "", "prob": p} for t, p in top]
        return {"id": tok, "token": "", "prob": d.get(tok, 0.0), "top_probs": cands}
    cands = [{"id": t, "token": "", "logprob": math.log(p)} for t, p in top]
    return {"id": tok, "token": "", "logprob": math.log(d.get(tok, 1e-9)), "top_logprobs": cands}


def test_llama_servers_utf8_rule() -> None:
    assert utf8_complete(b"") and utf8_complete(b"a") and utf8_complete("…".encode())
    assert not utf8_complete(b"\xe3") and not utf8_complete(b"\xe3\x80")
    assert utf8_complete(b"\xe3\x80\x80")
    assert not utf8_complete("a𠀁".encode()[:-1])
    # invalid sequences of the announced length, or stray continuation bytes, count as complete
    assert utf8_complete(b"\xf0\x80\xad\x81") and utf8_complete(b"\x80")
    assert held_back(IDS, PIECES) == [True, True, False, False]


def test_an_entry_goes_to_the_token_that_completes_the_character() -> None:
    body = {"tokens": IDS, "completion_probabilities": [entry(366, []), entry(237064, [])]}
    recs = logprobs.from_response("completion", body, 3)
    got = align(recs, IDS, 3, PIECES)
    assert [r.token_id for r in got] == IDS
    assert [r.index for r in got] == [0, 1, 2, 3]
    assert [r.reported_logprob is None for r in got] == [True, True, False, False]


def test_a_repeated_id_around_a_split_character_needs_the_bytes() -> None:
    recs = logprobs.from_entries([entry(366, []), entry(237064, [])], 3)
    with pytest.raises(AlignmentError, match="more than one way"):
        align(recs, IDS, 3)


def test_ids_without_repeats_align_by_id_alone() -> None:
    ids = [478, 398, 366, 367, 237064]  # F0 A0 80 81 (U+20001), "…"
    recs = logprobs.from_entries([entry(367, []), entry(237064, [])], 3)
    got = align(recs, ids, 3)
    assert [r.reported_logprob is not None for r in got] == [False, False, False, True, True]


def test_tokens_left_inside_a_character_at_the_end_are_missing() -> None:
    ids = [237064, 478, 398]  # "…", then F0 A0 and the budget ran out
    recs = logprobs.from_entries([entry(237064, [])], 3)
    got = align(recs, ids, 3, PIECES)
    assert [r.token_id for r in got] == ids
    assert [r.reported_logprob is None for r in got] == [False, True, True]


def test_entries_that_do_not_name_the_tokens_are_refused() -> None:
    recs = logprobs.from_entries([entry(237064, []), entry(366, [])], 3)
    with pytest.raises(AlignmentError, match="do not name"):
        align(recs, IDS, 3, PIECES)


def test_one_entry_per_token_keeps_its_place() -> None:
    recs = logprobs.from_entries([entry(t, []) for t in IDS], 3)
    assert align(recs, IDS, 3, PIECES) == recs


@pytest.mark.parametrize("post", [True, False])
def test_each_token_is_compared_after_the_responses_ids_before_it(post: bool) -> None:
    """The entries of a response with held-back tokens: real and correct at their own prefix,
    the held-back tokens missing; left as they came, the entries would be compared after the
    prompt alone and after the wrong token, and come out wrong."""
    body = {
        "tokens": IDS,
        "completion_probabilities": [
            entry(366, PROMPT + IDS[:2], post),
            entry(237064, PROMPT + IDS[:3], post),
        ],
    }
    kind = fidelity_probe.ProbeKind("completion", post)
    ref = PrefixReference()
    recs = fidelity_probe.records(kind, [body], 3, lambda ids: PIECES)
    res = fidelity.classify(recs, PROMPT, ref, TOL)
    assert [t.klass for t in res.tokens] == [
        Fidelity.MISSING,
        Fidelity.MISSING,
        Fidelity.REAL_CORRECT,
        Fidelity.REAL_CORRECT,
    ]
    assert [t.token_id for t in res.tokens] == IDS
    assert ref.asked == [tuple(PROMPT + IDS[:2]), tuple(PROMPT + IDS[:3])]
    unaligned = logprobs.from_response("completion", body, 3)
    old = fidelity.classify(unaligned, PROMPT, PrefixReference(), TOL)
    assert old.counts.real_wrong > 0


def test_a_stream_counts_the_tokens_it_never_sent() -> None:
    """A streaming server sends no chunk for a held-back token; the completing chunk's
    tokens_predicted counts it. The unsent tokens are missing, and the tokens after them, whose
    prefix is unknown, are counted as uncompared, never compared at a shorter prefix."""
    events: list[dict[str, Any]] = [
        {"content": "…", "tokens": [237064], "tokens_predicted": 1,
         "completion_probabilities": [entry(237064, PROMPT)]},
        {"content": "\u3000", "tokens": [366], "tokens_predicted": 4,
         "completion_probabilities": [entry(366, PROMPT + [237064, 465, 366])]},
        {"content": "…", "tokens": [237064], "tokens_predicted": 5,
         "completion_probabilities": [entry(237064, PROMPT + [237064, *IDS])]},
        {"content": "", "tokens": [], "tokens_predicted": 7, "stop": True},
    ]  # fmt: skip
    recs = logprobs.from_stream("completion", events, 3, unsent=True)
    assert [r.token_id for r in recs] == [237064, None, None, 366, 237064, None, None]
    assert [r.index for r in recs] == list(range(7))
    res = fidelity.classify(recs, PROMPT, PrefixReference(), TOL)
    assert [t.klass for t in res.tokens] == [Fidelity.REAL_CORRECT] + [Fidelity.MISSING] * 4
    assert res.uncompared == 2
    # without the count, the entries would follow one another as if nothing was held back
    assert len(logprobs.from_stream("completion", events, 3)) == 3
