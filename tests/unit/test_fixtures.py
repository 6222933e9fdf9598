"""Unit tests for specaudit.fixtures: bytes, manifest, closed-form distributions (no server)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from specaudit import fixtures as fx
from specaudit.errors import SpecauditError
from specaudit.fixtures import writer

# Pinned digests of the default fixture. If these change, every recorded audit that names the
# fixture by hash changes meaning: bump FORMAT_VERSION and say why.
TARGET_SHA256 = "e08ad9e6d2f714840886a04cc356e5cb0b0158d1a7ea1c8c804e7381c94be62e"
DRAFT_SHA256 = "17307fc29782cea91e687eba69f59f61324ee6bf3bee6baf55caa3ce9484c61c"
MANIFEST_SHA256 = "8f837d3a2e8c0b9d88ad4c509610a9d93f7b805dcf2fe710cceabf4df30be235"

CliFn = Callable[..., tuple[int, str, str]]
R = fx.REPORT_SAMPLER  # top-k 3, temperature 1, top-p/min-p off


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> fx.FixtureSet:
    return fx.build(tmp_path_factory.mktemp("fixture"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _nonzero(d: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in d.items() if v > 0.0}


def _spec4(row: list[float]) -> fx.FixtureSpec:
    """A 4-letter fixture whose every row is ``row`` (hand-checkable sampler cases)."""
    table = (tuple(row),) * 4
    return fx.FixtureSpec(
        name="t4",
        letters=("a", "b", "c", "d"),
        target=table,
        draft=table,
        draft_seed=0,
        draft_noise_scale=0.0,
        prompt="a",
    )


# --------------------------------------------------------------------------------------
# Bytes and determinism
# --------------------------------------------------------------------------------------


def test_build_twice_is_byte_identical_and_pinned(tmp_path: Path) -> None:
    a = fx.build(tmp_path / "a")
    b = fx.build(tmp_path / "b")
    for name in (fx.TARGET_FILE, fx.DRAFT_FILE, fx.MANIFEST_FILE):
        assert (a.dir / name).read_bytes() == (b.dir / name).read_bytes(), name
    assert _sha(a.target) == TARGET_SHA256
    assert _sha(a.draft) == DRAFT_SHA256
    assert _sha(a.manifest) == MANIFEST_SHA256
    assert a.sha256 == {"target.gguf": TARGET_SHA256, "draft.gguf": DRAFT_SHA256}


def test_rebuild_in_place_overwrites_atomically(built: fx.FixtureSet) -> None:
    again = fx.build(built.dir)
    assert again.sha256 == built.sha256
    assert sorted(p.name for p in built.dir.iterdir()) == [
        "draft.gguf",
        "manifest.json",
        "target.gguf",
    ]


def test_manifest_content(built: fx.FixtureSet) -> None:
    m = json.loads(built.manifest.read_text())
    assert list(m) == ["format", "format_version", "name", "files", "definition"]
    assert m["format"] == fx.FORMAT and m["format_version"] == fx.FORMAT_VERSION
    assert m["files"]["target.gguf"] == {
        "sha256": TARGET_SHA256,
        "size": built.target.stat().st_size,
    }
    d = m["definition"]
    assert d["letters"] == list("abcdefgh")
    assert d["prompt"] == "bcdbc" and d["prompt_token_ids"] == [1, 2, 3, 1, 2]
    assert [t["text"] for t in d["tokens"]] == [*"abcdefgh", "<s>", "</s>", "<unk>"]
    assert (d["bos_id"], d["eos_id"], d["unk_id"]) == (8, 9, 10)
    assert d["target_logits"] == [list(r) for r in fx.default_spec().target]
    assert d["draft_logits"] == [list(r) for r in fx.default_spec().draft]
    assert d["draft_derivation"]["seed"] == 2
    assert d["model"]["context_length"] == 256
    assert d["chat_template"] == fx.CHAT_TEMPLATE


def test_other_spec_has_other_numbers_and_is_deterministic(tmp_path: Path) -> None:
    o = fx.other_spec()
    assert o == fx.other_spec() == fx.make_spec(2, name="specaudit-abcdefgh-b")
    assert o.target != fx.default_spec().target and o.name != fx.default_spec().name
    for table in (o.target, o.draft):
        assert all(len(set(row)) == len(row) for row in table)
    fs1, fs2 = fx.build(tmp_path / "1", o), fx.build(tmp_path / "2", o)
    assert fs1.sha256 == fs2.sha256 != fx.build(tmp_path / "3").sha256
    assert fx.load(fs1.dir).spec == o


def test_every_fixture_kind_has_a_canned_spec_tensors_and_a_writer() -> None:
    """A kind added to KINDS without its writer entries (see the package docstring) fails
    here, not when a user first builds it."""
    assert set(writer.TENSORS) == set(fx.KINDS) == set(writer.WRITERS)
    for kind in fx.KINDS:
        spec = fx.spec_for_kind(kind)
        assert spec.kind == kind
        names = [name for name, _ in writer.tensors(spec, "target")]
        assert names[:3] == ["token_embd.weight", "output_norm.weight", "output.weight"]


# --------------------------------------------------------------------------------------
# GGUF contents
# --------------------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, key: str) -> object:
    f = reader.get_field(key)
    assert f is not None, key
    return f.contents()


def _float_field(reader: gguf.GGUFReader, key: str) -> float:
    value = _field(reader, key)
    assert isinstance(value, float), (key, value)
    return value


def test_gguf_readable_with_expected_kv_and_tensors(built: fx.FixtureSet) -> None:
    spec = built.spec
    which: fx.Which
    for which, path in (("target", built.target), ("draft", built.draft)):
        r = gguf.GGUFReader(path)
        assert _field(r, "general.architecture") == "llama"
        assert _field(r, "general.name") == f"specaudit-abcdefgh-{which}"
        assert _field(r, "llama.context_length") == 256
        assert _field(r, "llama.embedding_length") == 16
        assert _field(r, "llama.block_count") == 1
        assert _field(r, "llama.attention.head_count") == 2
        assert _field(r, "llama.attention.head_count_kv") == 2
        assert _field(r, "llama.rope.dimension_count") == 8
        assert _field(r, "llama.vocab_size") == 11
        assert _field(r, "tokenizer.ggml.model") == "llama"
        assert _field(r, "tokenizer.ggml.tokens") == list(spec.tokens)
        assert _field(r, "tokenizer.ggml.token_type") == [1] * 8 + [3, 3, 2]
        assert _field(r, "tokenizer.ggml.bos_token_id") == 8
        assert _field(r, "tokenizer.ggml.eos_token_id") == 9
        assert _field(r, "tokenizer.ggml.unknown_token_id") == 10
        assert _field(r, "tokenizer.ggml.add_bos_token") is False
        assert _field(r, "tokenizer.ggml.add_eos_token") is False
        assert _field(r, "tokenizer.ggml.add_space_prefix") is False
        assert _field(r, "tokenizer.chat_template") == fx.CHAT_TEMPLATE
        tensors = {t.name: t for t in r.tensors}
        assert set(tensors) == {
            "token_embd.weight",
            "output_norm.weight",
            "output.weight",
            *(
                f"blk.0.{n}.weight"
                for n in (
                    "attn_norm",
                    "attn_q",
                    "attn_k",
                    "attn_v",
                    "attn_output",
                    "ffn_norm",
                    "ffn_gate",
                    "ffn_up",
                    "ffn_down",
                )
            ),
        }
        assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in r.tensors)
        for zero in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            assert not np.any(tensors[f"blk.0.{zero}.weight"].data)
        out = np.asarray(tensors["output.weight"].data)
        assert out.shape == (11, 16)
        table = np.asarray(spec.table(which), dtype=np.float32)
        assert np.array_equal(out[:8, :8], table.T)  # column = last token
        assert np.all(out[8:11, :11] == np.float32(-1e4))


def test_independent_forward_pass_matches_closed_form_logits(built: fx.FixtureSet) -> None:
    """Run the llama graph in numpy from the GGUF tensors (float32, like ggml's CPU path)."""
    r = gguf.GGUFReader(built.target)
    t = {x.name: np.asarray(x.data, dtype=np.float32) for x in r.tensors}
    eps = np.float32(_float_field(r, "llama.attention.layer_norm_rms_epsilon"))

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        mean = np.float32(np.sum(x.astype(np.float64) ** 2) / x.size)
        return (x * (np.float32(1) / np.sqrt(mean + eps))).astype(np.float32) * w

    for i, letter in enumerate(built.spec.letters):
        x = t["token_embd.weight"][i]
        h = rms(x, t["blk.0.attn_norm.weight"])
        attn = t["blk.0.attn_output.weight"] @ (t["blk.0.attn_v.weight"] @ h)  # uniform attn
        x = x + attn
        h = rms(x, t["blk.0.ffn_norm.weight"])
        g, u = t["blk.0.ffn_gate.weight"] @ h, t["blk.0.ffn_up.weight"] @ h
        x = x + t["blk.0.ffn_down.weight"] @ ((g / (1 + np.exp(-g))) * u)
        logits = t["output.weight"] @ rms(x, t["output_norm.weight"])
        assert np.array_equal(logits.astype(np.float64), built.spec.logits(letter))


def test_hidden_scale_is_exactly_one_by_design() -> None:
    assert fx.ModelConfig().hidden_scale() == 1.0
    # Honest computation: another eps/embedding would scale the table, and logits follow.
    cfg = fx.ModelConfig(embedding_value=1.0, output_norm_weight=1.0)
    assert cfg.hidden_scale() == pytest.approx(1 / math.sqrt(1 / 16 + 1e-5), rel=1e-6)


# --------------------------------------------------------------------------------------
# The field report's numbers
# --------------------------------------------------------------------------------------


def test_report_distribution_after_bcdbcf() -> None:
    spec = fx.default_spec()
    d = fx.next_token_distribution(spec, "bcdbcf", R)
    assert d["e"] == pytest.approx(0.345, abs=1e-9)
    assert d["g"] == pytest.approx(0.452, abs=1e-9)
    assert d["h"] == pytest.approx(0.203, abs=1e-9)
    assert set(_nonzero(d)) == {"e", "g", "h"}
    assert math.fsum(d.values()) == pytest.approx(1.0, abs=1e-15)
    # llama-server's defaults for top-p (0.95) and min-p (0.05) change nothing here.
    assert fx.next_token_distribution(
        spec, "bcdbcf", fx.SamplerSettings(top_k=3, temperature=1.0)
    ) == pytest.approx(d, abs=1e-15)


def test_first_token_after_prompt_is_likely_f() -> None:
    spec = fx.default_spec()
    d = _nonzero(fx.next_token_distribution(spec, spec.prompt, R))
    assert set(d) == {"f", "d", "e"}
    assert d["f"] == pytest.approx(0.84, abs=0.005)
    assert d["f"] == pytest.approx(0.8421164512966889, abs=1e-12)
    assert fx.next_token_distribution(
        spec, spec.prompt, fx.SamplerSettings(top_k=3, temperature=1.0)
    ) == pytest.approx(fx.next_token_distribution(spec, spec.prompt, R), abs=1e-15)


def test_draft_prefers_e_after_f_and_derivation_is_reproducible() -> None:
    spec = fx.default_spec()
    dd = _nonzero(fx.next_token_distribution(spec, "bcdbcf", R, which="draft"))
    assert max(dd, key=dd.__getitem__) == "e"
    td = _nonzero(fx.next_token_distribution(spec, "bcdbcf", R))
    assert max(td, key=td.__getitem__) == "g"
    assert spec.draft == fx.derive_draft(spec.target, spec.draft_seed, spec.draft_noise_scale)
    assert spec.draft != spec.target
    assert "RandomState(2)" in spec.draft_derivation


def test_default_tables_are_non_degenerate() -> None:
    spec = fx.default_spec()
    for table in (spec.target, spec.draft):
        for row in table:
            assert len(set(row)) == len(row)  # no ties anywhere: top-k is unambiguous
    for letter in spec.letters:  # every letter is reachable under top-k 3
        assert any(
            fx.next_token_distribution(spec, prev, R)[letter] > 0 for prev in spec.letters
        ), letter


def test_eos_is_not_a_letter_and_prompt_tokenizes_per_letter() -> None:
    spec = fx.default_spec()
    assert spec.tokens[spec.eos_id] == "</s>" and spec.eos_id >= len(spec.letters)
    assert spec.tokenize("bcdbc") == [1, 2, 3, 1, 2]
    with pytest.raises(ValueError, match="'x' is not a letter of fixture"):
        spec.tokenize("bcx")


# --------------------------------------------------------------------------------------
# Closed forms
# --------------------------------------------------------------------------------------


def test_raw_distribution_is_full_softmax_with_zero_specials() -> None:
    spec = fx.default_spec()
    which: fx.Which
    for which in ("target", "draft"):
        d = fx.raw_distribution(spec, "bcdbc", which)
        assert list(d) == list(spec.tokens)
        assert d["<s>"] == d["</s>"] == d["<unk>"] == 0.0
        row = np.array(spec.table(which)[2])
        expected = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        assert [d[x] for x in spec.letters] == pytest.approx(list(expected), abs=1e-15)
    # no sampler knobs: raw equals the chain with everything off
    off = fx.SamplerSettings(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)
    assert fx.next_token_distribution(spec, "bcd", off) == pytest.approx(
        fx.raw_distribution(spec, "bcd"), abs=1e-15
    )


P4 = [0.5, 0.3, 0.15, 0.05]
ROW4 = [math.log(p) for p in P4]


def _dist4(s: fx.SamplerSettings, row: list[float] = ROW4) -> list[float]:
    d = fx.next_token_distribution(_spec4(row), "a", s)
    return [d[x] for x in "abcd"]


def test_top_k() -> None:
    assert _dist4(fx.SamplerSettings(top_k=2, top_p=1, min_p=0, temperature=1)) == pytest.approx(
        [0.625, 0.375, 0, 0], abs=1e-7
    )
    for k in (0, -1, 4, 40):  # <= 0 disables; > vocab keeps everything
        assert _dist4(fx.SamplerSettings(top_k=k, top_p=1, min_p=0, temperature=1)) == (
            pytest.approx(P4, abs=1e-7)
        )


def test_top_p() -> None:
    s = fx.SamplerSettings(top_k=0, top_p=0.7, min_p=0, temperature=1)
    assert _dist4(s) == pytest.approx([0.625, 0.375, 0, 0], abs=1e-7)
    s = fx.SamplerSettings(top_k=0, top_p=0.85, min_p=0, temperature=1)
    assert _dist4(s) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], abs=1e-7)
    s = fx.SamplerSettings(top_k=0, top_p=0.4, min_p=0, temperature=1)
    assert _dist4(s) == pytest.approx([1, 0, 0, 0])
    # top-p after top-k works on the renormalised survivors: alone, p=.6 needs a and b
    # (.5 < .6); after top-k 2, a alone has .625 >= .6.
    s = fx.SamplerSettings(top_k=0, top_p=0.6, min_p=0, temperature=1)
    assert _dist4(s) == pytest.approx([0.625, 0.375, 0, 0], abs=1e-7)
    s = fx.SamplerSettings(top_k=2, top_p=0.6, min_p=0, temperature=1)
    assert _dist4(s) == [1.0, 0.0, 0.0, 0.0]
    # a cumulative sum landing on p within float32 rounding is refused, not guessed
    with pytest.raises(fx.AmbiguousSamplingError):
        _dist4(fx.SamplerSettings(top_k=0, top_p=0.8, min_p=0, temperature=1))


