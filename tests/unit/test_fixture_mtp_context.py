"""Unit tests for the mtp-context fixture (`fixtures.mtp_context_spec`): the MTP fixture's
glm4moe on the context fixture's attention, its bytes, its closed-form target and a draft that
sees the whole context through the target's hidden state (no server)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from fixture_bytes import rebuilt_identically
from specaudit import fixtures as fx
from specaudit.fixtures.reference import mtp_head, mtp_target_hidden
from specaudit.fixtures.truth import mtp_greedy_draft

SPEC = fx.spec_for_kind("mtp-context")
CONTEXT = fx.spec_for_kind("context")
LETTERS = SPEC.letters
N = len(LETTERS)
CONTEXTS = ("a", "bc", "bcdbc", "hhgfa", "bcdbcaa", "abcdefgh", "ggggggggb", "dcbadcbadcba")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> fx.FixtureSet:
    return fx.build(tmp_path_factory.mktemp("mtp-context"), kind="mtp-context")


def test_mtp_context_fixture_is_byte_identical_and_round_trips(
    built: fx.FixtureSet, tmp_path: Path
) -> None:
    assert built.spec == SPEC
    r = rebuilt_identically(built, tmp_path)
    arch = r.get_field("general.architecture")
    assert arch is not None and arch.contents() == "glm4moe"
    names = [t.name for t in r.tensors]
    assert "blk.0.attn_q.weight" in names and "blk.1.nextn.eh_proj.weight" in names


def test_target_is_the_context_fixtures_closed_form() -> None:
    """Same tables, same attention, NEOX instead of normal RoPE on another dimension: the
    target's next-token distribution is the context fixture's after every context."""
    for text in CONTEXTS:
        assert np.allclose(
            fx.context_logits(SPEC, text), fx.context_logits(CONTEXT, text), atol=1e-12
        )
    assert SPEC.state_key("bcdbc") == "bcdbc"  # the whole context counts


def _attention_histogram(text: str) -> np.ndarray:
    """The share of each letter among the positions of the last position's parity."""
    same = [ch for j, ch in enumerate(text) if (len(text) - 1 - j) % 2 == 0]
    m = np.zeros(N)
    for ch in same:
        m[LETTERS.index(ch)] += 1 / len(same)
    return m


def test_draft_is_the_documented_formula_of_the_context() -> None:
    """``draft[token] + 0.75 (draft_hidden[last] + r sum_t m_t draft_context[t]) /
    sqrt(1 + r^2 |m|^2)`` of the context before the token, up to the RMSNorm epsilon (which
    ``hnorm`` meets on a unit vector: a relative 3e-4)."""
    r = SPEC.context_model.value_scale / SPEC.config.embedding_value  # type: ignore[union-attr]
    for text in CONTEXTS[1:]:
        prev, token = text[:-1], LETTERS.index(text[-1])
        m = _attention_histogram(prev)
        hidden = np.asarray(SPEC.draft_hidden[LETTERS.index(prev[-1])])
        extra = hidden + r * m @ np.asarray(SPEC.draft_context)
        want = np.asarray(SPEC.draft[token]) + 0.75 * extra / math.sqrt(1 + r * r * m @ m)
        got = fx.context_logits(SPEC, text, "draft")[:N]
        assert np.allclose(got, want, atol=3e-3), text


def test_the_draft_sees_more_than_the_last_two_letters() -> None:
    """Contexts ending in the same two letters draft differently: the hidden state handed
    to the MTP head carries the whole context (the mtp kind's draft sees two letters)."""
    differ = 0
    for a, b in itertools.product("abcd", repeat=2):
        drafts = {mtp_greedy_draft(SPEC, pre + a, b, 1) for pre in ("", "e", "hh", "gfe")}
        differ += len(drafts) > 1
    assert differ >= 4
    mtp = fx.spec_for_kind("mtp")
    assert {mtp_greedy_draft(mtp, pre + "a", "b", 1) for pre in ("", "e", "hh", "gfe")} == {
        mtp_greedy_draft(mtp, "a", "b", 1)
    }


