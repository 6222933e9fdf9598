"""`fixtures.hf`: the fixtures as Hugging Face folders (what vLLM reads), proven before use.

Each export is loaded back here with plain transformers (`AutoModelForCausalLM`,
`AutoTokenizer` on the folder, no specaudit code in between) and held to the closed form, to
the GGUF's tokenizer and to the GGUF's own weights as transformers' GGUF loader reads them;
the refusals and the failed proof are shown to fire.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specaudit import fixtures
from specaudit.fixtures import hf, hf_heads

CliFn = Callable[..., tuple[int, str, str]]
T1 = fixtures.SamplerSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
# (kind, --head-size): own head sizes (8 and 64), the last-token widened to 32 (zeros), the
# context widened to 128 (its queries rescaled by sqrt(2))
CASES = [("last-token", None), ("last-token", 32), ("context", None), ("context", 128)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, fixtures.FixtureSet]:
    root = tmp_path_factory.mktemp("gguf")
    kinds: tuple[fixtures.FixtureKind, ...] = ("last-token", "context")
    return {k: fixtures.build(root / k, kind=k) for k in kinds}


@pytest.fixture(scope="module")
def exports(
    sources: dict[str, fixtures.FixtureSet], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, int | None], hf.HfExport]:
    root = tmp_path_factory.mktemp("hf")
    return {(k, n): hf.export_hf(sources[k], root / f"{k}-{n}", head_size=n) for k, n in CASES}


def _model(path: Path, gguf_file: str | None = None) -> Any:
    """transformers' model from a folder (or a GGUF in it), its progress bars silenced."""
    from transformers import AutoModelForCausalLM  # here: collecting the suite skips torch

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    with contextlib.redirect_stderr(io.StringIO()):
        return AutoModelForCausalLM.from_pretrained(path, **kw).eval()


MODELS: tuple[fixtures.Which, ...] = ("target", "draft")


@pytest.mark.parametrize(("kind", "head"), CASES)
def test_export_is_proven_against_the_gguf_and_the_closed_form(
    sources: dict[str, fixtures.FixtureSet],
    exports: dict[tuple[str, int | None], hf.HfExport],
    kind: str,
    head: int | None,
) -> None:
    ex = exports[(kind, head)]
    own = {"last-token": 8, "context": 64}[kind]
    assert (ex.head_size, ex.source_head_size) == (head or own, own)
    assert ex.exact == (kind == "last-token" or head is None)  # zeros only, or rescaled
    assert ex.prefixes == 1 + 8 + 64 + 512
    assert ex.max_abs_diff <= hf.TRUTH_TOLERANCE
    assert ex.logits_max_diff <= hf.WIDEN_TOLERANCE
    if ex.exact:
        assert ex.bitwise and ex.logits_max_diff == 0.0
    manifest = json.loads(ex.manifest.read_text())
    assert manifest["fixture"] == {"kind": kind, "name": ex.spec.name}
    assert manifest["source_sha256"] == sources[kind].sha256
    assert manifest["format"] == "hf" and manifest["head_size"] == ex.head_size


@pytest.mark.parametrize(("kind", "head"), CASES)
def test_plain_transformers_reads_the_closed_form(
    exports: dict[tuple[str, int | None], hf.HfExport], kind: str, head: int | None
) -> None:
    """The folder alone, through AutoModelForCausalLM: probabilities within 1e-5 of
    `next_token_distribution` at T = 1, target and draft, at the exported head size."""
    import torch

    ex = exports[(kind, head)]
    spec = ex.spec
    for which in MODELS:
        model = _model(ex.target if which == "target" else ex.draft)
        assert model.config.head_dim == ex.head_size
        for text in (spec.prompt, spec.prompt + "f", spec.prompt + "fe", "a", "hgfedcba"):
            with torch.no_grad():
                z = model(torch.tensor([spec.tokenize(text)])).logits[0, -1].double()
            got = torch.softmax(z, dim=-1).numpy()
            want = fixtures.next_token_distribution(spec, text, T1, which)
            assert np.abs(got - np.array(list(want.values()))).max() <= 1e-5, (which, text)