def test_min_p_is_relative_to_the_top_token() -> None:
    s = fx.SamplerSettings(top_k=0, top_p=1, min_p=0.2, temperature=1)  # threshold 0.1
    assert _dist4(s) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], abs=1e-7)
    s = fx.SamplerSettings(top_k=0, top_p=1, min_p=0.35, temperature=1)  # threshold 0.175
    assert _dist4(s) == pytest.approx([0.625, 0.375, 0, 0], abs=1e-7)
    with pytest.raises(fx.AmbiguousSamplingError):  # c sits exactly on 0.3 * 0.5
        _dist4(fx.SamplerSettings(top_k=0, top_p=1, min_p=0.3, temperature=1))


def test_temperature_and_greedy() -> None:
    s = fx.SamplerSettings(top_k=0, top_p=1, min_p=0, temperature=2.0)
    root = np.sqrt(P4)
    assert _dist4(s) == pytest.approx(list(root / root.sum()), abs=1e-7)
    s = fx.SamplerSettings(top_k=0, top_p=1, min_p=0, temperature=0.5)
    sq = np.square(P4)
    assert _dist4(s) == pytest.approx(list(sq / sq.sum()), abs=1e-7)
    for t in (0.0, -1.0):
        greedy = fx.SamplerSettings(top_k=40, top_p=1.0, min_p=0.05, temperature=t)
        assert _dist4(greedy) == [1.0, 0.0, 0.0, 0.0]


