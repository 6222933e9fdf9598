"""Unit tests for the MTP-kind fixture (`fixtures.mtp_spec`): a glm4moe target with one
multi-token-prediction layer, its bytes, its GGUF layout and its closed-form target and draft
(no server)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from pathlib import Path

import gguf
import numpy as np
import pytest

from specaudit import fixtures as fx
from specaudit.fixtures.definitions import MTP_HIDDEN_WEIGHT, FixtureKind
from specaudit.fixtures.reference import eagle3_head, mtp_head, mtp_target_hidden
from specaudit.fixtures.specs import _random_table
from specaudit.fixtures.truth import eagle3_greedy_draft, mtp_greedy_draft
from specaudit.fixtures.writer import EAGLE3_MIN_MARGIN, eagle3_self_attention_margin

R = fx.REPORT_SAMPLER
SPEC = fx.spec_for_kind("mtp")
LETTERS = SPEC.letters


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> fx.FixtureSet:
    return fx.build(tmp_path_factory.mktemp("mtp"), kind="mtp")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_mtp_fixture_is_byte_identical_across_builds(tmp_path: Path) -> None:
    a = fx.build(tmp_path / "a", kind="mtp")
    b = fx.build(tmp_path / "b", SPEC)
    for name in (fx.TARGET_FILE, fx.DRAFT_FILE, fx.MANIFEST_FILE):
        assert _sha(a.dir / name) == _sha(b.dir / name)


def test_manifest_round_trips_and_load_checks_every_tensor(built: fx.FixtureSet) -> None:
    again = fx.load(built.dir)
    assert again.spec == SPEC
    assert again.spec.kind == "mtp"
    # a tensor of the MTP layer changed on disk is caught by the cross-check, not only the hash
    data = bytearray(built.target.read_bytes())
    data[-4:] = np.float32(7.0).tobytes()  # last value of the last tensor (shared_head_norm)
    bad = built.dir.parent / "bad"
    fx.build(bad, SPEC)
    (bad / fx.TARGET_FILE).write_bytes(bytes(data))
    with pytest.raises(fx.FixtureError):
        fx.load(bad)


def test_hidden_table_is_its_seeded_derivation() -> None:
    drawn = _random_table(np.random.RandomState([11, 9]), 8, 2.0)
    assert np.allclose(np.asarray(SPEC.draft_hidden), np.asarray(drawn), atol=5e-4)


def test_gguf_is_a_glm4moe_with_one_dense_trunk_layer_and_one_nextn_layer(
    built: fx.FixtureSet,
) -> None:
    r = gguf.GGUFReader(built.target)

    def value(key: str) -> object:
        field = r.get_field(key)
        assert field is not None, key
        return field.contents()

    assert value("general.architecture") == "glm4moe"
    assert value("glm4moe.block_count") == 2
    assert value("glm4moe.nextn_predict_layers") == 1
    assert value("glm4moe.leading_dense_block_count") == 1
    assert value("glm4moe.expert_count") == 2
    assert value("glm4moe.expert_used_count") == 1
    assert value("glm4moe.expert_shared_count") == 1
    names = {t.name for t in r.tensors}
    for required in (
        "blk.0.ffn_gate.weight",  # the trunk layer is dense
        "blk.1.ffn_gate_inp.weight",  # the nextn layer is MoE
        "blk.1.exp_probs_b.bias",
        "blk.1.ffn_gate_shexp.weight",  # one shared expert, zero (none would pass silu(x))
        "blk.1.nextn.eh_proj.weight",
        "blk.1.nextn.enorm.weight",
        "blk.1.nextn.hnorm.weight",
        "blk.1.nextn.shared_head_head.weight",
        "blk.1.nextn.shared_head_norm.weight",
    ):
        assert required in names
    assert "blk.1.ffn_gate.weight" not in names  # llama.cpp rejects tensors it does not use
    zeroed = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "exps.", "shexp.", "gate_inp.")
    zero = [t for t in r.tensors if any(z in t.name for z in zeroed)]
    assert len(zero) == 2 * 4 + 7 and not any(np.any(np.asarray(t.data)) for t in zero)
    # both files are the one model (names aside): the target is its own drafter
    d = gguf.GGUFReader(built.draft)
    for a, b in zip(r.tensors, d.tensors, strict=True):
        assert a.name == b.name and np.array_equal(np.asarray(a.data), np.asarray(b.data))


def test_target_is_the_default_fixtures_last_token_table() -> None:
    default = fx.default_spec()
    for prefix in ("bcdbc", "bcdbcf", "a", "hh"):
        assert fx.next_token_distribution(SPEC, prefix, R) == pytest.approx(
            fx.next_token_distribution(default, prefix, R), abs=1e-12
        )


def test_draft_is_token_table_plus_weighted_hidden_table() -> None:
    """The closed form the writer's constants promise, up to the RMSNorm epsilon."""
    n = len(LETTERS)
    for prev, last in itertools.product(range(n), range(n)):
        z = fx.context_logits(SPEC, LETTERS[prev] + LETTERS[last], "draft")[:n]
        want = np.asarray(SPEC.draft[last]) + MTP_HIDDEN_WEIGHT * np.asarray(
            SPEC.draft_hidden[prev]
        )
        assert np.allclose(z, want, rtol=2e-3, atol=2e-3)


