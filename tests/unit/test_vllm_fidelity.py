"""vLLM's logprobs read and classified (`vllm.fidelity`) on answers built from the
fixture's closed form, with a fake vLLM behind httpx's mock transport: what a correct server
sends in each ``--logprobs-mode`` is real-correct in that mode and wrong read the other way
(so a server whose mode is not known is read the way its numbers agree with); a placeholder
and a null logprob are told apart; the token ids come from the answer, never from text."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest

from specaudit import fidelity, fixtures
from specaudit.fidelity import Fidelity, FidelityError
from specaudit.vllm import fidelity as fv

SAMPLER = fixtures.SamplerSettings(top_k=0, top_p=0.8, min_p=0.0, temperature=1.0)
PROMPT = "bcdbc"
OUT = "fgh"


def _answer(mode: str, *, out: str = OUT, n: int = 5) -> dict[str, Any]:
    """What a correct vLLM sends for `out` after PROMPT: each token's logprob and its top-n,
    raw (the model's log-softmax) or processed (after top-p; a removed token at -9999, as
    vLLM's OpenAI layer clamps -inf)."""
    spec = fixtures.default_spec()
    ref = fidelity.FixtureReference(spec, SAMPLER)
    ctx = spec.tokenize(PROMPT)
    ids, values, tops = [], [], []
    for ch in out:
        tid = spec.tokenize(ch)[0]
        nt = ref.next_token(ctx)
        if mode == fv.RAW:
            table = dict(nt.logprobs)
        else:
            table = {t: (math.log(nt.probs[t]) if t in nt.probs else -9999.0) for t in nt.logprobs}
        best = sorted(table.items(), key=lambda kv: -kv[1])[:n]
        ids.append(tid)
        values.append(table[tid])
        tops.append({f"token_id:{t}": v for t, v in best})
        ctx.append(tid)
    return {
        "choices": [
            {
                "token_ids": ids,
                "logprobs": {
                    "tokens": [f"token_id:{t}" for t in ids],
                    "token_logprobs": values,
                    "top_logprobs": tops,
                },
            }
        ]
    }


def _classify(body: dict[str, Any], mode: str) -> fidelity.FidelityResult:
    spec = fixtures.default_spec()
    recs = fv.records(body, 5, mode)
    ref = fidelity.FixtureReference(spec, SAMPLER)
    return fidelity.classify(recs, spec.tokenize(PROMPT), ref, fidelity.EXACT)


@pytest.mark.parametrize("mode", fv.MODES)
def test_a_correct_answer_is_real_correct_in_its_own_mode_and_wrong_in_the_other(
    mode: str,
) -> None:
    body = _answer(mode)
    assert _classify(body, mode).counts == fidelity.FidelityCounts(real_correct=len(OUT))
    other = fv.PROCESSED if mode == fv.RAW else fv.RAW
    assert _classify(body, other).counts.real_wrong > 0


def test_records_take_ids_from_the_answer_and_read_processed_values_as_probabilities() -> None:
    spec = fixtures.default_spec()
    raw = fv.records(_answer(fv.RAW), 5, fv.RAW)
    assert [r.token_id for r in raw] == [spec.tokenize(c)[0] for c in OUT]
    assert all(r.form == "logprob" and len(r.candidates) == 5 for r in raw)
    assert all(c.token_id is not None for r in raw for c in r.candidates)
    proc = fv.records(_answer(fv.PROCESSED), 5, fv.PROCESSED)
    assert all(r.form == "prob" for r in proc)
    assert any(c.prob == 0.0 for r in proc for c in r.candidates)  # -9999: removed by top-p


def test_a_wrong_value_a_placeholder_and_a_null_are_three_classes() -> None:
    body = _answer(fv.RAW)
    lp = body["choices"][0]["logprobs"]
    lp["token_logprobs"][0] += 0.05  # a plausible number, not the model's
    lp["token_logprobs"][1] = 0.0  # the placeholder: certain, no candidates
    lp["top_logprobs"][1] = {}
    lp["token_logprobs"][2] = None  # nothing at all
    lp["top_logprobs"][2] = None
    res = _classify(body, fv.RAW)
    assert [t.klass for t in res.tokens] == [
        Fidelity.REAL_WRONG,
        Fidelity.PLACEHOLDER,
        Fidelity.MISSING,
    ]


def test_an_answer_without_token_ids_or_an_unknown_mode_is_one_line() -> None:
    body = _answer(fv.RAW)
    del body["choices"][0]["token_ids"]
    with pytest.raises(FidelityError, match="return_token_ids"):
        fv.records(body, 5, fv.RAW)
    with pytest.raises(FidelityError, match="unknown vLLM logprobs mode"):
        fv.records(_answer(fv.RAW), 5, "logits")


def test_probe_reads_an_unknown_server_the_way_its_numbers_agree() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        return httpx.Response(200, json=_answer(fv.PROCESSED))

    spec = fixtures.default_spec()
    res = fv.probe(
        "http://vllm.test", "m", spec.tokenize(PROMPT), fidelity.FixtureReference(spec, SAMPLER),
        fidelity.EXACT, SAMPLER, range(1, 4), tokens=len(OUT), n=5, modes=fv.MODES,
        transport=httpx.MockTransport(handler),
    )  # fmt: skip
    best = fv.best_mode(res)
    assert best.mode == fv.PROCESSED and best.counts.real_correct == 3 * len(OUT)
    assert [b["seed"] for b in seen] == [1, 2, 3]
    assert seen[0]["return_tokens_as_token_ids"] and seen[0]["logprobs"] == 5
    assert seen[0]["top_p"] == 0.8 and seen[0]["ignore_eos"]
    line = best.line("vLLM ngram")
    assert "processed_logprobs" in line and f"{3 * len(OUT)} real-correct" in line


def test_a_request_the_server_refuses_is_counted_and_named_not_fatal() -> None:
    """vLLM 0.32 answers 400 when its logprobs hold a NaN ("Out of range float values are not
    JSON compliant"): the server's answer is the finding, so it is counted and quoted, and
    the requests it did answer are still classified."""
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] == 2:
            return httpx.Response(400, text='{"error": {"message": "Out of range float values '
                                  'are not JSON compliant"}}')  # fmt: skip
        return httpx.Response(200, json=_answer(fv.RAW))

    spec = fixtures.default_spec()
    (res,) = fv.probe(
        "http://vllm.test", "m", spec.tokenize(PROMPT), fidelity.FixtureReference(spec, SAMPLER),
        fidelity.EXACT, SAMPLER, [1, 2, 3], tokens=3, n=5, transport=httpx.MockTransport(handler),
    )  # fmt: skip
    assert res.requests == 3 and res.counts.real_correct == 2 * len(OUT)
    assert res.refused == (
        'seed 2: HTTP 400: {"error": {"message": "Out of range float values are not JSON '
        'compliant"}}',
    )
    line = res.line("vLLM ngram")
    assert "1 of 3 requests refused (seed 2: HTTP 400" in line and "\n" not in line


def test_tokens_after_one_the_fixture_cannot_continue_from_are_uncompared() -> None:
    """A stock speculating vLLM samples tokens its sampler forbids, some not letters at all
    (</s>, <unk>): that token is still compared at its own prefix; the ones after it have no
    closed form and are counted, not guessed."""
    spec = fixtures.default_spec()
    body = _answer(fv.RAW)
    body["choices"][0]["token_ids"][1] = spec.tokens.index("</s>")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)

    letters = {i for i, t in enumerate(spec.tokens) if t in set(spec.letters)}
    (res,) = fv.probe(
        "http://vllm.test", "m", spec.tokenize(PROMPT), fidelity.FixtureReference(spec, SAMPLER),
        fidelity.EXACT, SAMPLER, [1], tokens=3, n=5, answerable=letters.__contains__,
        transport=httpx.MockTransport(handler),
    )  # fmt: skip
    assert res.counts.total == 2 and res.result.uncompared == 1
    assert "1 uncompared" in res.line("vLLM ngram")