def test_top_p_and_min_p_see_untempered_probabilities() -> None:
    # Untempered top-p 0.7 keeps {a, b}; tempered (T=2) probabilities would have kept c too.
    s = fx.SamplerSettings(top_k=0, top_p=0.7, min_p=0, temperature=2.0)
    r = np.sqrt(P4[:2])
    assert _dist4(s) == pytest.approx([r[0] / r.sum(), r[1] / r.sum(), 0, 0], abs=1e-7)
    # Untempered min-p 0.35 drops c (0.15 < 0.175); at T=2 c's ratio would be sqrt(.3) > .35.
    s = fx.SamplerSettings(top_k=0, top_p=1, min_p=0.35, temperature=2.0)
    assert _dist4(s) == pytest.approx([r[0] / r.sum(), r[1] / r.sum(), 0, 0], abs=1e-7)


def test_llama_cpp_defaults() -> None:
    s = fx.SamplerSettings()
    assert (s.top_k, s.top_p, s.min_p, s.temperature) == (40, 0.95, 0.05, 0.8)
    assert s.request_fields() == {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "temperature": 0.8}
    # P4 under defaults: top-p .95 keeps a,b,c (cum .95 -> within rounding!) -> refused
    with pytest.raises(fx.AmbiguousSamplingError):
        _dist4(s)
    d = _dist4(s, [math.log(p) for p in (0.6, 0.3, 0.07, 0.03)])
    w = np.array([0.6, 0.3, 0.07]) ** (1 / 0.8)
    assert d == pytest.approx([*(w / w.sum()), 0], abs=1e-7)