def test_a_float32_forward_pass_of_the_gguf_agrees_with_the_reference(
    built: fx.FixtureSet,
) -> None:
    """ggml's RMSNorm in float32 (float mean, 1/sqrtf) over the written tensors."""
    t = {
        x.name: np.asarray(x.data, dtype=np.float32) for x in gguf.GGUFReader(built.target).tensors
    }
    eps = np.float32(SPEC.config.rms_eps)

    def norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        mean = np.float32(np.sum(x.astype(np.float64) ** 2) / x.size)
        return (x * (np.float32(1.0) / np.sqrt(np.float32(mean + eps))) * w).astype(np.float32)

    for prev, last in itertools.product(range(len(LETTERS)), repeat=2):
        h = norm(t["token_embd.weight"][prev], t["output_norm.weight"])
        assert np.allclose(h, mtp_target_hidden(SPEC, [prev]), atol=1e-6)
        e = norm(t["token_embd.weight"][last], t["blk.1.nextn.enorm.weight"])
        hn = norm(h, t["blk.1.nextn.hnorm.weight"])
        r = t["blk.1.nextn.eh_proj.weight"] @ np.concatenate([e, hn])
        out = norm(r, t["blk.1.nextn.shared_head_norm.weight"])
        z = t["blk.1.nextn.shared_head_head.weight"] @ out
        ref, ref_h = mtp_head(SPEC, last, mtp_target_hidden(SPEC, [prev]))
        assert np.allclose(z, ref, rtol=1e-6, atol=1e-5)
        assert np.allclose(out, ref_h, atol=1e-6)


def test_the_hidden_half_changes_the_greedy_draft() -> None:
    """A head handed the wrong hidden row drafts other tokens: for every token fed, the letter
    before it moves the MTP head's argmax."""
    n = len(LETTERS)
    for last in range(n):
        drafts = {
            int(np.argmax(fx.context_logits(SPEC, LETTERS[p] + LETTERS[last], "draft")[:n]))
            for p in range(n)
        }
        assert len(drafts) >= 2, LETTERS[last]


def test_first_draft_step_without_a_hidden_row_uses_the_token_half_only() -> None:
    """llama.cpp's first pending row is zeros: the head sees the token half alone, which its
    norm scales to 1.25 (1024 in 64 dims has RMS 128; 8 x 5/32)."""
    z = fx.context_logits(SPEC, "c", "draft")[: len(LETTERS)]
    assert np.allclose(z, 1.25 * np.asarray(SPEC.draft[2]), rtol=1e-6)


def test_state_key_is_the_last_two_letters_and_marginals_agree_with_the_joint() -> None:
    assert SPEC.state_key("bcdbc") == "bc"
    assert SPEC.state_key("c") == "c"
    truth = fx.FixtureTruth(SPEC, SPEC.prompt, R)
    joint = truth.joint(3)
    idx = {ch: i for i, ch in enumerate(LETTERS)}
    for t in (1, 2, 3):
        m = np.zeros(len(LETTERS))
        for seq, p in joint.items():
            m[idx[seq[t - 1]]] += p
        assert np.allclose(truth.marginal(t)[: len(LETTERS)], m, atol=1e-12)


def test_spec_validation_of_the_hidden_table() -> None:
    with pytest.raises(ValueError, match="draft_hidden"):
        dataclasses.replace(SPEC, draft_hidden=())
    with pytest.raises(ValueError, match="draft_hidden"):
        dataclasses.replace(fx.default_spec(), draft_hidden=SPEC.draft_hidden)
    with pytest.raises(ValueError, match="n_embd"):
        dataclasses.replace(SPEC, config=fx.ModelConfig(n_embd=16))


def test_greedy_counts_follow_the_servers_draft_schedule() -> None:
    """Four tokens after the prompt: the first from the prompt, then a draft of at most
    n_remaining - 1 tokens; a sample that follows the drafts accepts them all."""
    d = mtp_greedy_draft(SPEC, SPEC.prompt[-1], "f", 2)
    assert fx.mtp_greedy_counts(SPEC, SPEC.prompt, "f" + d + "a") == (2, 2)
    miss = "h" if d[0] != "h" else "g"
    # first draft missed: one more round of one token after the second
    drafted, accepted = fx.mtp_greedy_counts(SPEC, SPEC.prompt, "f" + miss + "aa")
    assert drafted == 3 and accepted in (0, 1)
    miss2 = "a" if d[1] != "a" else "b"
    assert fx.mtp_greedy_counts(SPEC, SPEC.prompt, "f" + d[0] + miss2 + "a") == (2, 1)
    assert fx.mtp_greedy_counts(SPEC, SPEC.prompt, "fg") == (0, 0)  # n_remaining - 1 = 0
    with pytest.raises(ValueError, match="no MTP layer"):
        mtp_greedy_draft(fx.default_spec(), "c", "f", 1)


