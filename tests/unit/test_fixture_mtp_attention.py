"""Unit tests for the mtp-attention fixture (`fixtures.mtp_attention_spec`): the mtp fixture
whose MTP layer attends over its own KV cache. Its target must stay the last-token closed
form exactly, and its draft must depend on what the MTP cache holds (no server)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import gguf
import numpy as np
import pytest

from fixture_bytes import rebuilt_identically
from specaudit import fixtures as fx
from specaudit.fixtures import truth
from specaudit.fixtures.reference import (
    AmbiguousSamplingError,
    mtp_attention_head,
    mtp_cache_hidden,
    mtp_target_hidden,
)
from specaudit.fixtures.truth import mtp_greedy_draft

SPEC = fx.spec_for_kind("mtp-attention")
MTP = fx.spec_for_kind("mtp")
N = len(SPEC.letters)
CONTEXTS = ("a", "bc", "bcdbc", "hhgfa", "bcdbcaa", "abcdefgh", "ggggggggb", "dcbadcbadcba")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> fx.FixtureSet:
    return fx.build(tmp_path_factory.mktemp("mtp-attention"), kind="mtp-attention")


def test_mtp_attention_fixture_is_byte_identical_and_round_trips(
    built: fx.FixtureSet, tmp_path: Path
) -> None:
    assert built.spec == SPEC
    r = rebuilt_identically(built, tmp_path)
    arch = r.get_field("general.architecture")
    assert arch is not None and arch.contents() == "glm4moe"
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    assert np.any(t["blk.1.attn_v.weight"]) and np.any(t["blk.1.attn_output.weight"])
    assert not np.any(t["blk.0.attn_v.weight"])  # the trunk stays the last-token layer


def test_target_is_the_mtp_fixtures_exact_closed_form() -> None:
    """The MTP layer's attention touches the draft only: after every context the target's
    logits are the mtp (and so the default) fixture's, bit for bit, and so is the sequence
    distribution `dist` tests against."""
    for text in CONTEXTS:
        assert np.array_equal(fx.context_logits(SPEC, text), fx.context_logits(MTP, text))
    sampler = fx.REPORT_SAMPLER
    assert fx.sequence_distribution(SPEC, SPEC.prompt, 3, sampler) == fx.sequence_distribution(
        MTP, MTP.prompt, 3, sampler
    )


def _f32_norm(x: np.ndarray, w: np.ndarray, eps: np.float32) -> np.ndarray:
    x = x.astype(np.float32)
    return (x / np.sqrt(np.mean(x * x, dtype=np.float32) + eps) * w).astype(np.float32)


def _f32_mtp_layer(
    t: dict[str, np.ndarray], tokens: list[int], hidden: np.ndarray, eps: np.float32
) -> np.ndarray:
    """The MTP layer in float32 straight from the written tensors, cell by cell, with the
    attention's scores computed from its query and key (no shortcut for their being zero)."""
    d = SPEC.config.n_embd
    hd = SPEC.config.head_dim
    rows, keys, values = [], [], []
    for tok, h in zip(tokens, hidden, strict=True):
        e = _f32_norm(t["token_embd.weight"][tok], t["blk.1.nextn.enorm.weight"], eps)
        hn = _f32_norm(h, t["blk.1.nextn.hnorm.weight"], eps)
        r = t["blk.1.nextn.eh_proj.weight"] @ np.concatenate([e, hn])
        x = _f32_norm(r, t["blk.1.attn_norm.weight"], eps)
        rows.append(r)
        keys.append(t["blk.1.attn_k.weight"] @ x)
        values.append(t["blk.1.attn_v.weight"] @ x)
    q = t["blk.1.attn_q.weight"] @ _f32_norm(rows[-1], t["blk.1.attn_norm.weight"], eps)
    o = np.zeros(d, dtype=np.float32)
    for head in range(SPEC.config.n_head):
        sl = slice(head * hd, (head + 1) * hd)
        s = np.array([k[sl] @ q[sl] for k in keys], dtype=np.float64) / np.sqrt(hd)
        w = np.exp(s - s.max())
        w /= w.sum()
        o[sl] = sum(wj * v[sl] for wj, v in zip(w, values, strict=True))
    x = rows[-1] + t["blk.1.attn_output.weight"] @ o
    out = _f32_norm(x, t["blk.1.nextn.shared_head_norm.weight"], eps)
    return np.asarray(t["blk.1.nextn.shared_head_head.weight"] @ out, dtype=np.float64)