def test_ties() -> None:
    tie = [1.0, 1.0, 0.0, -1.0]
    off = {"top_p": 1.0, "min_p": 0.0, "temperature": 1.0}
    with pytest.raises(fx.AmbiguousSamplingError):  # which of a/b survives is unspecified
        _dist4(fx.SamplerSettings(top_k=1, **off), tie)
    d = _dist4(fx.SamplerSettings(top_k=2, **off), tie)
    assert d == pytest.approx([0.5, 0.5, 0, 0])
    # greedy scanning the unsorted (id-ordered) array keeps the first maximum: a
    greedy = fx.SamplerSettings(top_k=0, top_p=1.0, min_p=0.0, temperature=0.0)
    assert _dist4(greedy, tie) == [1.0, 0.0, 0.0, 0.0]
    # after top-k sorted the candidates, the order of equal logits is unspecified
    with pytest.raises(fx.AmbiguousSamplingError):
        _dist4(fx.SamplerSettings(top_k=3, temperature=0.0), tie)
    # tied special tokens at the cut-off carry zero mass, so the cut is harmless
    spec = fx.default_spec()
    for k in (9, 10):
        assert fx.next_token_distribution(spec, "b", fx.SamplerSettings(top_k=k)) == (
            fx.next_token_distribution(spec, "b", fx.SamplerSettings(top_k=0))
        )


