"""A plain vLLM server as rescore's reference (`specaudit.vllm.reference`), on canned vLLM
answers (tests/fakes.py, no socket): the processed distribution read by token id with the
tokens the sampler removed (vLLM's -9999) left out, raw logprobs asked with nothing to
process, identical requests kept apart in the prefix cache, and every server that cannot be a
reference refused in one line: one that speculates, reports raw logprobs, caps its logprobs
below the vocabulary, answers without logprobs or without covering the sampler's support.
The request checks: a vLLM reference re-scores --engine vllm only, and is one reference."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from fakes import Answer, Asked, route_clients
from specaudit.fixtures import SamplerSettings
from specaudit.reference import NextToken, ReferenceUnusable
from specaudit.rescore import request
from specaudit.rescore.records import RescoreError
from specaudit.vllm.reference import VllmReference, parse_top

TOP_P = SamplerSettings(top_k=0, top_p=0.8, min_p=0.0, temperature=1.0)
VOCAB = 11
PLAIN_METRICS = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
SPEC_METRICS = PLAIN_METRICS + "vllm:spec_decode_num_draft_tokens_total 12\n"
# processed logprobs at top-p 0.8 after the prompt: two tokens kept, the rest removed
KEPT = {5: 0.9046505, 3: 0.0953495}


def _top(values: dict[int, float]) -> dict[str, Any]:
    return {
        "choices": [
            {
                "token_ids": [next(iter(values))],
                "logprobs": {"top_logprobs": [{f"token_id:{t}": v for t, v in values.items()}]},
            }
        ]
    }


class _Vllm:
    """A vLLM server: one model, its /metrics, and completions answered in its logprobs mode
    (processed unless `raw`), every body kept."""

    def __init__(
        self, *, metrics: str = PLAIN_METRICS, raw: bool = False, max_logprobs: int = -1
    ) -> None:
        self.metrics = metrics
        self.raw = raw
        self.max_logprobs = max_logprobs
        self.bodies: list[dict[str, Any]] = []
        self.answer: dict[int, float] | None = None  # the next-token logprobs, when canned

    def __call__(self, asked: Asked) -> Answer:
        if asked.path == "/v1/models":
            return Answer.json({"data": [{"id": "/models/fixture"}]})
        if asked.path == "/metrics":
            return Answer(self.metrics.encode(), content_type="text/plain")
        if asked.path != "/v1/completions":
            return Answer.json({"error": "not found"}, 404)
        body = asked.json()
        self.bodies.append(body)
        n = body["logprobs"]
        if self.max_logprobs != -1 and (n == -1 or n > self.max_logprobs):
            return Answer.json(
                {"error": {"message": f"Requested sample logprobs of {n}, which is greater "
                           f"than max allowed: {self.max_logprobs}"}}, 400,
            )  # fmt: skip
        if n == -1:
            return Answer.json(_top({t: -2.4 for t in range(VOCAB)}))
        if body["top_k"] == 1:  # the mode check
            return Answer.json(_top({5: -0.1, 3: -2.35} if self.raw else {5: 0.0, 3: -9999.0}))
        if body["top_k"] == 0 and body["top_p"] == 1.0 and body["temperature"] == 1.0:
            return Answer.json(_top({5: -0.1, 3: -2.35, 7: -4.0}))  # raw: nothing processed
        if self.answer is not None:
            return Answer.json(_top(self.answer))
        kept = {t: math.log(p) for t, p in KEPT.items()}
        return Answer.json(_top({**kept, **{t: -9999.0 for t in range(VOCAB) if t not in KEPT}}))


def _ask(ref: VllmReference, ids: list[int]) -> NextToken:
    async def go() -> NextToken:
        async with ref:
            await ref.prepare()
            return await ref.next_token(ids)

    return asyncio.run(go())


def test_the_processed_distribution_is_read_by_id_without_the_removed_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _Vllm()
    url = route_clients(monkeypatch, fake)
    ref = VllmReference(url, TOP_P, raw_probs=3)
    nt = _ask(ref, [1, 2, 3])
    assert nt.probs == pytest.approx(KEPT)
    assert nt.logprobs == {5: -0.1, 3: -2.35, 7: -4.0}
    asked, raw = fake.bodies[-2:]
    assert asked["prompt"] == [1, 2, 3] and asked["logprobs"] == VOCAB  # top-k 0: the vocabulary
    assert asked["top_p"] == 0.8 and asked["max_tokens"] == 1 and asked["ignore_eos"] is True
    assert asked["model"] == "/models/fixture" and asked["return_tokens_as_token_ids"] is True
    assert (raw["top_k"], raw["top_p"], raw["min_p"], raw["temperature"]) == (0, 1.0, 0.0, 1.0)
    assert ref.n_vocab == VOCAB


def test_a_prefix_is_asked_once_and_identical_requests_each_get_their_own_cache_salt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _Vllm()
    url = route_clients(monkeypatch, fake)

    async def go() -> list[NextToken]:
        async with VllmReference(url, TOP_P) as ref:
            await ref.prepare()
            await asyncio.gather(*(ref.next_token([1, 2]) for _ in range(5)))
            before = len(fake.bodies)
            out = await ref.concurrent([1, 2], 0)
            assert len(fake.bodies) - before == 4
            return out

    answers = asyncio.run(go())
    assert all(a.probs == pytest.approx(KEPT) for a in answers)
    salts = [b.get("cache_salt") for b in fake.bodies[-4:]]
    assert None not in salts and len(set(salts)) == 4
    assert sum(1 for b in fake.bodies if b["prompt"] == [1, 2] and "cache_salt" not in b) == 1


def test_the_batch_shapes_batch_the_prefix_with_its_shorter_prefixes_on_one_salt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _Vllm()
    url = route_clients(monkeypatch, fake)

    async def go() -> list[NextToken]:
        async with VllmReference(url, TOP_P) as ref:
            await ref.prepare()
            fake.bodies.clear()
            return await ref.shapes([1, 2, 3, 4, 5], 0)

    answers = asyncio.run(go())
    assert len(answers) == 2  # batched with its shorter prefixes, then on the prefix cache
    prompts = sorted(len(b["prompt"]) for b in fake.bodies)
    assert prompts == [1, 3, 4, 5, 5]  # ids[:-k] for k = 1, 2, 4; the prefix twice
    assert len({b["cache_salt"] for b in fake.bodies}) == 1


@pytest.mark.parametrize(
    ("fake", "match"),
    [
        (_Vllm(metrics=SPEC_METRICS), "speculates .*without --speculative-config"),
        (_Vllm(metrics="# nothing\n"), "not a vLLM server"),
        (_Vllm(raw=True), "reports raw logprobs: start it with --logprobs-mode processed"),
        (_Vllm(max_logprobs=20), "HTTP 400.*start it with --max-logprobs -1"),
    ],
)
def test_a_server_that_cannot_be_the_reference_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, fake: _Vllm, match: str
) -> None:
    url = route_clients(monkeypatch, fake)
    with pytest.raises(ReferenceUnusable, match=match) as e:
        _ask(VllmReference(url, TOP_P), [1, 2])
    assert "\n" not in str(e.value)


def test_a_distribution_that_does_not_cover_the_support_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _Vllm()
    fake.answer = {5: -0.5, 3: -9999.0}  # 0.61 of the mass: the support is not covered
    url = route_clients(monkeypatch, fake)
    with pytest.raises(ReferenceUnusable, match="sums to 0.606531 .* does not cover"):
        _ask(VllmReference(url, TOP_P), [1, 2])


def test_answers_without_logprobs_or_ids_are_one_line() -> None:
    with pytest.raises(ReferenceUnusable, match="without top_logprobs"):
        parse_top({"choices": [{"text": "x"}]})
    with pytest.raises(ReferenceUnusable, match="by text, not token id"):
        parse_top({"choices": [{"logprobs": {"top_logprobs": [{"f": -0.1}]}}]})


def test_a_vllm_reference_re_scores_vllm_only_and_is_the_one_reference(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    t1 = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=1.0)
    req = request.make_request(
        "http://127.0.0.1:9", engine="vllm", reference_vllm=folder, sampler=t1
    )
    assert req.reference_vllm == folder and req.reference_engine == "vllm"
    req = request.make_request(
        "http://127.0.0.1:9", engine="vllm", reference_url="http://127.0.0.1:8",
        reference_engine="vllm", sampler=t1,
    )  # fmt: skip
    assert req.reference_engine == "vllm" and req.reference_vllm is None
    bad: list[tuple[dict[str, Any], str]] = [
        ({"engine": "server", "reference_vllm": folder}, "--engine vllm only"),
        ({"engine": "vllm", "reference_vllm": tmp_path}, "not a Hugging Face model folder"),
        (
            {"engine": "vllm", "reference_vllm": folder, "reference_url": "http://127.0.0.1:8"},
            "give one reference",
        ),
        ({"engine": "vllm", "reference_engine": "vllm"}, "needs --reference-url"),
        ({"engine": "vllm", "reference_engine": "sglang"}, "unknown --reference-engine"),
    ]
    for kwargs, match in bad:
        with pytest.raises(RescoreError, match=match):
            request.make_request("http://127.0.0.1:9", sampler=t1, **kwargs)