def test_a_float32_forward_pass_of_the_gguf_agrees_with_the_reference(
    built: fx.FixtureSet,
) -> None:
    """Over a cache a correct server holds, and over one with a cell the head itself wrote
    (its own hidden state), the float32 pass of the written tensors and the float64
    reference give the same MTP logits."""
    t = {
        x.name: np.asarray(x.data, dtype=np.float32) for x in gguf.GGUFReader(built.target).tensors
    }
    eps = np.float32(SPEC.config.rms_eps)
    for text in CONTEXTS:
        ids = SPEC.tokenize(text)
        hidden = mtp_cache_hidden(SPEC, ids)
        z = _f32_mtp_layer(t, ids, hidden, eps)
        assert np.allclose(z, mtp_attention_head(SPEC, ids, hidden, f16_cache=False)[0], atol=1e-4)
        assert np.allclose(z, mtp_attention_head(SPEC, ids, hidden)[0], atol=2e-3)  # f16 cache
        _, own = mtp_attention_head(SPEC, ids, hidden)
        mixed = np.vstack([hidden, own])
        z2 = _f32_mtp_layer(t, [*ids, ids[0]], mixed, eps)
        ref2 = mtp_attention_head(SPEC, [*ids, ids[0]], mixed, f16_cache=False)[0]
        assert np.allclose(z2, ref2, atol=1e-4)


def test_the_draft_depends_on_the_tokens_the_mtp_cache_holds() -> None:
    """With its attention zeroed this is the mtp fixture, whose draft sees only the token fed
    and the letter before it; here the drafts after the same last two letters differ with
    the earlier context, and differ from the mtp fixture's."""
    differs_from_mtp = 0
    by_last_two: dict[str, set[str]] = {}
    for tail in itertools.product(SPEC.letters, repeat=3):
        text = SPEC.prompt + "".join(tail)
        try:
            d = mtp_greedy_draft(SPEC, text[:-1], text[-1], 3)
        except AmbiguousSamplingError:
            continue
        differs_from_mtp += d != mtp_greedy_draft(MTP, text[:-1], text[-1], 3)
        by_last_two.setdefault(text[-2:], set()).add(d)
    assert differs_from_mtp > 20
    assert sum(len(v) > 1 for v in by_last_two.values()) > 5


def test_a_stale_cell_the_head_wrote_changes_the_draft() -> None:
    """The cache cells of accepted draft tokens must be re-evaluated with the target's hidden
    state: a cell kept from the draft (the head's own h_nextn as its hidden input) changes
    what the head drafts next (its first proposal: on 18 of the 512 contexts here; later
    steps and more stale cells move it more)."""
    changed = 0
    for tail in itertools.product(SPEC.letters, repeat=3):
        ids = SPEC.tokenize(SPEC.prompt + "".join(tail))
        good = mtp_cache_hidden(SPEC, ids)
        stale = good.copy()
        # position -2 as the draft left it: fed the token before, with its own hidden state
        stale[-2] = mtp_attention_head(SPEC, ids[:-2], good[:-2])[1]
        a = mtp_attention_head(SPEC, ids, good)[0]
        b = mtp_attention_head(SPEC, ids, stale)[0]
        changed += int(np.argmax(a) != np.argmax(b))
    assert changed >= 10


def test_a_target_hidden_states_letter_does_not_move_the_attention() -> None:
    """Every target hidden state of this trunk is a one-hot of the same size, and the values
    read only the token and the part the head's own states carry: which target row a cell
    was paired with (llama-server re-evaluates a cached prompt's last token with the previous
    request's pending row) leaves the draft exactly as it is."""
    ids = SPEC.tokenize(SPEC.prompt + "ahg")
    good = mtp_cache_hidden(SPEC, ids)
    for letter in range(N):
        other = good.copy()
        other[3] = mtp_target_hidden(SPEC, [letter])
        assert np.array_equal(
            mtp_attention_head(SPEC, ids, good)[0], mtp_attention_head(SPEC, ids, other)[0]
        )


def test_prefixes_merge_by_the_targets_last_letter_but_the_draft_sees_the_whole_text() -> None:
    """`dist` merges prefixes by `state_key` (all the target sees: the last letter, so long
    generations stay cheap); the draft's logits still come from the whole text."""
    assert SPEC.state_key("bcdbcaa") == "a"
    for text in CONTEXTS:
        ids = SPEC.tokenize(text)
        expected = mtp_attention_head(SPEC, ids, mtp_cache_hidden(SPEC, ids))[0]
        assert np.array_equal(fx.context_logits(SPEC, text, "draft"), expected)
    assert not np.array_equal(
        fx.context_logits(SPEC, "abcdefgh", "draft"), fx.context_logits(SPEC, "h", "draft")
    )


def test_near_ties_are_refused_not_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(truth, "MTP_ARGMAX_MARGIN", 1e6)
    with pytest.raises(AmbiguousSamplingError):
        mtp_greedy_draft(SPEC, "bcdb", "c", 1)


def test_spec_validation_of_the_mtp_attention_kind() -> None:
    with pytest.raises(ValueError, match="draft_context"):
        dataclasses.replace(SPEC, draft_context=())
    with pytest.raises(ValueError, match="target context"):
        dataclasses.replace(SPEC, target_context=SPEC.draft_context)
    with pytest.raises(ValueError, match="5 x vocabulary"):
        dataclasses.replace(SPEC, config=dataclasses.replace(SPEC.config, n_embd=48))
    with pytest.raises(ValueError, match="MTP attention"):
        mtp_attention_head(MTP, [0], np.zeros((1, MTP.config.n_embd)))