def test_sequence_and_conditional_distributions() -> None:
    spec = fx.default_spec()
    assert fx.sequence_distribution(spec, "bcdbc", 0, R) == {"": 1.0}
    one = fx.sequence_distribution(spec, "bcdbc", 1, R)
    assert one == pytest.approx(_nonzero(fx.next_token_distribution(spec, "bcdbc", R)))
    two = fx.sequence_distribution(spec, "bcdbc", 2, R)
    assert math.fsum(two.values()) == pytest.approx(1.0, abs=1e-12)
    assert two["fe"] == pytest.approx(0.8421164512966889 * 0.345, abs=1e-9)
    assert two["fg"] == pytest.approx(0.8421164512966889 * 0.452, abs=1e-9)
    four = fx.sequence_distribution(spec, "bcdbc", 4, R)
    assert all(len(k) == 4 for k in four) and len(four) <= 3**4
    assert math.fsum(four.values()) == pytest.approx(1.0, abs=1e-12)
    for seq, p in list(four.items())[:20]:
        q = 1.0
        for i, ch in enumerate(seq):
            q *= fx.conditional_distribution(spec, "bcdbc", seq[:i], R)[ch]
        assert p == pytest.approx(q, rel=1e-12)
    assert fx.conditional_distribution(spec, "bcdbc", "f", R) == fx.next_token_distribution(
        spec, "bcdbcf", R
    )
    # an absurd temperature makes special tokens reachable: refuse rather than mislead
    # (top-p and min-p see untempered logits, so with their defaults specials stay at 0)
    with pytest.raises(ValueError, match="special token"):
        hot = fx.SamplerSettings(top_k=0, top_p=1.0, min_p=0.0, temperature=1e4)
        fx.sequence_distribution(spec, "b", 1, hot)
    with pytest.raises(ValueError, match="prefix must hold at least one letter"):
        fx.raw_distribution(spec, "")