@pytest.mark.parametrize("kind", ["last-token", "context"])
def test_tokenizer_round_trips_the_letters_to_the_gguf_ids(
    sources: dict[str, fixtures.FixtureSet],
    exports: dict[tuple[str, int | None], hf.HfExport],
    kind: str,
) -> None:
    from transformers import AutoTokenizer

    fs = sources[kind]
    spec = fs.spec
    tok = AutoTokenizer.from_pretrained(exports[(kind, None)].target)
    with contextlib.redirect_stderr(io.StringIO()):
        gguf_tok = AutoTokenizer.from_pretrained(fs.dir, gguf_file=fs.target.name)
    text = "".join(spec.letters) + spec.prompt
    ids = tok(text).input_ids  # default add_special_tokens: the GGUF adds no BOS
    assert ids == spec.tokenize(text) == gguf_tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (
        spec.bos_id, spec.eos_id, spec.unk_id,
    )  # fmt: skip
    assert tok.convert_ids_to_tokens(list(range(spec.n_vocab))) == list(spec.tokens)
    assert tok.decode(ids + [spec.eos_id], skip_special_tokens=True) == text


@pytest.mark.parametrize("kind", ["last-token", "context"])
def test_weights_are_the_ggufs_as_transformers_reads_them(
    sources: dict[str, fixtures.FixtureSet], kind: str
) -> None:
    """At its own head size the export's tensors are exactly what transformers' GGUF loader
    makes of the fixture (names, the q/k permutation, values)."""
    fs = sources[kind]
    plan = hf.plan_head(fs.spec)
    for which in MODELS:
        path = fs.target if which == "target" else fs.draft
        model = _model(path.parent, path.name)
        theirs = {k: v.numpy() for k, v in model.state_dict().items()}
        ours = hf.state_dict(fs.spec, which, plan)
        assert sorted(ours) == sorted(theirs)
        for name, array in ours.items():
            assert np.array_equal(array, theirs[name]), (which, name)


def test_two_exports_are_byte_identical_and_the_cli_says_so(
    sources: dict[str, fixtures.FixtureSet],
    exports: dict[tuple[str, int | None], hf.HfExport],
    tmp_path: Path,
    cli: CliFn,
) -> None:
    first = exports[("last-token", 32)]
    code, out, err = cli(
        "fixtures", "export", str(tmp_path), "--format", "hf",
        "--fixture", str(sources["last-token"].dir), "--head-size", "32", "--json",
    )  # fmt: skip
    assert code == 0, err
    row = json.loads(out)
    assert row["kind"] == "last-token" and row["format"] == "hf"
    assert (row["head_size"], row["source_head_size"], row["prefixes"]) == (32, 8, 585)
    assert row["bitwise"] is True and row["logits_max_diff"] == 0.0
    assert row["max_abs_diff"] <= row["truth_tolerance"] == 1e-5
    assert Path(row["target"]) == tmp_path / "target"
    assert row["files"] == dict(first.files)
    # the CLI's fresh folder, not the shared export's, which later tests write heads into
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert [str(p) for p in written] == sorted(first.files)
    for rel in written:
        assert (tmp_path / rel).read_bytes() == (first.dir / rel).read_bytes(), rel
    assert sorted(p.name for p in first.target.iterdir()) == sorted(hf.MODEL_FILES)


def test_a_head_that_cannot_keep_the_context_attention_is_refused(
    sources: dict[str, fixtures.FixtureSet], tmp_path: Path, cli: CliFn
) -> None:
    with pytest.raises(fixtures.FixtureError) as e:
        hf.export_hf(sources["context"], tmp_path / "x", head_size=32)
    msg = str(e.value)
    assert "\n" not in msg and "head size 32 cannot keep" in msg and "multiple of 64" in msg
    assert not (tmp_path / "x").exists()
    code, out, err = cli("fixtures", "export", str(tmp_path / "c"), "--format", "hf",
                         "--kind", "context", "--head-size", "96")  # fmt: skip
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: head size 96 cannot keep"), err
    assert not (tmp_path / "c" / hf.FIXTURE_DIR).exists()  # refused before building


