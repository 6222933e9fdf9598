"""The reference and the engine under test are asked for the same distribution.

Fidelity compares what an engine reported with what a plain reference answered for the same
prefix; both are llama-server requests, and both must mean the same processed distribution:
the same sampler chain and settings, and the end-of-generation tokens masked (``ignore_eos``)
on both sides, or the EOS token's mass is in one distribution and not the other.
"""

from __future__ import annotations

from specaudit.check import fidelity_probe
from specaudit.check.with_reference import KINDS
from specaudit.fixtures import SamplerSettings
from specaudit.reference import completion_body, sampling_fields

SAMPLER = SamplerSettings(top_k=40, top_p=0.9, min_p=0.05, temperature=0.7)
DISTRIBUTION_KEYS = set(sampling_fields(SAMPLER))


def _distribution(body: dict[str, object]) -> dict[str, object]:
    return {k: body.get(k) for k in DISTRIBUTION_KEYS}


def test_the_reference_request_masks_eos_and_names_the_whole_chain() -> None:
    body = completion_body([2, 10, 20], SAMPLER, 40)
    assert body["ignore_eos"] is True
    assert body["samplers"] == ["top_k", "top_p", "min_p", "temperature"]
    assert (body["top_k"], body["top_p"], body["min_p"], body["temperature"]) == (
        40,
        0.9,
        0.05,
        0.7,
    )
    assert body["prompt"] == [2, 10, 20] and body["n_predict"] == 1


def test_every_engine_probe_asks_for_the_distribution_the_reference_is_asked_for() -> None:
    ref = _distribution(completion_body([2, 10], SAMPLER, 40))
    for kind in (*fidelity_probe.DEFAULT_KINDS, *KINDS):
        prompt = "Once upon a time" if kind.endpoint == "chat" else [2, 10]
        probe = fidelity_probe.request_body(kind, prompt, SAMPLER.request_fields(), 3, 12, 5)
        assert _distribution(probe) == ref, kind.label


def test_settings_and_their_request_fields_give_the_same_request() -> None:
    assert completion_body([1], SAMPLER, 5) == completion_body([1], SAMPLER.request_fields(), 5)
    raw = completion_body([1], SAMPLER, 5, post=False, cache_prompt=False)
    assert raw["post_sampling_probs"] is False and raw["cache_prompt"] is False
    assert _distribution(raw) == _distribution(completion_body([1], SAMPLER, 5))
