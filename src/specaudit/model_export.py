"""Gemma 3 270M as the engines without a GGUF loader read it (vLLM: a Hugging Face folder), and
the same numbers as a float32 GGUF a plain llama-server serves as their reference.

Why two files: vLLM 0.32 has no GGUF loader, so its Gemma is the Q4_K_M GGUF dequantised to
float32 (transformers' GGUF loader, which calls gguf-py's ``dequantize``). A llama-server
serving the quantised GGUF itself would not be the same model: its CPU kernels round the
activations to 8 bits for every quantised weight, which moves the next-token distribution by
far more than float32 summation order, and a re-scored run of thousands of tokens would see
it. The float32 GGUF holds the dequantised weights (gguf-py's ``dequantize`` on every tensor,
metadata copied): both sides then compute in float32 on the same numbers, and what is left is
summation order, which the reference's measured noise floor and the same-model probe
(`rescore`) cover.

Both are written once into the cache beside the GGUF, complete or not at all (a temporary
name renamed into place), and found again by a marker naming the source's SHA-256.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specaudit.errors import ModelError
from specaudit.models import Model, gemma_270m

MARKER = "export.json"
F32_SUFFIX = ".f32.gguf"
HF_SUFFIX = ".hf"
# the config keys transformers before 5 reads (Gemma 3: local RoPE base of its sliding
# layers); transformers 5 reads ``rope_parameters`` and ignores these
LEGACY_ROPE = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rope_scaling": None}


def _marker(src: Model, kind: str) -> dict[str, Any]:
    return {"source": src.path.name, "sha256": src.sha256, "kind": kind, "version": 1}


def _current(marker: Path, want: dict[str, Any]) -> bool:
    try:
        return bool(json.loads(marker.read_text()) == want)
    except (OSError, ValueError):
        return False


@contextmanager
def _staged(final: Path) -> Iterator[Path]:
    """A temporary directory beside `final`, moved into place when the body returns."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is not
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_f32_gguf(src: Path, out: Path) -> None:
    """`src` with every tensor dequantised to float32 (gguf-py), all its metadata copied and
    ``general.file_type`` set to 0 (all F32)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gemma_270m_f32() -> Path:
    """Gemma 3 270M dequantised to a float32 GGUF (the reference of a float32 engine), written
    once into the cache."""
    src = gemma_270m()
    out = src.path.with_name(src.path.name.removesuffix(".gguf") + F32_SUFFIX)
    marker = out.with_name(out.name + ".json")
    want = _marker(src, "f32-gguf")
    if out.is_file() and _current(marker, want):
        return out
    marker.unlink(missing_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    try:
        write_f32_gguf(src.path, tmp)
        os.replace(tmp, out)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot write the float32 GGUF of {src.path.name}: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    marker.write_text(json.dumps(want, sort_keys=True))
    return out


def hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """transformers' config of the GGUF model, written for any transformers that reads Gemma 3
    (the legacy RoPE keys beside ``rope_parameters``), float32, no quantisation."""
    out = {k: v for k, v in config.items() if k not in ("quantization_config", "_name_or_path")}
    out.update(LEGACY_ROPE)
    out.update(dtype="float32", torch_dtype="float32", architectures=["Gemma3ForCausalLM"])
    return out


def write_hf(src: Path, out: Path) -> None:
    """The GGUF as a Hugging Face folder: transformers' GGUF loader dequantises it (float32);
    ``save_pretrained`` refuses a model loaded from a GGUF, so the weights are written as
    safetensors here (tied embeddings once), the config by `hf_config`, the tokenizer by
    transformers."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config(model.config.to_dict())
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save_pretrained(out)


def gemma_270m_hf() -> Path:
    """Gemma 3 270M as a Hugging Face folder (float32, dequantised from the GGUF), written once
    into the cache."""
    src = gemma_270m()
    out = src.path.with_name(src.path.name.removesuffix(".gguf") + HF_SUFFIX)
    want = _marker(src, "hf")
    if _current(out / MARKER, want):
        return out
    try:
        with _staged(out) as tmp:
            write_hf(src.path, tmp)
            (tmp / MARKER).write_text(json.dumps(want, sort_keys=True))
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ModelError(f"cannot export {src.path.name} as a Hugging Face folder: {e}") from e
    return out


__all__ = ["gemma_270m_f32", "gemma_270m_hf", "hf_config", "write_f32_gguf", "write_hf"]
