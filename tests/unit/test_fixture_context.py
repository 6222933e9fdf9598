"""Unit tests for the context-kind fixture (`fixtures.context_spec`): bytes, closed form, that
context really matters, and that the last-token fixture is untouched (no server)."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from specaudit import distribution
from specaudit import fixtures as fx
from specaudit.distribution.results import DistError
from specaudit.distribution.truth import Truth
from specaudit.fixtures.reference import network
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries

# Pinned digests of the context fixture. If these change, bump FORMAT_VERSION and say why.
CTX_TARGET_SHA256 = "408e1e564dccb2e9cd7d6be4e217d59149c00fa7a77024a46bd49c76b21c772c"
CTX_DRAFT_SHA256 = "ce921eed54b14d94114987d53a27d7d83047c612e065ffe971ee99cba5edf24b"
CTX_MANIFEST_SHA256 = "c7f7a484288554839bab6c05285d7275b1de39ad52768a03ac900147dc98213e"
# The last-token fixture's, as tests/unit/test_fixtures.py pins them: adding the context kind
# must not move a byte of it.
TARGET_SHA256 = "e08ad9e6d2f714840886a04cc356e5cb0b0158d1a7ea1c8c804e7381c94be62e"
DRAFT_SHA256 = "17307fc29782cea91e687eba69f59f61324ee6bf3bee6baf55caa3ce9484c61c"
MANIFEST_SHA256 = "8f837d3a2e8c0b9d88ad4c509610a9d93f7b805dcf2fe710cceabf4df30be235"

R = fx.REPORT_SAMPLER  # top-k 3, temperature 1, top-p/min-p off
SPEC = fx.context_spec()
PROMPT = SPEC.prompt


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tv(p: dict[str, float], q: dict[str, float]) -> float:
    return 0.5 * sum(abs(p[k] - q[k]) for k in p)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> fx.FixtureSet:
    return fx.build(tmp_path_factory.mktemp("ctx"), kind="context")


# --------------------------------------------------------------------------------------
# Bytes: the new fixture pinned, the old one unchanged
# --------------------------------------------------------------------------------------


def test_context_fixture_is_byte_identical_and_pinned(tmp_path: Path) -> None:
    a = fx.build(tmp_path / "a", kind="context")
    b = fx.build(tmp_path / "b", fx.context_spec())
    for name in (fx.TARGET_FILE, fx.DRAFT_FILE, fx.MANIFEST_FILE):
        assert (a.dir / name).read_bytes() == (b.dir / name).read_bytes(), name
    assert _sha(a.target) == CTX_TARGET_SHA256
    assert _sha(a.draft) == CTX_DRAFT_SHA256
    assert _sha(a.manifest) == CTX_MANIFEST_SHA256
    assert a.sha256 == {"target.gguf": CTX_TARGET_SHA256, "draft.gguf": CTX_DRAFT_SHA256}


def test_the_last_token_fixture_is_unchanged(tmp_path: Path) -> None:
    for fs in (
        fx.build(tmp_path / "plain"),
        fx.build(tmp_path / "kind", kind="last-token"),
        fx.build(tmp_path / "spec", fx.spec_for_kind("last-token")),
    ):
        assert _sha(fs.target) == TARGET_SHA256
        assert _sha(fs.draft) == DRAFT_SHA256
        assert _sha(fs.manifest) == MANIFEST_SHA256
        assert fs.spec == fx.default_spec() and fs.spec.kind == "last-token"
    m = json.loads((tmp_path / "plain" / fx.MANIFEST_FILE).read_text())
    assert "kind" not in m["definition"]  # the old manifest layout, byte for byte
    assert fx.load(tmp_path / "plain").spec.kind == "last-token"


def test_build_kind_and_spec_must_agree(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is of kind 'last-token', not 'context'"):
        fx.build(tmp_path, fx.default_spec(), kind="context")
    with pytest.raises(ValueError, match="unknown fixture kind"):
        fx.spec_for_kind("bigram")
    assert fx.spec_for_kind("context") == SPEC


def test_literal_tables_match_their_derivation() -> None:
    again = fx.make_context_spec(7, name=SPEC.name)
    assert again == SPEC
    assert SPEC.draft == fx.derive_draft(SPEC.target, 7, 0.5)
    assert SPEC.draft_context == fx.derive_draft(SPEC.target_context, 8, 0.5)
    assert SPEC.draft != SPEC.target and SPEC.draft_context != SPEC.target_context
    assert "RandomState(8)" in SPEC.draft_derivation
    for table in (SPEC.target, SPEC.draft, SPEC.target_context, SPEC.draft_context):
        assert all(len(set(row)) == len(row) for row in table)


def test_manifest_and_load_round_trip(built: fx.FixtureSet) -> None:
    m = json.loads(built.manifest.read_text())
    d = m["definition"]
    assert d["kind"] == "context"
    assert d["target_context_logits"] == [list(r) for r in SPEC.target_context]
    assert d["context_model"]["qk_weight"] == 16.0
    assert d["model"]["n_embd"] == 64 and d["model"]["n_head"] == 1
    loaded = fx.load(built.dir)
    assert loaded.spec == SPEC and loaded.sha256 == built.sha256
    # the definition is checked against the tensors: editing a context logit is caught
    m["definition"]["target_context_logits"][3][6] = 0.0
    built.manifest.write_text(json.dumps(m))
    try:
        with pytest.raises(fx.FixtureError, match=r"tensor output\.weight"):
            fx.load(built.dir)
    finally:
        fx.build(built.dir, kind="context")


def test_spec_validation() -> None:
    t = ((0.0, 1.0), (1.0, 0.0))
    with pytest.raises(ValueError, match="no context tables"):
        fx.FixtureSpec("x", ("a", "b"), t, t, 0, 0.5, prompt="a", target_context=t)
    t8 = SPEC.target  # 8 letters + 3 specials: 22 > the last-token kind's 16 dims
    with pytest.raises(ValueError, match=r"n_embd must be >= 2 x vocabulary"):
        fx.FixtureSpec("x", SPEC.letters, t8, t8, 0, 0.5, kind="context",
                       target_context=t8, draft_context=t8)  # fmt: skip
    with pytest.raises(ValueError, match="kind must be one of"):
        fx.FixtureSpec("x", ("a", "b"), t, t, 0, 0.5, prompt="a", kind="bigram")  # type: ignore[arg-type]  # an unknown kind on purpose
    with pytest.raises(ValueError, match="depend on the whole context"):
        SPEC.logits("a")


# --------------------------------------------------------------------------------------
# The GGUF and the forward pass
# --------------------------------------------------------------------------------------


def _field(reader: gguf.GGUFReader, key: str) -> object:
    f = reader.get_field(key)
    assert f is not None, key
    return f.contents()


def _float_field(reader: gguf.GGUFReader, key: str) -> float:
    value = _field(reader, key)
    assert isinstance(value, float), (key, value)
    return value


def test_gguf_carries_the_context_model(built: fx.FixtureSet) -> None:
    r = gguf.GGUFReader(built.target)
    assert _field(r, "llama.embedding_length") == 64
    assert _field(r, "llama.attention.head_count") == 1
    assert _field(r, "llama.rope.dimension_count") == 64
    base = _field(r, "llama.rope.freq_base")
    assert base == fx.CONTEXT_CONFIG.rope_freq_base
    assert float(np.float32(base) ** np.float32(-2 / 64)) == pytest.approx(math.pi, rel=1e-6)
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    assert np.array_equal(t["blk.0.attn_q.weight"], t["blk.0.attn_k.weight"])
    assert np.count_nonzero(t["blk.0.attn_q.weight"]) == 11  # row 2: every token -> 16 e_2
    assert np.all(t["blk.0.attn_q.weight"][2, :11] == 16.0)
    assert not np.any(t["blk.0.ffn_down.weight"])
    out = t["output.weight"]
    assert np.array_equal(out[:8, 11:19], np.asarray(SPEC.target_context, np.float32).T)


def _ggml_like_forward(
    tensors: dict[str, np.ndarray], eps: float, base: float, ids: list[int]
) -> np.ndarray:
    """An independent float32 forward pass the way ggml's CPU path with flash attention does it:
    float32 RoPE cache (theta *= theta_scale), K and Q rounded to f16, f16 V accumulation."""
    f32 = np.float32
    x = tensors["token_embd.weight"][ids].astype(f32)

    def rms(v: np.ndarray, w: np.ndarray) -> np.ndarray:
        mean = f32(np.sum(v.astype(np.float64) ** 2, axis=-1, keepdims=True) / v.shape[-1])
        return (v * (f32(1) / np.sqrt(mean + f32(eps)))).astype(f32) * w

    h = rms(x, tensors["blk.0.attn_norm.weight"])
    q, k = h @ tensors["blk.0.attn_q.weight"].T, h @ tensors["blk.0.attn_k.weight"].T
    v = (h @ tensors["blk.0.attn_v.weight"].T).astype(np.float16)
    n_dims = q.shape[1]
    scale = f32(base) ** f32(-2.0 / n_dims)
    cos = np.zeros((len(ids), n_dims // 2), f32)
    sin = np.zeros_like(cos)
    for p in range(len(ids)):
        theta = f32(p)
        for i in range(n_dims // 2):
            cos[p, i], sin[p, i] = np.cos(theta), np.sin(theta)
            theta = f32(theta * scale)

    def rope(a: np.ndarray) -> np.ndarray:
        a0, a1 = a[:, 0::2], a[:, 1::2]
        out = np.empty_like(a)
        out[:, 0::2], out[:, 1::2] = a0 * cos - a1 * sin, a0 * sin + a1 * cos
        return out

    qr, kr = rope(q).astype(np.float16), rope(k).astype(np.float16)
    s = (kr.astype(f32) @ qr[-1].astype(f32)) * f32(1 / math.sqrt(n_dims))
    w = np.exp(s - s.max()).astype(f32)
    acc = np.zeros(n_dims, np.float16)
    for j in range(len(ids)):  # f16 accumulator, as ggml_vec_mad_f16
        acc = (acc.astype(f32) + v[j].astype(f32) * w[j]).astype(np.float16)
    o = acc.astype(f32) / w.sum()
    xl = x[-1] + tensors["blk.0.attn_output.weight"] @ o
    return tensors["output.weight"] @ rms(xl, tensors["output_norm.weight"])


def test_an_independent_float32_forward_pass_agrees(built: fx.FixtureSet) -> None:
    r = gguf.GGUFReader(built.target)
    t = {x.name: np.asarray(x.data, dtype=np.float32) for x in r.tensors}
    eps = _float_field(r, "llama.attention.layer_norm_rms_epsilon")
    base = _float_field(r, "llama.rope.freq_base")
    for text in ("b", "bcdbc", "bcdbcfdg", "hhhhhhha", "abcdefgh" * 6 + "b"):
        ids = SPEC.tokenize(text)
        got = _ggml_like_forward(t, eps, base, ids)
        want = fx.reference_logits(SPEC, ids)
        assert np.max(np.abs(got[:8] - want[:8])) < 1e-5, text
        assert np.all(got[8:] < -5000) and np.all(want[8:] < -5000)


def _closed_form(text: str, which: fx.Which = "target") -> np.ndarray:
    """The module docstring's formula: the histogram of the last position's parity class."""
    n, p = len(SPEC.letters), len(text) - 1
    m = np.zeros(n)
    for j, ch in enumerate(text):
        if (p - j) % 2 == 0:
            m[SPEC.letters.index(ch)] += 1
    m /= m.sum()
    r = 1.0  # value_scale / embedding_value
    last = SPEC.letters.index(text[-1])
    L, H = np.array(SPEC.table(which)), np.array(SPEC.context_table(which))
    return (L[last] + r * m @ H) / math.sqrt(1 + r * r * m @ m)


def test_reference_forward_pass_is_the_parity_histogram_closed_form() -> None:
    rng = np.random.RandomState(0)
    for _ in range(200):
        text = "".join(rng.choice(list(SPEC.letters), size=rng.randint(1, 30)))
        which: fx.Which
        for which in ("target", "draft"):
            z = fx.context_logits(SPEC, text, which)
            assert np.max(np.abs(z[:8] - _closed_form(text, which))) < 1e-8, text


def test_every_attention_input_is_exact_in_f16() -> None:
    """Why llama.cpp's f16 KV cache and flash attention cannot move the probabilities: the
    rotated keys and queries are +-16 or 0 (to 1e-4 up to the context length), values 0/1."""
    net = network(SPEC, "target")
    for a in (net.k, net.q):
        nearest = np.round(a / 16.0) * 16.0
        assert np.max(np.abs(a - nearest)) < 1e-4
        assert set(np.unique(nearest)) <= {-16.0, 0.0, 16.0}
    # values: one-hots (1 - 3e-10 in float64: the RMSNorm epsilon; exactly 1 in float32)
    assert np.max(np.abs(net.v - np.round(net.v))) < 1e-9
    assert set(np.unique(np.round(net.v))) <= {0.0, 1.0}


def test_the_last_token_kind_reference_pass_agrees_with_its_table() -> None:
    spec = fx.default_spec()
    for text in ("b", "bcdbc", "bcdbcf"):
        z = fx.reference_logits(spec, spec.tokenize(text))
        assert np.max(np.abs(z - spec.logits(text[-1]))) < 1e-6
        assert np.array_equal(fx.context_logits(spec, text), spec.logits(text[-1]))


# --------------------------------------------------------------------------------------
# Context matters, and nothing is extreme
# --------------------------------------------------------------------------------------


def test_same_last_letter_different_history_changes_the_distribution() -> None:
    histories = ["bcdbc", "aaaa", "hgfe", "cbbcd", "ddddd", "eaeh", "gfgf", "abab", "bcdb"]
    for last in SPEC.letters:
        ds = [fx.next_token_distribution(SPEC, h + last, R) for h in histories]
        assert max(_tv(a, b) for a, b in itertools.combinations(ds, 2)) >= 0.2, last
    # the last-token fixture cannot tell them apart
    d0 = fx.default_spec()
    assert fx.next_token_distribution(d0, "aaaab", R) == fx.next_token_distribution(d0, "hhb", R)


def test_order_and_positions_matter_and_every_token_counts() -> None:
    same_multiset = ["aabbcc", "ababcc", "abcabc", "ccbbaa", "acbacb"]
    ds = [fx.next_token_distribution(SPEC, h + "a", R) for h in same_multiset]
    assert max(_tv(a, b) for a, b in itertools.combinations(ds, 2)) >= 0.2
    # a token an even distance back counts (a stale or missing KV entry there moves the
    # distribution); one an odd distance back is seen with weight e^-64, i.e. not at all, by
    # this position -- and fully by the next one
    base = fx.next_token_distribution(SPEC, "bcdbcf", R)
    assert _tv(base, fx.next_token_distribution(SPEC, "bcdhcf", R)) >= 0.1
    assert _tv(base, fx.next_token_distribution(SPEC, "bcdbhf", R)) < 1e-12
    assert _tv(fx.next_token_distribution(SPEC, "bcdbcfa", R),
               fx.next_token_distribution(SPEC, "bcdbhfa", R)) >= 0.1  # fmt: skip
    # a one-position shift (a wrong position in a verification batch) changes which tokens count
    assert _tv(base, fx.next_token_distribution(SPEC, "abcdbcf", R)) >= 0.1


def test_report_workload_is_not_extreme() -> None:
    seq = fx.sequence_distribution(SPEC, PROMPT, 4, R)
    assert math.fsum(seq.values()) == pytest.approx(1.0, abs=1e-12)
    prefixes = {s[:i] for s in seq for i in range(4)}
    for pre in prefixes:
        d = fx.next_token_distribution(SPEC, PROMPT + pre, R)
        assert min(p for p in d.values() if p > 0) >= 0.05, pre
        raw = fx.raw_distribution(SPEC, PROMPT + pre)
        assert min(raw[x] for x in SPEC.letters) >= 1e-3, pre
        assert max(raw[x] for x in SPEC.letters) <= 0.9, pre
    for t in range(4):
        marg: dict[str, float] = {}
        for s, p in seq.items():
            marg[s[t]] = marg.get(s[t], 0.0) + p
        assert min(marg.values()) >= 0.05 and max(marg.values()) <= 0.6, (t, marg)
        assert len(marg) >= 3


def test_sequence_distribution_is_the_product_of_conditionals() -> None:
    four = fx.sequence_distribution(SPEC, PROMPT, 4, R)
    for seq, p in list(four.items())[:30]:
        q = 1.0
        for i, ch in enumerate(seq):
            q *= fx.conditional_distribution(SPEC, PROMPT, seq[:i], R)[ch]
        assert p == pytest.approx(q, rel=1e-12)
    hot = fx.SamplerSettings(top_k=0, top_p=1.0, min_p=0.0, temperature=1e4)
    with pytest.raises(ValueError, match="special token"):
        fx.sequence_distribution(SPEC, "b", 1, hot)
    with pytest.raises(ValueError, match="at least one letter"):
        fx.raw_distribution(SPEC, "")


def test_draft_differs_from_the_target_so_drafts_get_rejected() -> None:
    """A greedy draft proposes its argmax; the target keeps it with the target's probability
    of that token: about half of the drafts are rejected in the report's workload."""
    seq = fx.sequence_distribution(SPEC, PROMPT, 4, R)
    prefixes = sorted({s[:i] for s in seq for i in range(4)})
    keep, tvs = [], []
    for pre in prefixes:
        t = fx.next_token_distribution(SPEC, PROMPT + pre, R)
        d = fx.next_token_distribution(SPEC, PROMPT + pre, R, which="draft")
        keep.append(t[max(d, key=d.__getitem__)])
        tvs.append(_tv(t, d))
    assert 0.3 <= float(np.mean(keep)) <= 0.7
    assert max(tvs) >= 0.2


