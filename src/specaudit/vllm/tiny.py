"""A tiny Llama checkpoint (a Hugging Face folder) to start a vLLM server on, built offline.

Why build one: vLLM serves Hugging Face folders (config.json, safetensors, a tokenizer), not
GGUF, and the smoke test must not download a model. This is a smoke-test model only (random
weights, no known distribution): specaudit's fixtures with exact distributions are exported
elsewhere.

Shape: hidden size 64, 2 heads of 32 (vLLM's CPU attention takes head sizes 32-512), 2 layers,
a byte-level BPE vocabulary of the 256 bytes plus 3 specials (no merges: any text round-trips,
one token per byte). Weights are drawn from a seeded generator in parameter-name order, so the
folder is byte-identical on every run with the same torch and transformers. Needs the
``transformers`` extra (torch, transformers, tokenizers), imported only when building.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from specaudit.errors import ModelError
from specaudit.paths import cache_root, file_lock

NAME = "tiny-llama-v1"
SEED = 0
HIDDEN = 64
HEADS = 2  # head size HIDDEN // HEADS = 32
LAYERS = 2
INTERMEDIATE = 128
MAX_POSITIONS = 512
SPECIALS = ("<unk>", "<s>", "</s>")
WEIGHT_STD = 0.1  # peaky enough that the model is not uniform, small enough to stay finite
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def tiny_dir() -> Path:
    return cache_root() / "vllm" / "models" / NAME


def _tokenizer() -> object:
    """A byte-level BPE with no merges over the 256 bytes, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *byte_chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _save(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tokenizer()
    vocab_size = len(SPECIALS) + 256
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)  # float32: torch's default dtype
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:  # norms: ones, as trained models start
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * WEIGHT_STD)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]  # built by _tokenizer


def build_tiny(out: Path) -> Path:
    """Write the tiny model's folder to `out` (replaced whole); `ModelError` if transformers is
    missing."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ModelError(
            "the tiny vLLM model needs the transformers extra "
            "(pip install 'specaudit[transformers]')"
        ) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        _save(Path(tmp) / "m")
        if out.exists():
            shutil.rmtree(out)
        os.replace(Path(tmp) / "m", out)  # atomic: the folder is whole or absent
    return out


def ensure_tiny() -> Path:
    """The tiny model's folder in specaudit's cache, built on first use (seconds: most of it
    importing torch)."""
    out = tiny_dir()
    if all((out / f).is_file() for f in FILES):
        return out
    with file_lock(out.parent / f".{NAME}.lock"):
        if all((out / f).is_file() for f in FILES):
            return out
        return build_tiny(out)


__all__ = ["FILES", "NAME", "build_tiny", "ensure_tiny", "tiny_dir"]
