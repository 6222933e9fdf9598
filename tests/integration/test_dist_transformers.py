"""`--engine transformers`: real Hugging Face transformers (the `transformers` extra, CPU torch)
on both fixtures, loaded from their GGUF files. Before sampling, transformers' own next-token
probabilities equal the closed form to 1e-5; then every candidate generator that a llama
fixture can drive (DFlash with a tiny random drafter of its own class) gets a real verdict
(sequential, small workload: test time)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from specaudit import distribution, fixtures
from specaudit.distribution import hf
from specaudit.stats import Verdict

# 3 tokens, positions 1-2 and their joint, tolerance 0.2: decided in a few hundred samples
SMALL: dict[str, Any] = dict(tokens=3, positions=2, joint=2, sequential=True, tolerance=0.2)


@pytest.fixture(scope="module")
def context_fixture() -> fixtures.FixtureSet:
    return distribution.load_fixture(None, kind="context")


@pytest.mark.parametrize("kind", ["last-token", "context"])
def test_every_generator_keeps_the_distribution(
    kind: str, fixture_set: fixtures.FixtureSet, context_fixture: fixtures.FixtureSet
) -> None:
    fs = fixture_set if kind == "last-token" else context_fixture
    req = distribution.make_request(["transformers"], fixture=fs, seeds=600, **SMALL)
    res = distribution.run(req)
    assert [e.kind for e in res.engines] == [f"transformers-{g}" for g in hf.GENERATORS]
    for e in res.engines:
        assert e.verdict is Verdict.WITHIN_TOLERANCE, (e.engine, e.reason)
        # speculation really ran: the candidate generator proposed tokens, some accepted
        assert e.drafted and e.drafted > e.n_samples, e.engine
        assert e.accepted is not None and 0 < e.accepted <= e.drafted
    (note,) = res.notes
    assert "vs the closed form" in note
    not_covered = {name for name, _ in res.not_covered}
    assert not_covered >= {"transformers mtp", "transformers gemma4-assistant"}
    assert "transformers dflash" not in not_covered  # it runs: the drafter is built tiny


def test_truth_check_both_orders(fixture_set: fixtures.FixtureSet) -> None:
    """At temperature != 1 with top-p, transformers' own order (temperature first) is not
    llama.cpp's; the engine passes the warpers in llama.cpp's order, which matches to 1e-5,
    and the native order measurably does not."""
    sampler = fixtures.SamplerSettings(top_k=0, top_p=0.8, min_p=0.05, temperature=0.6)
    wl = distribution.make_workload(fixture_set.spec, tokens=3, sampler=sampler)
    models = hf.Models(fixture_set)
    tc = models.check_truth(wl)
    assert tc.unit == "contexts" and tc.compared > 1
    assert tc.max_raw < 1e-5 and tc.max_processed < 1e-5
    assert "logits_processor" in hf.generation_kwargs(wl)
    # the native mapping, for contrast: temperature before top-p/min-p
    from transformers import GenerationConfig

    spec = fixture_set.spec
    ids = spec.tokenize(spec.prompt)
    import torch

    with torch.no_grad():
        logits = models.target(torch.tensor([ids])).logits[0, -1]
    cfg = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=0.8, min_p=0.05)
    procs = models.target._get_logits_processor(cfg, len(ids), logits_processor=None, device="cpu")
    native = torch.softmax(procs(torch.tensor([ids]), logits[None].clone()).double(), -1)[0]
    want = np.array(list(fixtures.next_token_distribution(spec, spec.prompt, sampler).values()))
    assert np.abs(native.numpy() - want).max() > 0.01


def test_a_wrong_sampler_mapping_is_broken(fixture_set: fixtures.FixtureSet) -> None:
    """Negative control: sampling with transformers' native order where it differs from the
    closed form's must come out BROKEN (the test has power on this engine)."""
    sampler = fixtures.SamplerSettings(top_k=0, top_p=0.8, min_p=0.05, temperature=0.6)
    wl = distribution.make_workload(
        fixture_set.spec, tokens=3, positions=2, joint=2, sampler=sampler
    )
    models = hf.Models(fixture_set)
    eng = hf.TransformersEngine(models, wl, "assistant")
    kw = {k: v for k, v in eng._kw.items() if k != "logits_processor"}
    eng._kw = kw | {"temperature": 0.6, "top_k": 0, "top_p": 0.8, "min_p": 0.05}
    res = distribution.measure(eng, fixture_set.spec, wl, range(1, 601), sequential=True)
    assert res.verdict is Verdict.BROKEN, res.reason


def test_generator_counts_and_seeds_are_reproducible(fixture_set: fixtures.FixtureSet) -> None:
    wl = distribution.make_workload(fixture_set.spec, tokens=4)
    models = hf.Models(fixture_set)
    models.check_truth(wl)
    eng = models.engine("assistant", wl)
    a = [asyncio.run(eng.sample(s)).text for s in range(1, 21)]
    b = [asyncio.run(eng.sample(s)).text for s in range(1, 21)]
    assert a == b  # one sample per seed
    assert len(set(a)) > 5


def test_cli_transformers(cli: Callable, fixture_set: fixtures.FixtureSet) -> None:
    code, out, err = cli(
        "dist", "--engine", "transformers", "--generator", "prompt-lookup",
        "--fixture", str(fixture_set.dir), "--tokens", "3", "--positions", "2", "--joint", "2",
        "--tolerance", "0.2", "--sequential", "--seeds", "600",
    )  # fmt: skip
    assert code == 0, err
    assert "transformers 5.23.0 prompt-lookup" in out
    assert "vs the closed form" in out
    code, _, err = cli("dist", "--engine", "transformers", "--temperature", "0")
    assert code == 2 and "temperature must be > 0" in err
