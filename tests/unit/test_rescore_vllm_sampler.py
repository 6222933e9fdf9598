"""`rescore --engine vllm` on canned vLLM answers (tests/fakes.py, no socket): the request it
sends (prompt as ids, ids back, vLLM's sampler fields, end tokens ignored), the run's draft
counts from /metrics, the same-model probe's numbers, and every refusal as one line."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from fakes import Answer, Asked, route_clients
from specaudit.fixtures import SamplerSettings
from specaudit.rescore import request
from specaudit.rescore.records import RescoreError
from specaudit.rescore.sampling import SeededGeneration, VllmSampler, vllm_top

SAMPLER = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=0.7)
T1 = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=1.0)
METRICS = (
    "# TYPE vllm:spec_decode_num_draft_tokens_total counter\n"
    'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {drafted}\n'
    "# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n"
    'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}\n'
)


class _Vllm:
    """A vLLM server: each completion returns `ids`, and adds 3 drafted / 2 accepted tokens to
    its /metrics counters (none at all when `speculates` is False)."""

    def __init__(self, ids: list[int] | None, *, speculates: bool = True) -> None:
        self.ids = ids
        self.speculates = speculates
        self.bodies: list[dict[str, Any]] = []
        self.drafted = 100
        self.accepted = 50

    def __call__(self, asked: Asked) -> Answer:
        if asked.path == "/v1/models":
            return Answer.json({"data": [{"id": "/models/gemma"}]})
        if asked.path == "/metrics":
            text = METRICS.format(drafted=self.drafted, accepted=self.accepted)
            return Answer(text.encode() if self.speculates else b"", content_type="text/plain")
        if asked.path == "/v1/completions":
            body = asked.json()
            self.bodies.append(body)
            self.drafted += 3
            self.accepted += 2
            choice: dict[str, Any] = {"text": "x"}
            if self.ids is not None:
                choice["token_ids"] = self.ids
            if body.get("logprobs"):
                choice["logprobs"] = {
                    "top_logprobs": [
                        {"token_id:7": math.log(0.5), "token_id:9": math.log(0.3),
                         "token_id:4": math.log(0.1), "token_id:2": -math.inf}
                    ]
                }  # fmt: skip
            return Answer.json({"choices": [choice]})
        return Answer.json({"error": "not found"}, 404)


def _run(sampler: VllmSampler, seeds: list[int]) -> list[SeededGeneration]:
    async def go() -> list[SeededGeneration]:
        try:
            return list(await asyncio.gather(*(sampler.sample(0, [2, 5, 6], s) for s in seeds)))
        finally:
            await sampler.aclose()

    return asyncio.run(go())


def test_vllm_is_sent_the_prompt_as_ids_and_its_ids_are_the_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _Vllm([11, 12, 13])
    url = route_clients(monkeypatch, fake)
    got = _run(VllmSampler(url, SAMPLER, 3), [4, 5])
    assert [g.ids for g in got] == [(11, 12, 13)] * 2
    assert sorted(b["seed"] for b in fake.bodies) == [4, 5]
    body = fake.bodies[0]
    assert body["prompt"] == [2, 5, 6] and body["model"] == "/models/gemma"
    assert body["return_token_ids"] is True and body["ignore_eos"] is True
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"]) == (0.7, 40, 1, 0)
    assert body["repetition_penalty"] == 1.0 and body["max_tokens"] == 3


def test_the_runs_drafts_are_the_growth_of_vllms_counters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = route_clients(monkeypatch, _Vllm([1, 2]))
    smp = VllmSampler(url, SAMPLER, 2)
    _run(smp, [1, 2, 3, 4])
    assert smp.run_counts == (12, 8)


def test_a_plain_vllm_server_counts_no_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    url = route_clients(monkeypatch, _Vllm([1, 2], speculates=False))
    smp = VllmSampler(url, SAMPLER, 2)
    _run(smp, [1])
    assert smp.run_counts is None


def test_an_answer_without_token_ids_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    url = route_clients(monkeypatch, _Vllm(None))
    with pytest.raises(RescoreError, match="without choices\\[0\\].token_ids"):
        _run(VllmSampler(url, SAMPLER, 3), [1])


def test_a_short_answer_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    url = route_clients(monkeypatch, _Vllm([1, 2]))
    with pytest.raises(RescoreError, match="returned 2 tokens for seed 1, asked for 3"):
        _run(VllmSampler(url, SAMPLER, 3), [1])


def test_the_probe_asks_vllm_with_nothing_to_process_and_renormalises_its_top_k(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _Vllm([1])
    url = route_clients(monkeypatch, fake)
    got = asyncio.run(vllm_top(url, [2, 5], 3))
    assert got == pytest.approx({7: 0.5 / 0.9, 9: 0.3 / 0.9, 4: 0.1 / 0.9})
    body = fake.bodies[0]
    assert body["logprobs"] == 3 and body["top_k"] == 0 and body["temperature"] == 1.0
    assert body["max_tokens"] == 1 and body["return_tokens_as_token_ids"] is True


@pytest.mark.parametrize(
    ("sampler", "arm", "match"),
    [
        (SamplerSettings(top_k=40, top_p=0.9, min_p=0.0, temperature=0.7), None, "!= 1"),
        (SamplerSettings(top_k=40, top_p=0.9, min_p=0.0, temperature=1.0), 0.7, "arm setting"),
        (SamplerSettings(top_k=40, top_p=0.9, min_p=0.1, temperature=1.0), None, "min-p"),
    ],
)
def test_settings_vllm_samples_differently_are_refused(
    sampler: SamplerSettings, arm: float | None, match: str
) -> None:
    with pytest.raises(RescoreError, match=match):
        request.make_request(
            "http://127.0.0.1:9", engine="vllm", reference_url="http://127.0.0.1:8",
            sampler=sampler, arm_temperature=arm,
        )  # fmt: skip


def test_vllm_takes_prompts_as_ids_and_the_default_arm_but_not_coupling() -> None:
    req = request.make_request(
        "http://127.0.0.1:9", engine="vllm", reference_url="http://127.0.0.1:8",
        prompt_ids=[[2, 3]], sampler=T1,
        arm_temperature=0.7,
    )  # fmt: skip
    assert req.engine == "vllm" and req.prompt_ids == ((2, 3),)
    with pytest.raises(RescoreError, match="--engine server only"):
        request.make_request(
            "http://127.0.0.1:9", engine="vllm", reference_url="http://127.0.0.1:8",
            sampler=T1, coupling=True,
        )  # fmt: skip
