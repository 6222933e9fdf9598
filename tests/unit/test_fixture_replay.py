"""Unit tests for the replay-kind fixture (`fixtures.replay_spec`): a one-layer Mamba target
whose layer adds nothing (the last-token closed form) and the last-token llama draft; its
bytes, its GGUF layout and its closed form (no server)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest

from specaudit import fixtures as fx
from specaudit.distribution import coverage
from specaudit.fixtures.writer import (
    REPLAY_D_CONV,
    REPLAY_D_STATE,
    REPLAY_DT_RANK,
    last_token_tensors,
)
from specaudit.llama import presets

R = fx.REPORT_SAMPLER
SPEC = fx.spec_for_kind("replay")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> fx.FixtureSet:
    return fx.build(tmp_path_factory.mktemp("replay"), kind="replay")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}


def test_replay_fixture_is_byte_identical_across_builds(tmp_path: Path) -> None:
    a = fx.build(tmp_path / "a", kind="replay")
    b = fx.build(tmp_path / "b", SPEC)
    for name in (fx.TARGET_FILE, fx.DRAFT_FILE, fx.MANIFEST_FILE):
        assert _sha(a.dir / name) == _sha(b.dir / name)


def test_manifest_round_trips_and_load_checks_the_mamba_tensors(built: fx.FixtureSet) -> None:
    again = fx.load(built.dir)
    assert again.spec == SPEC and again.spec.kind == "replay"
    # the SSM output projection (the last tensor) made non-zero on disk: caught by the
    # tensor cross-check, not only by the hash
    data = bytearray(built.target.read_bytes())
    data[-4:] = np.float32(0.5).tobytes()
    bad = built.dir.parent / "bad"
    fx.build(bad, SPEC)
    (bad / fx.TARGET_FILE).write_bytes(bytes(data))
    with pytest.raises(fx.FixtureError):
        fx.load(bad)


def test_target_is_a_mamba_whose_layer_adds_nothing(built: fx.FixtureSet) -> None:
    """The keys b11434's Mamba loader reads (inner size twice the embedding width), every
    SSM projection zero, so the residual is the token's embedding: the logits are the
    last-token head's, ``output(output_norm(token_embd[last]))``."""
    r = gguf.GGUFReader(built.target)

    def value(key: str) -> object:
        field = r.get_field(key)
        assert field is not None, key
        return field.contents()

    d = SPEC.config.n_embd
    assert value("general.architecture") == "mamba"
    assert value("mamba.block_count") == 1
    assert value("mamba.ssm.inner_size") == 2 * d
    assert value("mamba.ssm.conv_kernel") == REPLAY_D_CONV
    assert value("mamba.ssm.state_size") == REPLAY_D_STATE
    assert value("mamba.ssm.time_step_rank") == REPLAY_DT_RANK
    t = _tensors(built.target)
    for name in ("ssm_in.weight", "ssm_x.weight", "ssm_dt.weight", "ssm_out.weight"):
        assert not np.any(t[f"blk.0.{name}"]), name
    # the head is the last-token llama target's, tensor for tensor
    llama = dict(last_token_tensors(SPEC, "target"))
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        assert np.array_equal(t[name], llama[name]), name
    assert not any(n.startswith("blk.0.attn_") and n != "blk.0.attn_norm.weight" for n in t)


def test_draft_is_the_last_token_llama_draft(built: fx.FixtureSet) -> None:
    draft = _tensors(built.draft)
    want = dict(last_token_tensors(fx.default_spec(), "draft"))
    assert list(draft) == list(want)
    for name, array in want.items():
        assert np.array_equal(draft[name], array), name
    arch = gguf.GGUFReader(built.draft).get_field("general.architecture")
    assert arch is not None and arch.contents() == "llama"


def test_closed_form_is_the_last_token_fixtures() -> None:
    default = fx.default_spec()
    for prefix in ("bcdbc", "bcdbcf", "a", "hh"):
        assert fx.next_token_distribution(SPEC, prefix, R) == fx.next_token_distribution(
            default, prefix, R
        )
    assert fx.sequence_distribution(SPEC, SPEC.prompt, 3, R) == fx.sequence_distribution(
        default, default.prompt, 3, R
    )


def test_the_replay_fixture_runs_plain_and_the_replay_paths_only() -> None:
    assert coverage.kind_paths("replay") == ("plain", "replay", "replay-rejection")
    for kind in ("last-token", "mtp", "replay"):
        assert all(coverage.path_kind(p) == kind for p in coverage.kind_paths(kind) if p != "plain")
    assert not set(presets.REPLAY_PATHS) & set(coverage.kind_paths("last-token"))
    rej = presets.PRESETS[presets.fixture_role("fixture-replay", "replay-rejection")]
    assert rej.uses_draft and rej.extra_args == ("--spec-draft-sampling", "probabilistic")
    with pytest.raises(ValueError, match="does not run on"):
        presets.fixture_role("fixture", "replay")
    with pytest.raises(ValueError, match="does not run on"):
        presets.fixture_role("fixture-replay", "greedy")


def test_dist_builds_the_replay_fixture_for_its_kind(tmp_path: Path) -> None:
    """`--fixture-kind replay` without `--fixture` gets the replay fixture, not the default."""
    from specaudit.distribution.request import load_fixture

    fs = load_fixture(None, tmp_path, "replay")
    assert fs.spec == SPEC and fs.dir == tmp_path / "replay"
