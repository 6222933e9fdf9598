"""One builder of vLLM's ``/v1/completions`` body (`specaudit.vllm.request`) serves `dist`'s
sampler, its logprobs probe and `rescore`'s sampler: each sends the same fields for the same
sampler, differing only in what it asks for (end tokens, logprobs, seed)."""

from __future__ import annotations

from specaudit import fixtures
from specaudit.distribution import vllm as dv
from specaudit.distribution.results import Workload
from specaudit.fixtures import SamplerSettings
from specaudit.rescore.sampling import VllmSampler
from specaudit.vllm import fidelity
from specaudit.vllm.request import completions_body, token_id

S = SamplerSettings(top_k=3, top_p=0.8, min_p=0.05, temperature=0.7)
SPEC = fixtures.spec_for_kind("last-token")


def test_every_sampler_knob_is_explicit_and_the_penalties_neutral() -> None:
    body = completions_body(S, tokens=4, ignore_eos=True, prompt_ids=[2, 5], seed=9)
    assert (body["top_k"], body["top_p"], body["min_p"], body["temperature"]) == (3, 0.8, 0.05, 0.7)
    assert (body["presence_penalty"], body["frequency_penalty"], body["repetition_penalty"]) == (
        0.0,
        0.0,
        1.0,
    )
    assert body["prompt"] == [2, 5] and body["return_token_ids"] is True and body["seed"] == 9
    assert body["ignore_eos"] is True and "logprobs" not in body and "model" not in body


def test_logprobs_come_named_by_token_id() -> None:
    body = completions_body(S, tokens=1, ignore_eos=False, logprobs=-1)
    assert body["logprobs"] == -1 and body["return_tokens_as_token_ids"] is True
    assert "ignore_eos" not in body
    assert (token_id("token_id:17"), token_id("17"), token_id("token_id:x")) == (17, None, None)


def test_dist_the_logprobs_probe_and_rescore_send_the_builders_body() -> None:
    wl = Workload(prompt=SPEC.prompt, tokens=4, positions=4, joint=0, sampler=S)
    eng = dv.VllmEngine("http://vllm", "m", SPEC, wl, "plain", family="vLLM")
    ids = SPEC.tokenize(SPEC.prompt)
    assert eng.body(3) == completions_body(
        S, tokens=4, ignore_eos=False, prompt_ids=ids, model="m", seed=3
    )
    assert fidelity.request_body("m", ids, S, 3, 4, 5) == completions_body(
        S, tokens=4, ignore_eos=True, prompt_ids=ids, model="m", seed=3, logprobs=5
    )
    smp = VllmSampler("http://vllm", S, 4)
    assert smp._body == completions_body(S, tokens=4, ignore_eos=True)