def test_spec_validation() -> None:
    base = fx.default_spec()
    with pytest.raises(ValueError, match="letters must be distinct"):
        fx.FixtureSpec("x", ("a", "a"), ((0, 1), (1, 0)), ((0, 1), (1, 0)), 0, 0.5, prompt="a")
    with pytest.raises(ValueError, match=r"target table must be 2x2"):
        fx.FixtureSpec("x", ("a", "b"), ((0, 1),), ((0, 1), (1, 0)), 0, 0.5, prompt="a")
    with pytest.raises(ValueError, match="prompt must be a non-empty string of fixture letters"):
        fx.FixtureSpec("x", ("a", "b"), ((0, 1), (1, 0)), ((0, 1), (1, 0)), 0, 0.5, prompt="ax")
    with pytest.raises(ValueError, match="special_logit must sit at least 1000 below"):
        fx.FixtureSpec(
            "x",
            ("a", "b"),
            ((0, 1), (1, 0)),
            ((0, 1), (1, 0)),
            0,
            0.5,
            prompt="a",
            special_logit=-5.0,
        )
    # values are canonicalised to float32
    s = fx.FixtureSpec("x", ("a", "b"), ((0.1, 1), (1, 0)), ((0, 1), (1, 0)), 0, 0.5, prompt="a")
    assert s.target[0][0] == float(np.float32(0.1))
    assert base == fx.default_spec()


