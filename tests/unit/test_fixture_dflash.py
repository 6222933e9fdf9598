"""The fixture's DFlash and DSpark drafts (`writer.dflash_tensors`): the GGUF keys and tensor
shapes llama.cpp b11434 reads (src/models/dflash.cpp, common/speculative.cpp), read back with
gguf's reader; the float64 forward of the block (`reference.dflash_block`) against the closed
form of its drafts (`truth.dflash_draft`); and that the block depends on its anchor."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from specaudit import fixtures as fx
from specaudit.fixtures import reference, truth, writer
from specaudit.fixtures.definitions import FixtureKind

KINDS: tuple[FixtureKind, ...] = ("last-token", "context")


def _field(r: gguf.GGUFReader, key: str) -> object:
    f = r.get_field(key)
    assert f is not None, key
    return f.contents()


def _shapes(r: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
    """Tensor name -> ggml ne (what llama.cpp's create_tensor checks)."""
    return {t.name: tuple(int(n) for n in t.shape) for t in r.tensors}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("markov", [False, True])
def test_dflash_draft_carries_the_keys_and_tensor_shapes_b11434_loads(
    tmp_path: Path, kind: FixtureKind, markov: bool
) -> None:
    fs = fx.build(tmp_path / "f", kind=kind)
    spec = fs.spec
    path = fx.dflash_draft(fs, markov=markov)
    assert path == fs.dir / (fx.DSPARK_FILE if markov else fx.DFLASH_FILE)
    r = gguf.GGUFReader(path)
    d, v, ff = spec.config.n_embd, spec.n_vocab, spec.config.n_ff
    hd = spec.config.head_dim
    assert _field(r, "general.architecture") == "dflash"
    assert _field(r, "dflash.target_layers") == [0]  # the target's layer-0 input
    assert _field(r, "dflash.block_size") == writer.DFLASH_BLOCK_SIZE
    assert _field(r, "dflash.embedding_length") == d
    assert _field(r, "dflash.rope.freq_base") == writer.DFLASH_ROPE_FREQ_BASE
    assert _field(r, "tokenizer.ggml.mask_token_id") == spec.unk_id
    assert _field(r, "tokenizer.ggml.tokens") == list(spec.tokens)
    shapes = _shapes(r)
    want = {
        "token_embd.weight": (d, v),
        "fc.weight": (d, d),  # n_embd_inp = len(target_layers) * target n_embd
        "enc.output_norm.weight": (d,),
        "output_norm.weight": (d,),
        "output.weight": (d, v),
        "blk.0.attn_norm.weight": (d,),
        "blk.0.attn_q.weight": (d, d),
        "blk.0.attn_k.weight": (d, d),
        "blk.0.attn_v.weight": (d, d),
        "blk.0.attn_output.weight": (d, d),
        "blk.0.attn_q_norm.weight": (hd,),
        "blk.0.attn_k_norm.weight": (hd,),
        "blk.0.ffn_norm.weight": (d,),
        "blk.0.ffn_gate.weight": (d, ff),
        "blk.0.ffn_up.weight": (d, ff),
        "blk.0.ffn_down.weight": (ff, d),
    }
    if markov:  # rank n_vocab: markov_w1 {rank, n_vocab}, markov_w2 {rank, n_vocab_draft}
        want |= {"markov_w1.weight": (v, v), "markov_w2.weight": (v, v)}
        assert _field(r, "dflash.sample_from_anchor") is True
        assert _field(r, "dflash.has_confidence_head") is False
    else:  # b11434 tells draft-dspark from draft-dflash by markov_w1 alone
        assert r.get_field("dflash.sample_from_anchor") is None
    assert shapes == want
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in r.tensors)