@pytest.mark.parametrize(
    ("kind", "head", "match"),
    [
        ("context", 3, "must be an even number"),
        ("mtp", None, "exists for the last-token and context kinds"),
        ("replay", None, "exists for the last-token and context kinds"),
    ],
)
def test_other_refusals(kind: str, head: int | None, match: str) -> None:
    with pytest.raises(fixtures.FixtureError, match=match):
        hf.plan_head(fixtures.spec_for_kind(kind), head)


def test_last_token_keeps_its_function_at_any_even_head() -> None:
    spec = fixtures.default_spec()
    for n in (2, 8, 10, 32, 512):
        assert hf.plan_head(spec, n) == hf.HeadPlan(n, 8, 0, 1.0, True)
    ctx = fixtures.context_spec()
    assert hf.plan_head(ctx, 256) == hf.HeadPlan(256, 64, 4, 2.0, False)


def test_a_proof_that_fails_is_an_error_and_leaves_no_manifest(
    sources: dict[str, fixtures.FixtureSet], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proof is not decorative: a weight off by 1e-3 in the written file is caught."""
    real = hf.state_dict

    def off(spec: fixtures.FixtureSpec, which: Any, plan: hf.HeadPlan) -> dict[str, Any]:
        params = real(spec, which, plan)
        params["lm_head.weight"] = params["lm_head.weight"] + np.float32(1e-3)
        return params

    monkeypatch.setattr(hf, "state_dict", off)
    with pytest.raises(fixtures.FixtureError, match="differ from the original's") as e:
        hf.export_hf(sources["last-token"], tmp_path, head_size=32)
    assert "\n" not in str(e.value)
    assert (tmp_path / "target" / "model.safetensors").is_file()
    assert not (tmp_path / hf.MANIFEST).exists()


def test_missing_extra_or_unwritable_directory_is_one_line(
    sources: dict[str, fixtures.FixtureSet], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(fixtures.FixtureError, match="cannot write the Hugging Face export"):
        hf.export_hf(sources["last-token"], tmp_path / "a-file")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    with pytest.raises(fixtures.FixtureError, match=r"pip install 'specaudit\[transformers\]'"):
        hf.export_fixture(tmp_path / "out", kind="context")
    assert not (tmp_path / "out").exists()  # refused before building or writing


def test_values_that_matter_need_their_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Zero queries and keys make RoPE moot, but values that are not zero must fit the head."""
    real = hf.tensors

    def with_values(spec: fixtures.FixtureSpec, which: fixtures.Which) -> list[Any]:
        out = dict(real(spec, which))
        out["blk.0.attn_v.weight"] = np.eye(16, dtype=np.float32)
        return list(out.items())

    monkeypatch.setattr(hf, "tensors", with_values)
    spec = fixtures.default_spec()
    assert hf.plan_head(spec, 32) == hf.HeadPlan(32, 8, 0, 1.0, True)
    with pytest.raises(fixtures.FixtureError, match="values fill 8 dimensions per head"):
        hf.plan_head(spec, 4)


def test_the_eagle_head_drafts_the_targets_favourite_after_the_token_it_is_fed(
    exports: dict[tuple[str, int | None], hf.HfExport],
) -> None:
    """vLLM's EAGLE-1 llama head (its layer names, no lm_head: it shares the target's): fc
    passes the fed token's embedding and drops the target's hidden state, its one layer is
    zeros, so its logits are the target's lm_head on embed_tokens[x], which must be the
    target's own logits after the prompt and x; specials are never fed and have zero rows."""
    from safetensors.numpy import load_file

    ex = exports[("last-token", 32)]
    folder = hf_heads.export_eagle_head(ex)
    params = load_file(str(folder / "model.safetensors"))
    spec = ex.spec
    assert "lm_head.weight" not in params and set(params) >= {"fc.weight", "embed_tokens.weight"}
    assert all(k.startswith(("fc.", "embed_tokens.", "layers.0.")) for k in params)
    h = spec.config.n_embd
    fc = params["fc.weight"]
    assert np.array_equal(fc[:, :h], np.eye(h)) and not fc[:, h:].any()
    layer = {k: v for k, v in params.items() if k.startswith("layers.0.") and "norm" not in k}
    assert layer and not any(v.any() for v in layer.values())
    target = _model(ex.target)
    lm_head = target.lm_head.weight.detach().numpy()
    for x, tok in enumerate(spec.tokens):
        row = params["embed_tokens.weight"][x]
        if tok not in spec.letters:
            assert not row.any()
            continue
        want = fixtures.raw_distribution(spec, spec.prompt + tok)
        z = lm_head @ row
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        assert np.abs(p - np.array(list(want.values()))).max() < 1e-5
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == h


def test_the_eagle3_head_drafts_the_targets_favourite_two_tokens_ahead(
    exports: dict[tuple[str, int | None], hf.HfExport],
) -> None:
    """vLLM's EAGLE3 llama head: two aux states (target layers 0 and 1), fc keeps the first
    (the embedding of the token at the position handed over), a zero ``midlayer``, its own
    norm and lm_head over the letters, ``d2t`` onto the target's ids. Its logits for the
    embedding of x are the log two-step distribution after x, here recomputed as the square
    of the last-token fixture's transition matrix (one row per letter); its argmax is what
    the float32 weights draft."""
    from safetensors.numpy import load_file

    ex = exports[("last-token", 32)]
    folder = hf_heads.export_eagle3_head(ex)
    params = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    spec = ex.spec
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    assert cfg["draft_vocab_size"] == len(spec.letters) < spec.n_vocab
    h = spec.config.n_embd
    fc = params["fc.weight"]
    assert fc.shape == (h, 2 * h) and np.array_equal(fc[:, :h], np.eye(h)) and not fc[:, h:].any()
    layer = {k: v for k, v in params.items() if k.startswith("midlayer.") and "norm" not in k}
    assert layer and not any(v.any() for v in layer.values())
    ids = [spec.tokens.index(x) for x in spec.letters]
    assert [k + int(d) for k, d in enumerate(params["d2t"])] == ids
    step = np.array([[fixtures.raw_distribution(spec, spec.prompt + x)[y] for y in spec.letters]
                     for x in spec.letters])  # fmt: skip
    two = step @ step  # the letters' own rows: specials are never reached on this fixture
    emb = _model(ex.target).model.embed_tokens.weight.detach().numpy()  # what vLLM hands fc
    for r, x in enumerate(spec.letters):
        e = emb[spec.tokens.index(x)].astype(np.float64)
        hidden = e / np.sqrt(np.mean(e * e) + spec.config.rms_eps) * params["norm.weight"]
        z = params["lm_head.weight"].astype(np.float64) @ hidden
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        assert np.abs(p - two[r]).max() < 1e-5
        assert spec.letters[int(np.argmax(z))] == spec.letters[int(np.argmax(two[r]))]
    want = {x: spec.letters[int(np.argmax(two[r]))] for r, x in enumerate(spec.letters)}
    assert (
        hf_heads.eagle3_drafts(spec, hf_heads.eagle3_head_params(spec, hf.plan_head(spec, 32)))
        == want
    )
    assert len(set(want.values())) > 1  # the draft depends on the token


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """Neox RoPE (halves rotated together) on [tokens, heads, head_dim]."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None, None] * freq
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate(
        [a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1
    )


def dflash_block_logits(
    p: dict[str, np.ndarray], cfg: dict[str, Any], aux: np.ndarray, block: list[int]
) -> np.ndarray:
    """vLLM 0.32.0's DFlash draft (model_executor/models/qwen3_dflash.py) in float64: the
    context's keys and values from ``hidden_norm(fc(aux))`` through layer 0's k/v projections
    (k-normed, RoPE'd at positions 0..n-1), the block's queries at n.. attending to the context
    and the whole block (non-causal), then o_proj, the MLP and the final norm; the logits of
    every block slot."""
    w = {k: v.astype(np.float64) for k, v in p.items()}
    eps, heads, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["head_dim"]
    theta = cfg["rope_theta"]
    L = "layers.0."
    ctx = _rms(aux @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = w["embed_tokens.weight"][block]
    h = _rms(x, w[L + "input_layernorm.weight"], eps)
    n, m = len(ctx), len(block)
    pos_c, pos_b = np.arange(n, dtype=np.float64), np.arange(n, n + m, dtype=np.float64)

    def proj(name: str, s: np.ndarray) -> np.ndarray:
        return (s @ w[L + f"self_attn.{name}_proj.weight"].T).reshape(len(s), heads, hd)

    q = _rope(_rms(proj("q", h), w[L + "self_attn.q_norm.weight"], eps), pos_b, theta)
    kn = w[L + "self_attn.k_norm.weight"]
    k = np.concatenate([
        _rope(_rms(proj("k", ctx), kn, eps), pos_c, theta),
        _rope(_rms(proj("k", h), kn, eps), pos_b, theta),
    ])  # fmt: skip
    v = np.concatenate([proj("v", ctx), proj("v", h)])
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    att = np.einsum("hqk,khd->qhd", a, v).reshape(m, heads * hd)
    r = x + att @ w[L + "self_attn.o_proj.weight"].T
    g = _rms(r, w[L + "post_attention_layernorm.weight"], eps)
    gate, up = g @ w[L + "mlp.gate_proj.weight"].T, g @ w[L + "mlp.up_proj.weight"].T
    r = r + (gate / (1 + np.exp(-gate)) * up) @ w[L + "mlp.down_proj.weight"].T
    return _rms(r, w["norm.weight"], eps) @ w["lm_head.weight"].T


@pytest.mark.parametrize(("kind", "head"), [("last-token", 32), ("context", None)])
def test_the_dflash_draft_drafts_the_targets_favourite_after_the_blocks_first_token(
    exports: dict[tuple[str, int | None], hf.HfExport], kind: str, head: int | None
) -> None:
    """vLLM's DFlash draft built on the exported target, run in float64 as vLLM computes it:
    whatever the target's features in the context and its length, every masked slot of a block
    [x, <unk>, <unk>, <unk>] gives the target's logits after the prompt and x (so drafts its
    favourite there, which on the last-token fixture is the closed form's after x); the mask
    is the fixture's ``<unk>``, the draft keeps its own embed_tokens and lm_head."""
    from safetensors.numpy import load_file

    ex = exports[(kind, head)]
    spec = ex.spec
    folder = hf_heads.export_dflash_head(ex)
    params = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["head_dim"] == ex.head_size
    assert cfg["dflash_config"]["mask_token_id"] == spec.token_ids["<unk>"]
    target = _model(ex.target)
    assert not np.array_equal(params["lm_head.weight"], target.lm_head.weight.detach().numpy())
    rng = np.random.default_rng(0)
    h = spec.config.n_embd
    logits = hf_heads.target_logits(ex).astype(np.float64)
    for tok in spec.letters:
        want = logits[spec.token_ids[tok]]
        truth = fixtures.raw_distribution(spec, spec.prompt + tok)
        best = max(spec.letters, key=lambda t: truth[t])
        for n in (1, 5, 12):
            aux = rng.normal(0.0, 3.0, (n, h))
            block = [spec.token_ids[tok]] + [spec.unk_id] * 3
            z = dflash_block_logits(params, cfg, aux, block)[1:]
            assert np.abs(z - want).max() < 1e-5, (tok, n)
            assert {spec.tokens[i] for i in z.argmax(axis=1)} == {best}, (tok, n)


def test_the_mtp_target_is_the_llama_and_its_mtp_layer_drafts_its_favourite_after_the_fed_token(
    exports: dict[tuple[str, int | None], hf.HfExport],
) -> None:
    """The MTP target (`export_mtp_target`): a MiMo checkpoint whose Qwen2 main model, loaded
    by plain transformers, gives the closed form's probabilities, at a hidden size whose
    ``hidden / heads`` is the export's head size (vLLM's Qwen2 ignores ``head_dim``); and an
    MTP layer which, computed here in float64 as vLLM's ``MiMoMultiTokenPredictorLayer`` does
    (token and hidden norms, input_proj on their concatenation, the decoder block, the final
    norm, the shared lm_head), gives for each letter the closed form after the prompt and that
    letter, whatever the target's hidden state."""
    import torch
    from safetensors.numpy import load_file

    ex = exports[("last-token", 32)]
    spec = ex.spec
    folder = hf_heads.export_mtp_target(ex)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == ex.head_size == cfg["head_dim"]
    model = _model(folder)
    for text in (spec.prompt, spec.prompt + "a", spec.prompt + "hb"):
        with torch.no_grad():
            z = model(torch.tensor([spec.tokenize(text)])).logits[0, -1].double().numpy()
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        assert (
            np.abs(p - np.array(list(fixtures.raw_distribution(spec, text).values()))).max() < 1e-5
        )
    params = {
        k: v.astype(np.float64) for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    pre = "model.mtp_layers.0."
    block = [k for k in params if k.startswith(pre) and ("_proj" in k and "input_proj" not in k)]
    assert len(block) == 10 and not any(params[k].any() for k in block)  # the residual passes
    eps, h = cfg["rms_norm_eps"], cfg["hidden_size"]
    rng = np.random.default_rng(0)
    for x, tok in enumerate(spec.tokens):
        if tok not in spec.letters:
            continue
        prev = rng.normal(size=h) * 100  # the target's hidden state: any
        t = _rms(
            params["model.embed_tokens.weight"][x], params[pre + "token_layernorm.weight"], eps
        )
        g = _rms(prev, params[pre + "hidden_layernorm.weight"], eps)
        u = params[pre + "input_proj.weight"] @ np.concatenate([g, t])
        y = _rms(u, params[pre + "final_layernorm.weight"], eps)  # + a zero block
        z = params["lm_head.weight"] @ y
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        want = fixtures.raw_distribution(spec, spec.prompt + tok)
        assert np.abs(p - np.array(list(want.values()))).max() < 1e-5, tok


def test_the_mtp_target_of_the_context_fixture_is_its_llama_too(
    exports: dict[tuple[str, int | None], hf.HfExport],
) -> None:
    """The context fixture (one head of 64, hidden 64: nothing to widen, its attention kept):
    the export proves the main model bitwise against the llama's and checks each letter's
    draft, or raises."""
    ex = exports[("context", None)]
    cfg = json.loads((hf_heads.export_mtp_target(ex) / "config.json").read_text())
    assert cfg["hidden_size"] == 64 == ex.head_size and cfg["rms_norm_eps"] == pytest.approx(1e-5)


def test_the_mtp_target_is_refused_where_no_widened_hidden_size_gives_the_head_size() -> None:
    spec = fixtures.default_spec()  # hidden 16, two heads: 16 * 4^k is never 2 * 64
    assert hf_heads.mtp_widening(spec, hf.plan_head(spec, 32)) == 4
    with pytest.raises(fixtures.FixtureError, match="no hidden size n_embd"):
        hf_heads.mtp_widening(spec, hf.plan_head(spec, 64))


def test_an_mtp_layer_that_drafts_after_another_token_is_refused_at_export(
    exports: dict[tuple[str, int | None], hf.HfExport], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export's per-letter check fires: an ``input_proj`` whose letter columns are rolled
    by one (fed 'a', it reproduces the hidden state after 'h') is not written."""
    real = hf_heads.mtp_layer_params

    def rolled(*args: Any) -> dict[str, np.ndarray]:
        out = real(*args)
        w = out["model.mtp_layers.0.input_proj.weight"]
        h = w.shape[0]
        w[:, h : h + 8] = np.roll(w[:, h : h + 8], 1, axis=1)
        return out

    monkeypatch.setattr(hf_heads, "mtp_layer_params", rolled)
    with pytest.raises(fixtures.FixtureError, match="MTP layer fed 'a' does not give"):
        hf_heads.export_mtp_target(exports[("last-token", 32)])


def test_export_with_heads_writes_what_each_vllm_method_loads(
    sources: dict[str, fixtures.FixtureSet], tmp_path: Path, cli: CliFn
) -> None:
    """``fixtures export --heads`` on the context fixture (its attention kept at head size 64):
    a folder per vLLM method that needs one, each a model vLLM can load (config, weights,
    tokenizer), the MTP one a MiMo target; the EAGLE-1 head's rows are checked on
    probabilities there (a separate lm_head call rounds differently with attention on)."""
    code, out, err = cli(
        "fixtures", "export", str(tmp_path), "--format", "hf", "--heads",
        "--fixture", str(sources["context"].dir), "--json",
    )  # fmt: skip
    assert code == 0, err
    heads = json.loads(out)["heads"]
    assert sorted(heads) == sorted(hf_heads.HEADS) == ["dflash", "eagle", "eagle3", "medusa", "mtp"]
    for method, folder in heads.items():
        assert Path(folder) == tmp_path / method
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
            p.name for p in Path(folder).iterdir()
        }, method
    mtp = json.loads((tmp_path / "mtp" / "config.json").read_text())
    assert mtp["architectures"] == [hf_heads.MTP_ARCHITECTURE]


def test_the_medusa_heads_draft_the_targets_favourites_two_three_and_four_tokens_ahead(
    exports: dict[tuple[str, int | None], hf.HfExport],
) -> None:
    """vLLM's Medusa model: one zero residual block (``x + SiLU(0) = x``) and one lm_head per
    head; head k on the target's hidden state after letter x gives the log distribution k + 2
    tokens after x, here recomputed as powers of the last-token fixture's transition matrix.
    Its config has no other key holding "num" and "heads" (vLLM's MedusaConfig would rename
    it to num_heads)."""
    from safetensors.numpy import load_file

    ex = exports[("last-token", 32)]
    folder = hf_heads.export_medusa_head(ex)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 3
    assert [k for k in cfg if "num" in k and "heads" in k] == ["num_heads"]
    params = load_file(str(folder / "model.safetensors"))
    spec = ex.spec
    assert not any(params[f"blocks.{k}.layers.0.weight"].any() for k in range(3))
    step = np.array([[fixtures.raw_distribution(spec, spec.prompt + x)[y] for y in spec.letters]
                     for x in spec.letters])  # fmt: skip
    hidden = _model(ex.target).model  # the state vLLM hands the heads: after the final norm
    ids = [spec.tokens.index(x) for x in spec.letters]
    import torch

    with torch.no_grad():
        states = [
            hidden(input_ids=torch.tensor([spec.tokenize(spec.prompt + x)]))
            .last_hidden_state[0, -1]
            .numpy()
            .astype(np.float64)
            for x in spec.letters
        ]
    power = step @ step
    for k in range(3):
        for r, v in enumerate(states):
            z = params[f"lm_heads.{k}.weight"].astype(np.float64) @ v
            p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            assert np.abs(p[ids] - power[r]).max() < 1e-5, (k, spec.letters[r])
        power = power @ step
