"""The fixture's closed form against the real plain llama-server's reported probabilities."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx

from specaudit import fixtures


def test_pre_sampling_probs_match_the_closed_form(
    server: Callable[[str], Any], fixture_set: fixtures.FixtureSet
) -> None:
    url = server("fixture-plain").url
    spec = fixture_set.spec
    worst = 0.0
    checked_positions = 0
    for seed in (1, 2, 3, 4, 5):
        body = {
            "prompt": spec.prompt,
            "n_predict": 4,
            "n_probs": len(spec.tokens),
            "seed": seed,
            **fixtures.REPORT_SAMPLER.request_fields(),
        }
        r = httpx.post(f"{url}/completion", json=body, timeout=60)
        assert r.status_code == 200
        probs = r.json()["completion_probabilities"]
        assert len(probs) == 4
        generated = ""
        for pos, entry in enumerate(probs):
            expected = fixtures.raw_distribution(spec, spec.prompt + generated)
            got = {c["token"]: math.exp(c["logprob"]) for c in entry["top_logprobs"]}
            # every letter is reported, with the closed form's probability
            for letter in spec.letters:
                assert abs(got.get(letter, 0.0) - expected[letter]) < 1e-4, (pos, letter)
                worst = max(worst, abs(got.get(letter, 0.0) - expected[letter]))
            checked_positions += 1
            generated += entry["token"]
    assert checked_positions == 20  # first and later positions, five seeds
    assert worst < 1e-4


def test_report_numbers_after_bcdbcf(fixture_set: fixtures.FixtureSet) -> None:
    d = fixtures.next_token_distribution(fixture_set.spec, "bcdbcf", fixtures.REPORT_SAMPLER)
    assert round(d["e"], 3) == 0.345 and round(d["g"], 3) == 0.452 and round(d["h"], 3) == 0.203
