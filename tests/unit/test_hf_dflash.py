"""The transformers engine's DFlash generator: its drafter is built from the fixture target,
deterministically, without touching the global RNG, and NOT_RUNNABLE stays truthful."""

from __future__ import annotations

import pytest

from specaudit import fixtures
from specaudit.distribution import hf


@pytest.fixture(scope="module", autouse=True)
def _needs_torch() -> None:
    """Skip the module without torch and transformers; imported here, not when the suite is
    collected (every xdist worker collects every file)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def fixture_set(tmp_path_factory: pytest.TempPathFactory) -> fixtures.FixtureSet:
    return fixtures.build(tmp_path_factory.mktemp("fixture"))


@pytest.fixture(scope="module")
def models(fixture_set: fixtures.FixtureSet) -> hf.Models:
    return hf.Models(fixture_set)


def test_dflash_is_a_generator_and_no_longer_listed_as_not_runnable() -> None:
    assert "dflash" in hf.GENERATORS and "dflash" in hf.GENERATOR_HELP
    names = {name for name, _ in hf.NOT_RUNNABLE}
    assert "transformers dflash" not in names
    assert {"transformers mtp", "transformers gemma4-assistant"} <= names


def test_the_dflash_drafter_fits_the_target_and_is_seeded(
    fixture_set: fixtures.FixtureSet, models: hf.Models
) -> None:
    import torch

    torch.manual_seed(7)
    before = torch.rand(1)
    torch.manual_seed(7)
    a = models.dflash_assistant()
    assert torch.equal(torch.rand(1), before)  # the global RNG is untouched
    assert models.dflash_assistant() is a  # built once
    models._dflash = None
    b = models.dflash_assistant()  # built again: the same weights
    assert type(a).__name__ == "MuseGlimmerAssistantModel"
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    spec = fixture_set.spec
    assert a.config.mask_token_id == spec.unk_id
    assert a.config.block_size == hf.ASSISTANT_TOKENS + 1
    target = models.target
    assert a.config.hidden_size == target.config.hidden_size
    assert a.config.target_layer_ids == [target.config.num_hidden_layers - 1]


def test_dflash_generate_arguments_select_the_dflash_candidate_generator(
    fixture_set: fixtures.FixtureSet, models: hf.Models
) -> None:
    from specaudit import distribution

    wl = distribution.make_workload(fixture_set.spec, tokens=3)
    eng = hf.TransformersEngine(models, wl, "dflash")
    assert eng._kw["speculation_type"] == "dflash"
    assert eng._kw["assistant_model"] is models.dflash_assistant()
    made: list[str] = []
    orig = models.target._get_candidate_generator

    def spy(*args: object, **kwargs: object) -> object:
        cg = orig(*args, **kwargs)
        made.append(type(cg).__name__)
        return cg

    models.target._get_candidate_generator = spy
    ids = eng.generate(1)
    assert made == ["DFlashTokenCandidateGenerator"] and len(ids) == 3
    assert eng.drafted > 0