# --------------------------------------------------------------------------------------
# dist's truth on both kinds
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [fx.default_spec(), SPEC], ids=["last-token", "context"])
def test_truth_marginals_agree_with_the_joint(spec: fx.FixtureSpec) -> None:
    wl = distribution.make_workload(spec, tokens=4, joint=3)
    truth = Truth(spec, wl)
    joint = fx.sequence_distribution(spec, spec.prompt, 4, R)
    for t in range(1, 5):
        want = np.zeros(len(spec.tokens))
        for s, p in joint.items():
            want[spec.tokens.index(s[t - 1])] += p
        assert np.max(np.abs(truth.marginal(t) - want)) < 1e-12, t


def test_truth_marginal_without_top_k_enumerates_prefixes() -> None:
    s = fx.SamplerSettings(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)
    wl = distribution.make_workload(SPEC, tokens=3, sampler=s, joint=0)
    m = Truth(SPEC, wl).marginal(3)
    assert m.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.count_nonzero(m[:8]) == 8


def test_analysis_of_exact_frequencies_is_not_broken() -> None:
    """Samples drawn from the closed form itself (the same context fixture) are PRESERVED."""
    wl = distribution.make_workload(SPEC)
    joint = fx.sequence_distribution(SPEC, PROMPT, wl.tokens, R)
    rng = np.random.RandomState(1)
    keys = sorted(joint)
    draws = rng.choice(len(keys), size=1500, p=np.array([joint[k] for k in keys]))
    samples = [distribution.Sample(i + 1, keys[j]) for i, j in enumerate(draws)]
    res = distribution.analyse(SPEC, wl, samples)
    assert res.verdict.name == "PRESERVED", res.reason
    # ... and the last-token fixture's truth rejects them: context is visible to the test
    other = distribution.analyse(
        fx.make_spec(7, name="x"), distribution.make_workload(fx.make_spec(7, name="x")), samples
    )
    assert other.verdict.name == "BROKEN"