def _f32_norm(x: np.ndarray, w: np.ndarray, eps: np.float32) -> np.ndarray:
    """ggml's float32 RMSNorm (float mean, 1/sqrtf)."""
    mean = np.float32(np.sum(x.astype(np.float64) ** 2) / x.size)
    return (x * (np.float32(1.0) / np.sqrt(np.float32(mean + eps))) * w).astype(np.float32)


def _neox(x: np.ndarray, pos: int, base: np.float32) -> np.ndarray:
    """NEOX RoPE of one head vector in float32, written from ggml's rope_yarn (ext 0)."""
    d = x.size
    out = x.copy()
    for i in range(d // 2):
        theta = np.float32(pos * base ** np.float32(-2.0 * i / d))
        c, s = np.float32(math.cos(theta)), np.float32(math.sin(theta))
        out[i] = x[i] * c - x[i + d // 2] * s
        out[i + d // 2] = x[i] * s + x[i + d // 2] * c
    return out


def test_a_float32_forward_pass_of_the_gguf_agrees_with_the_reference(
    built: fx.FixtureSet,
) -> None:
    """The trunk (attention with NEOX RoPE, post-attention norm, zero FFN, final norm) and the
    MTP head evaluated in float32 straight from the written tensors, independently of the
    reference's float64 code: the hidden state and both heads' logits agree."""
    t = {
        x.name: np.asarray(x.data, dtype=np.float32) for x in gguf.GGUFReader(built.target).tensors
    }
    eps = np.float32(SPEC.config.rms_eps)
    base = np.float32(SPEC.config.rope_freq_base)
    for text in CONTEXTS:
        ids = SPEC.tokenize(text)
        u = [_f32_norm(t["token_embd.weight"][i], t["blk.0.attn_norm.weight"], eps) for i in ids]
        q = _neox(t["blk.0.attn_q.weight"] @ u[-1], len(ids) - 1, base)
        keys = [_neox(t["blk.0.attn_k.weight"] @ x, p, base) for p, x in enumerate(u)]
        scores = np.array([k @ q for k in keys], dtype=np.float64) / 8.0
        w = np.exp(scores - scores.max())
        w /= w.sum()
        o = sum(wj * (t["blk.0.attn_v.weight"] @ x) for wj, x in zip(w, u, strict=True))
        x = t["token_embd.weight"][ids[-1]] + t["blk.0.attn_output.weight"] @ o
        h = _f32_norm(x.astype(np.float32), t["output_norm.weight"], eps)
        assert np.allclose(h, mtp_target_hidden(SPEC, ids), atol=1e-6), text
        assert np.allclose(t["output.weight"] @ h, fx.context_logits(SPEC, text), atol=1e-5)
        for last in range(N):
            e = _f32_norm(t["token_embd.weight"][last], t["blk.1.nextn.enorm.weight"], eps)
            hn = _f32_norm(h, t["blk.1.nextn.hnorm.weight"], eps)
            r = t["blk.1.nextn.eh_proj.weight"] @ np.concatenate([e, hn])
            out = _f32_norm(r, t["blk.1.nextn.shared_head_norm.weight"], eps)
            z = t["blk.1.nextn.shared_head_head.weight"] @ out
            assert np.allclose(z, mtp_head(SPEC, last, h.astype(np.float64))[0], atol=1e-5)
            assert np.allclose(
                z[:N], fx.context_logits(SPEC, text + LETTERS[last], "draft")[:N], atol=1e-5
            )


def test_spec_validation_of_the_mtp_context_kind() -> None:
    with pytest.raises(ValueError, match="draft_hidden"):
        dataclasses.replace(SPEC, draft_hidden=())
    with pytest.raises(ValueError, match="target_context"):
        dataclasses.replace(SPEC, target_context=())
    with pytest.raises(ValueError, match="3 x vocabulary"):
        dataclasses.replace(SPEC, config=dataclasses.replace(SPEC.config, n_embd=32))