def test_dflash_drafts_are_rewritten_when_stale_and_stay_out_of_the_manifest(
    tmp_path: Path,
) -> None:
    fs = fx.build(tmp_path / "f")
    first = fx.dflash_draft(fs).read_bytes()
    assert fx.dflash_draft(fs).read_bytes() == first == writer.dflash_bytes(fs.spec)
    (fs.dir / fx.DFLASH_FILE).write_bytes(b"stale")
    assert fx.dflash_draft(fs).read_bytes() == first
    assert fx.dflash_draft(fs, markov=True).read_bytes() != first
    assert fx.load(fs.dir).spec == fs.spec
    with pytest.raises(ValueError, match="glm4moe"):
        fx.dflash_draft(fx.build(tmp_path / "m", kind="mtp"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("markov", [False, True])
def test_the_block_forward_drafts_what_the_closed_form_says(
    kind: FixtureKind, markov: bool
) -> None:
    """The float64 forward of the GGUF tensors over a block, after random contexts: its
    argmaxes (DFlash: the mask slots; DSpark: from the anchor's slot on) are
    `truth.dflash_draft`, for every anchor letter."""
    spec = fx.spec_for_kind(kind)
    n = len(spec.letters)
    rng = np.random.default_rng(11)
    for last in range(n):
        for length in (1, 7, spec.config.context_length - writer.DFLASH_BLOCK_SIZE):
            ctx = [int(t) for t in rng.integers(0, n, length)]
            z = reference.dflash_block(spec, ctx, last, 3, markov)
            slots = z if markov else z[1:]
            got = "".join(spec.letters[int(np.argmax(row))] for row in slots)
            assert got == truth.dflash_draft(spec, spec.letters[last], 3, markov)


@pytest.mark.parametrize("kind", KINDS)
def test_the_dflash_block_is_the_anchors_table_row_whatever_the_context(kind: FixtureKind) -> None:
    """Every block slot attends to the anchor: the mask slots' logits are
    `dflash_scales`' mask factor times the draft table's row of the anchor, to float64
    rounding, whatever came before (the injected context scores 0 against 40)."""
    spec = fx.spec_for_kind(kind)
    n = len(spec.letters)
    table = np.asarray(spec.draft, dtype=np.float64)
    anchor_scale, mask_scale = truth.dflash_scales(spec)
    rng = np.random.default_rng(5)
    for last in range(n):
        ctx = [int(t) for t in rng.integers(0, n, 50)]
        z = reference.dflash_block(spec, ctx, last, 3)
        np.testing.assert_allclose(z[0, :n], anchor_scale * table[last], rtol=1e-9, atol=1e-9)
        for row in z[1:]:
            np.testing.assert_allclose(row[:n], mask_scale * table[last], rtol=1e-9, atol=1e-9)
        assert (z[:, n:] < -1e3).all()  # BOS, EOS, UNK never drafted


@pytest.mark.parametrize("kind", KINDS)
def test_the_drafts_are_not_constant(kind: FixtureKind) -> None:
    """What makes the path worth running: the block follows its anchor (at least four
    different DFlash drafts over the letters), and DSpark's Markov head changes some."""
    spec = fx.spec_for_kind(kind)
    dflash = {last: truth.dflash_draft(spec, last, 3) for last in spec.letters}
    dspark = {last: truth.dflash_draft(spec, last, 3, markov=True) for last in spec.letters}
    assert len(set(dflash.values())) >= 4
    assert all(len(set(d)) == 1 for d in dflash.values())  # one token, three times
    assert any(dspark[k] != dflash[k] for k in spec.letters)
    assert all(dspark[k][0] == dflash[k][0] for k in spec.letters)  # slot 0: the anchor's row


def test_the_dspark_draft_is_the_greedy_chain_where_the_anchor_row_does_not_outweigh_it() -> None:
    """On the last-token fixture DSpark's draft is the draft table's greedy chain from the
    anchor (the EAGLE3 head's) for every letter but one, where the anchor's own row, weighted
    by `dflash_scales`, tips the third slot."""
    spec = fx.default_spec()
    same = [
        k
        for k in spec.letters
        if truth.dflash_draft(spec, k, 3, markov=True) == truth.eagle3_greedy_draft(spec, k, k, 3)
    ]
    assert len(same) == len(spec.letters) - 1
