"""The fixture as OpenVINO GenAI reads it (written without OpenVINO): F16 weights whose closed
form is recomputed, a gpt2 tokenizer with an empty merges list that gguf-py alone cannot
write, and a refusal for kinds OpenVINO's reader has no architecture for."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from specaudit import fixtures
from specaudit.fixtures import openvino as ov_fixtures


@pytest.mark.parametrize("kind", ["last-token", "context"])
def test_f16_spec_holds_exactly_what_the_f16_file_holds(kind: fixtures.FixtureKind) -> None:
    spec = fixtures.spec_for_kind(kind)
    s16 = ov_fixtures.f16_spec(spec)
    assert s16.name == spec.name + "-f16" and s16.kind == spec.kind
    t16 = np.asarray(s16.target)
    assert np.array_equal(t16.astype(np.float16).astype(np.float64), t16)
    assert not np.array_equal(t16, np.asarray(spec.target))  # the rounding is real
    # its closed form moves with it (what an OpenVINO engine is tested against)
    a = fixtures.raw_distribution(spec, spec.prompt + "f")
    b = fixtures.raw_distribution(s16, spec.prompt + "f")
    assert 0 < max(abs(a[t] - b[t]) for t in spec.letters) < 1e-2


def test_the_gguf_has_a_gpt2_tokenizer_with_empty_merges_and_f16_weights(tmp_path: Path) -> None:
    spec = ov_fixtures.f16_spec(fixtures.default_spec())
    path = tmp_path / "t.gguf"
    ov_fixtures.write_llama_f16_gpt2(path, spec, "target")
    r = gguf.GGUFReader(path)
    model, pre = r.get_field("tokenizer.ggml.model"), r.get_field("tokenizer.ggml.pre")
    merges = r.get_field("tokenizer.ggml.merges")
    assert model is not None and model.contents() == "gpt2"
    assert pre is not None and pre.contents() == "default"
    assert merges is not None and merges.types == [gguf.GGUFValueType.ARRAY]
    # an array of STRING with 0 items (the reader's last two parts: element type, count)
    assert int(merges.parts[-2][0]) == gguf.GGUFValueType.STRING and int(merges.parts[-1][0]) == 0
    assert merges.contents() == []
    tokens = r.get_field("tokenizer.ggml.tokens")
    assert tokens is not None and tuple(tokens.contents()) == spec.tokens
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["output.weight"] == gguf.GGMLQuantizationType.F16
    assert types["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    out = next(t for t in r.tensors if t.name == "output.weight")
    assert np.array_equal(np.asarray(out.data, dtype=np.float32), spec.output_matrix("target"))


def test_gguf_py_alone_refuses_the_empty_merges_list(tmp_path: Path) -> None:
    """Why the writer packs the empty array itself."""
    w = gguf.GGUFWriter(tmp_path / "x.gguf", "llama")
    w.add_key_value(
        "tokenizer.ggml.merges", [], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING
    )
    with pytest.raises(ValueError, match="Empty array"):
        w.write_header_to_file()
        w.write_kv_data_to_file()
    w.close()


def test_a_kind_openvino_cannot_read_is_refused() -> None:
    spec = fixtures.default_spec()
    other = replace(spec, name="x")
    object.__setattr__(other, "kind", "mtp")  # a kind with no one-layer llama form
    with pytest.raises(fixtures.FixtureError, match="OpenVINO's form exists for the"):
        ov_fixtures.f16_spec(other)