# --------------------------------------------------------------------------------------
# load()
# --------------------------------------------------------------------------------------


def test_load_round_trip(built: fx.FixtureSet) -> None:
    loaded = fx.load(built.dir)
    assert loaded.spec == fx.default_spec()
    assert loaded.sha256 == built.sha256
    assert (loaded.target, loaded.draft, loaded.manifest) == (
        built.target,
        built.draft,
        built.manifest,
    )
    assert fx.next_token_distribution(loaded.spec, "bcdbcf", R) == fx.next_token_distribution(
        fx.default_spec(), "bcdbcf", R
    )


def test_load_detects_corrupted_byte(tmp_path: Path) -> None:
    fs = fx.build(tmp_path)
    data = bytearray(fs.draft.read_bytes())
    data[-5] ^= 0x01
    fs.draft.write_bytes(bytes(data))
    with pytest.raises(fx.FixtureError) as exc:
        fx.load(tmp_path)
    msg = str(exc.value)
    assert msg.startswith("draft.gguf: SHA-256 mismatch (expected " + DRAFT_SHA256)
    assert "\n" not in msg
    assert isinstance(exc.value, SpecauditError)
    assert fx.load(tmp_path, verify=False).spec == fx.default_spec()


def test_load_detects_missing_files(tmp_path: Path) -> None:
    fs = fx.build(tmp_path)
    fs.target.unlink()
    with pytest.raises(fx.FixtureError, match=r"^target\.gguf: missing"):
        fx.load(tmp_path)
    with pytest.raises(fx.FixtureError, match=r"^target\.gguf: missing"):
        fx.load(tmp_path, verify=False)
    fs.manifest.unlink()
    with pytest.raises(fx.FixtureError, match=r"^manifest\.json: missing"):
        fx.load(tmp_path)


def test_load_detects_truncation_and_bad_manifest(tmp_path: Path) -> None:
    fs = fx.build(tmp_path)
    fs.target.write_bytes(fs.target.read_bytes()[:-1])
    with pytest.raises(fx.FixtureError, match=r"^target\.gguf: size mismatch"):
        fx.load(tmp_path)
    fs.manifest.write_text("{not json")
    with pytest.raises(fx.FixtureError, match=r"^manifest\.json: unreadable"):
        fx.load(tmp_path)


def test_load_detects_definition_not_matching_files(tmp_path: Path) -> None:
    """Editing the definition (even with consistent hashes) cannot change the ground truth."""
    fs = fx.build(tmp_path)
    m = json.loads(fs.manifest.read_text())
    m["definition"]["target_logits"][5][4] = 0.5
    fs.manifest.write_text(json.dumps(m))
    with pytest.raises(fx.FixtureError, match=r"^target\.gguf: tensor output\.weight"):
        fx.load(tmp_path)
    m["format_version"] = 99
    fs.manifest.write_text(json.dumps(m))
    with pytest.raises(fx.FixtureError, match="format_version"):
        fx.load(tmp_path)


def test_cli_fixtures_build_writes_the_pinned_files(tmp_path: Path, cli: CliFn) -> None:
    code, out, err = cli("fixtures", "build", str(tmp_path / "fx"), "--json")
    assert code == 0, err
    assert json.loads(out)["sha256"] == {"target.gguf": TARGET_SHA256, "draft.gguf": DRAFT_SHA256}
    assert _sha(tmp_path / "fx" / fx.TARGET_FILE) == TARGET_SHA256
    assert _sha(tmp_path / "fx" / fx.DRAFT_FILE) == DRAFT_SHA256
    assert _sha(tmp_path / "fx" / fx.MANIFEST_FILE) == MANIFEST_SHA256