def test_load_fixture_by_kind(tmp_path: Path) -> None:
    fs = distribution.load_fixture(None, tmp_path, kind="context")
    assert fs.spec == SPEC and fs.dir == tmp_path / "context"
    assert fs.sha256["target.gguf"] == CTX_TARGET_SHA256
    assert distribution.load_fixture(fs.dir, kind="context").spec == SPEC
    assert distribution.load_fixture(fs.dir).spec == SPEC  # a directory says its own kind
    assert distribution.load_fixture(None, tmp_path).spec == fx.default_spec()
    with pytest.raises(DistError, match="is of kind 'context', not 'last-token'"):
        distribution.load_fixture(fs.dir, kind="last-token")
    with pytest.raises(DistError, match="--fixture-kind must be one of last-token, context"):
        distribution.load_fixture(None, tmp_path, kind="bigram")
    req = distribution.make_request(
        ["url"], url="http://127.0.0.1:9", fixture=fs, fixture_kind="context"
    )
    f2, wl = req.fixture, req.workload
    assert f2 is fs and wl.prompt == "bcdbc"
    with pytest.raises(DistError, match="not 'last-token'"):
        distribution.make_request(
            ["url"], url="http://127.0.0.1:9", fixture=fs, fixture_kind="last-token"
        )


def test_context_presets_use_an_f32_kv_cache(tmp_path: Path) -> None:
    bins = LlamaBinaries(build=11434, variant="stock", bin_dir=tmp_path)
    for name in ("fixture-context-plain", "fixture-context-spec"):
        p = presets.PRESETS[name]
        a = presets.for_preset(p, bins, tmp_path / "t", tmp_path / "d").argv()
        assert a[a.index("-ctk") + 1] == "f32" and a[a.index("-ctv") + 1] == "f32"
        assert a[a.index("-t") + 1] == "1" and a[a.index("-np") + 1] == "4"
        assert ("-md" in a) is p.speculative
    a = presets.for_preset(presets.PRESETS["fixture-plain"], bins, tmp_path / "t", None).argv()
    assert "-ctk" not in a  # the last-token fixture's servers are as before