def test_greedy_counts_on_vllms_schedule_draft_in_full_and_may_accept_past_the_end() -> None:
    """vLLM drafts ``n`` tokens every round however few remain, and its last round counts the
    drafts past the output it accepted (unseen): a range then, exact otherwise. Drafter:
    always "a"."""

    def always_a(_spec: fx.FixtureSpec, _prev: str, _last: str, n: int) -> str:
        return "a" * n

    def counts(generated: str) -> tuple[int, int, int]:
        return fx.vllm_greedy_counts(SPEC, SPEC.prompt, generated, 3, always_a)

    assert counts("fg") == (3, 0, 0)  # rejected inside the output: exact
    assert counts("fa") == (3, 1, 3)  # the output ends after one accepted: two unseen
    assert counts("faaaa") == (3, 3, 3)  # three accepted, the fourth "a" is the target's own
    assert counts("faaaab") == (6, 3, 3)  # then a round before "b": drafted, none accepted
    assert counts("faaaaa") == (6, 4, 6)
    # llama-server's schedule: the last token is decoded alone, without a draft
    assert fx.mtp_greedy_counts(SPEC, SPEC.prompt, "faaaab", 3, always_a) == (3, 3)


def test_greedy_drafts_chain_the_heads_own_hidden_state() -> None:
    """The second draft step is fed the first draft with the head's own h_nextn (not the
    target's hidden state of the token fed): it differs from a first step after the same
    pair of letters."""
    differ = 0
    for p, q in itertools.product(LETTERS, repeat=2):
        chained = mtp_greedy_draft(SPEC, p, q, 2)
        differ += chained[1] != mtp_greedy_draft(SPEC, q, chained[0], 1)
    assert differ > 0


# ------------------------------------------------------------------ the EAGLE3 draft head


def test_eagle3_head_is_written_next_to_a_llama_fixture_deterministically(tmp_path: Path) -> None:
    fs = fx.build(tmp_path / "f")
    path = fx.eagle3_draft(fs)
    assert path == fs.dir / fx.EAGLE3_FILE
    first = path.read_bytes()
    assert fx.eagle3_draft(fs).read_bytes() == first
    path.write_bytes(b"stale")
    assert fx.eagle3_draft(fs).read_bytes() == first  # a wrong file is replaced
    assert fx.load(fs.dir).spec == fs.spec  # the manifest does not list it
    r = gguf.GGUFReader(path)
    arch = r.get_field("general.architecture")
    layers = r.get_field("eagle3.target_layers")
    assert arch is not None and arch.contents() == "eagle3"
    assert layers is not None and layers.contents() == [0, 0, 0]
    with pytest.raises(ValueError, match="glm4moe"):
        fx.eagle3_draft(fx.build(tmp_path / "m", kind="mtp"))


def test_eagle3_greedy_draft_chains_the_draft_tables_argmax_from_the_fed_token() -> None:
    spec = fx.default_spec()
    table = np.asarray(spec.draft)
    for last in spec.letters:
        want, token = "", last
        for _ in range(3):
            token = spec.letters[int(np.argmax(table[spec.letters.index(token)]))]
            want += token
        for prev in ("a", "h"):  # the hidden state it is handed cancels
            assert eagle3_greedy_draft(spec, prev, last, 3) == want


@pytest.mark.parametrize("kind", ["last-token", "context"])
def test_eagle3_head_attends_to_its_own_position_and_proposes_the_fed_tokens_row(
    kind: FixtureKind,
) -> None:
    """The head's decoder over a full draft context (every position of the fixture's context
    length, f16 K/V as the draft context stores them): each position attends to itself, the
    hidden state it was handed cancels, its pre-norm output is the fed token's embedding (what
    the next draft step is handed) and its logits are the draft table's row of that token."""
    spec = fx.spec_for_kind(kind)
    cfg, n = spec.config, len(spec.letters)
    rng = np.random.default_rng(7)
    seq = rng.integers(0, n, cfg.context_length + 1)
    g = np.zeros((cfg.context_length, cfg.n_embd))
    g[np.arange(cfg.context_length), seq[:-1]] = cfg.embedding_value  # fc of layer 0's input
    logits, out, weights = eagle3_head(spec, [int(x) for x in seq[1:]], g)
    assert np.einsum("hpp->hp", weights).min() > 1.0 - 1e-12
    want = np.zeros_like(out)
    want[np.arange(cfg.context_length), seq[1:]] = cfg.embedding_value
    assert np.abs(out - want).max() < 1e-6
    rows = np.asarray(spec.draft)[seq[1:]]
    np.testing.assert_allclose(logits[:, :n], rows, atol=1e-6)
    assert eagle3_self_attention_margin(spec) >= EAGLE3_MIN_MARGIN
