"""Tiny deterministic GGUF fixture models with a closed-form next-token distribution.

Statistical checks of a speculating server need ground truth that does not come from the
server under test. A fixture here is a pair of llama-architecture GGUF files (target and
draft) whose logits depend only on the *last* token: token embeddings are one-hot, every
attention and FFN weight is zero so the residual stream is just the embedding, and the
``output`` matrix holds a logit table ``L[last, next]``. The exact distribution llama.cpp
samples from is therefore a function of that table and the sampler settings alone, and this
module computes it in float64 without llama.cpp.

Facts mirrored from llama.cpp b11434 (re-check them when moving to another build):

* default sampler order ``common/common.h:264-274``: penalties, dry, top_n_sigma, top_k,
  typical_p, top_p, min_p, xtc, temperature, then ``dist`` (``common/sampling.cpp:344-404``);
* defaults ``common/common.h:233-239``: top_k 40, top_p 0.95, min_p 0.05, temp 0.8; penalties,
  DRY, top-n-sigma, typical and XTC are disabled by default and are not modelled here;
* top_k <= 0 disables top-k (``src/llama-sampler.cpp:1519-1524``); top_p >= 1 and min_p <= 0
  are no-ops (``:1552``, ``:1752``); temperature == 1 is a no-op, temperature <= 0 keeps only
  the first maximal candidate (``:265-289``); top_p and min_p see untempered logits because
  temperature comes later in the chain;
* llama-server's pre-sampling ``n_probs`` are a softmax over the whole vocabulary
  (``tools/server/server-common.cpp:1591-1640``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from specaudit.errors import SpecauditError

__all__ = [
    "CHAT_TEMPLATE",
    "DRAFT_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "REPORT_SAMPLER",
    "SPECIAL_TOKENS",
    "TARGET_FILE",
    "AmbiguousSamplingError",
    "FixtureError",
    "FixtureSet",
    "FixtureSpec",
    "ModelConfig",
    "SamplerSettings",
    "build",
    "conditional_distribution",
    "default_spec",
    "derive_draft",
    "gguf_bytes",
    "load",
    "make_spec",
    "next_token_distribution",
    "other_spec",
    "raw_distribution",
    "sequence_distribution",
    "spec_from_definition",
]

FORMAT = "specaudit-fixture"
FORMAT_VERSION = 1
TARGET_FILE = "target.gguf"
DRAFT_FILE = "draft.gguf"
MANIFEST_FILE = "manifest.json"
MODEL_FILES = (TARGET_FILE, DRAFT_FILE)

#: Renders a chat as the bare concatenation of message contents, so a fixture can serve
#: ``/v1/chat/completions`` with user content written in its own letters.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"

#: Special tokens appended after the letters, in id order: BOS, EOS, UNK. They are never
#: letters: if the EOS id pointed at a letter, generation would stop on it and that letter would
#: never appear in a sample, silently removing a token from the distribution under test.
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")

# GGUF token types (llama.cpp LLAMA_TOKEN_TYPE_*).
_TOKEN_NORMAL = 1
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3

# Tolerances for float32 boundary decisions (llama.cpp compares in float32).
_MIN_P_TOL = 1e-5
_TOP_P_TOL = 1e-6

Which = Literal["target", "draft"]


class FixtureError(SpecauditError):
    """A fixture directory is missing, corrupt, or inconsistent with its manifest."""


class AmbiguousSamplingError(SpecauditError, ValueError):
    """llama.cpp's choice depends on unspecified tie-breaking or float32 rounding.

    Raised instead of guessing: ground truth must not depend on std::partial_sort's order.
    """


def _f32(value: float) -> float:
    """Round to the nearest float32, returned as an exact float64."""
    return float(np.float32(value))


# --------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the fixture network (llama architecture, one layer, all F32).

    ``embedding_value`` and ``output_norm_weight`` are chosen so llama.cpp's RMSNorm of a
    one-hot embedding is exactly 1.0 in float32: mean(x^2) = 1024^2/16 = 65536, adding
    eps=1e-5 is lost to float32 rounding, 1024/256 * 0.25 = 1. The logits are then
    exactly the float32 table values. :meth:`hidden_scale` recomputes this honestly.
    """

    context_length: int = 256
    n_embd: int = 16
    n_head: int = 2
    n_ff: int = 32
    rms_eps: float = 1e-5
    rope_freq_base: float = 10000.0
    embedding_value: float = 1024.0
    output_norm_weight: float = 0.25

    def __post_init__(self) -> None:
        if self.n_head <= 0 or self.n_embd % self.n_head:
            raise ValueError("n_embd must be a positive multiple of n_head")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("head dimension must be even for RoPE")
        if self.context_length <= 0 or self.n_ff <= 0:
            raise ValueError("context_length and n_ff must be positive")
        if self.embedding_value == 0 or self.output_norm_weight == 0:
            raise ValueError("embedding_value and output_norm_weight must be non-zero")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def hidden_scale(self) -> float:
        """Value of the normalised one-hot component fed to ``output``, as llama.cpp gets it.

        Mirrors ``ggml_compute_forward_rms_norm_f32`` (ggml/src/ggml-cpu/ops.cpp:4140-4161):
        double sum of float32 squares, float mean, ``1.0f/sqrtf(mean + eps)``, then
        ``x * scale * w`` in float32. The attention and FFN branches add exact zeros.
        """
        x = np.float32(self.embedding_value)
        total = float(np.float32(x * x))  # ggml_float sum of (x*x); other components are 0
        mean = np.float32(total / self.n_embd)
        scale = np.float32(1.0) / np.sqrt(np.float32(mean + np.float32(self.rms_eps)))
        y = np.float32(np.float32(x * scale) * np.float32(self.output_norm_weight))
        return float(y)

    def to_json(self) -> dict[str, Any]:
        return {
            "architecture": "llama",
            "context_length": self.context_length,
            "n_embd": self.n_embd,
            "n_head": self.n_head,
            "n_head_kv": self.n_head,
            "n_layer": 1,
            "n_ff": self.n_ff,
            "rope_dimension_count": self.head_dim,
            "rope_freq_base": self.rope_freq_base,
            "rms_eps": self.rms_eps,
            "embedding_value": self.embedding_value,
            "output_norm_weight": self.output_norm_weight,
            "tensor_type": "F32",
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelConfig:
        return cls(
            context_length=int(data["context_length"]),
            n_embd=int(data["n_embd"]),
            n_head=int(data["n_head"]),
            n_ff=int(data["n_ff"]),
            rms_eps=float(data["rms_eps"]),
            rope_freq_base=float(data["rope_freq_base"]),
            embedding_value=float(data["embedding_value"]),
            output_norm_weight=float(data["output_norm_weight"]),
        )


# --------------------------------------------------------------------------------------
# Fixture definition
# --------------------------------------------------------------------------------------


def _canonical_table(
    table: Sequence[Sequence[float]], n: int, label: str
) -> tuple[tuple[float, ...], ...]:
    rows = tuple(tuple(_f32(float(v)) for v in row) for row in table)
    if len(rows) != n or any(len(r) != n for r in rows):
        raise ValueError(f"{label} table must be {n}x{n} (rows = last letter)")
    if not all(math.isfinite(v) for r in rows for v in r):
        raise ValueError(f"{label} table holds a non-finite value")
    return rows


@dataclass(frozen=True)
class FixtureSpec:
    """Everything that defines a fixture; the GGUF bytes and the ground truth derive from it.

    ``target[i][j]`` / ``draft[i][j]`` is the logit of letter ``j`` after letter ``i``.
    Values are canonicalised to float32 (what the GGUF stores and llama.cpp computes
    with). ``draft_seed`` and ``draft_noise_scale`` record how the draft was derived from
    the target (see :func:`derive_draft`); the tables themselves are authoritative.
    """

    name: str
    letters: tuple[str, ...]
    target: tuple[tuple[float, ...], ...]
    draft: tuple[tuple[float, ...], ...]
    draft_seed: int
    draft_noise_scale: float
    prompt: str = "bcdbc"
    special_logit: float = -1e4
    config: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        letters = tuple(self.letters)
        n = len(letters)
        if n < 2:
            raise ValueError("a fixture needs at least two letters")
        if len(set(letters)) != n:
            raise ValueError("letters must be distinct")
        for letter in letters:
            if len(letter) != 1 or not (letter.isascii() and letter.isalnum()):
                raise ValueError(f"letter {letter!r} must be one ASCII letter or digit")
        object.__setattr__(self, "letters", letters)
        object.__setattr__(self, "target", _canonical_table(self.target, n, "target"))
        object.__setattr__(self, "draft", _canonical_table(self.draft, n, "draft"))
        object.__setattr__(self, "special_logit", _f32(self.special_logit))
        if not self.name or not self.name.isprintable():
            raise ValueError("name must be a non-empty printable string")
        if not self.prompt or any(ch not in letters for ch in self.prompt):
            raise ValueError("prompt must be a non-empty string of fixture letters")
        lowest = min(min(min(r) for r in self.target), min(min(r) for r in self.draft))
        if not self.special_logit <= lowest - 1000.0:
            raise ValueError("special_logit must sit at least 1000 below every table logit")
        if self.config.n_embd < self.n_vocab:
            raise ValueError("config.n_embd must be >= vocabulary size (one-hot embeddings)")

    # -- vocabulary --------------------------------------------------------------------
    @property
    def tokens(self) -> tuple[str, ...]:
        """Token texts in id order: the letters, then BOS, EOS, UNK."""
        return self.letters + SPECIAL_TOKENS

    @property
    def n_vocab(self) -> int:
        return len(self.letters) + len(SPECIAL_TOKENS)

    @property
    def bos_id(self) -> int:
        return len(self.letters)

    @property
    def eos_id(self) -> int:
        return len(self.letters) + 1

    @property
    def unk_id(self) -> int:
        return len(self.letters) + 2

    @property
    def token_ids(self) -> dict[str, int]:
        return {tok: i for i, tok in enumerate(self.tokens)}

    def tokenize(self, text: str) -> list[int]:
        """Token ids llama.cpp produces for ``text`` (one per letter; no BOS/EOS, no prefix)."""
        ids = []
        for ch in text:
            if ch not in self.letters:
                raise ValueError(f"{ch!r} is not a letter of fixture {self.name!r}")
            ids.append(self.letters.index(ch))
        return ids

    @property
    def draft_derivation(self) -> str:
        """Human-readable recipe for the draft table."""
        return (
            f"draft = float32(round(target + {self.draft_noise_scale} * "
            f"numpy.random.RandomState({self.draft_seed}).standard_normal((n, n)), 3))"
        )

    # -- logits --------------------------------------------------------------------------
    def table(self, which: Which = "target") -> tuple[tuple[float, ...], ...]:
        if which == "target":
            return self.target
        if which == "draft":
            return self.draft
        raise ValueError(f"which must be 'target' or 'draft', not {which!r}")

    def output_matrix(self, which: Which = "target") -> np.ndarray:
        """The GGUF ``output.weight`` as numpy (n_vocab, n_embd): column = last token."""
        n, v = len(self.letters), self.n_vocab
        out = np.zeros((v, self.config.n_embd), dtype=np.float32)
        out[:n, :n] = np.asarray(self.table(which), dtype=np.float32).T
        out[n:, :v] = np.float32(self.special_logit)
        # After a special token (never produced by a letter prompt): uniform over letters.
        out[:n, n:v] = np.float32(0.0)
        return out

    def logits(self, last_token: str, which: Which = "target") -> np.ndarray:
        """float32 logits (as float64) llama.cpp computes after ``last_token``, in id order."""
        ids = self.token_ids
        if last_token not in ids:
            raise ValueError(f"unknown token {last_token!r}")
        y = np.float32(self.config.hidden_scale())
        column = self.output_matrix(which)[:, ids[last_token]]
        return (column * y).astype(np.float32).astype(np.float64)


def derive_draft(
    target: Sequence[Sequence[float]], seed: int, noise_scale: float = 0.5
) -> tuple[tuple[float, ...], ...]:
    """Deterministic noisy copy of ``target``: the draft model of a fixture.

    Uses the legacy ``numpy.random.RandomState``, whose stream NumPy keeps stable across
    versions (NEP 19), and rounds to 3 decimals so the float32 bytes are reproducible.
    """
    t = np.asarray(target, dtype=np.float64)
    if t.ndim != 2 or t.shape[0] != t.shape[1]:
        raise ValueError("target must be a square table")
    noise = np.random.RandomState(seed).standard_normal(t.shape)
    d = np.round(t + noise_scale * noise, 3)
    return tuple(tuple(_f32(float(v)) for v in row) for row in d)


# Target table of the default fixture (rows: last letter a..h, columns: next letter a..h).
# Row f: its top three (e, g, h) renormalise to exactly 0.345 / 0.452 / 0.203 (to ~2e-10,
# the best float32 logits found by a search). Row c: f is first with 0.8421 under top-k 3.
_DEFAULT_TARGET: tuple[tuple[float, ...], ...] = (
    (-1.0, 1.25, 0.5, -0.5, 0.0, -1.5, 0.75, -2.0),
    (-0.75, -1.25, 2.0, 0.25, -0.5, 0.5, -2.0, 1.0),
    (-2.5, -1.0, -3.0, 0.25, 0.0, 2.5, -1.75, -0.5),
    (0.25, 1.5, -0.5, -2.25, 0.75, -1.0, 0.0, -1.5),
    (1.0, -0.5, 0.25, 0.5, -2.0, -1.25, 1.75, -0.75),
    (-1.5, -2.25, -1.25, -1.75, -0.27420583, -3.0, -0.0040680706, -0.80454427),
    (0.5, 0.0, -1.0, 1.25, -0.25, 0.75, -1.5, 2.0),
    (2.25, 0.75, 1.0, -1.0, 0.5, -0.5, 0.25, -2.5),
)
# Seed 2 is the smallest seed whose draft has distinct values in every row, keeps f first
# after c, and puts e (not g) first after f.
_DEFAULT_DRAFT_SEED = 2
_DEFAULT_NOISE = 0.5
# Literal copy of derive_draft(_DEFAULT_TARGET, _DEFAULT_DRAFT_SEED, _DEFAULT_NOISE), so the
# bytes never depend on NumPy's generator; a unit test checks the two agree.
_DEFAULT_DRAFT: tuple[tuple[float, ...], ...] = (
    (-1.208, 1.222, -0.568, 0.32, -0.897, -1.921, 1.001, -2.623),
    (-1.279, -1.705, 2.276, 1.396, -0.479, -0.059, -1.73, 0.702),
    (-2.51, -0.412, -3.374, 0.255, -0.439, 2.422, -1.622, -0.994),
    (0.081, 1.382, -0.819, -2.844, 0.039, -1.077, -0.135, -0.384),
    (-0.217, -0.444, 0.435, 1.18, -1.749, -1.672, 1.75, -0.479),
    (-1.657, -1.864, -2.184, -0.884, 0.46, -3.168, 0.302, -0.781),
    (0.085, 0.044, -0.5, 1.059, -0.438, 0.713, -1.283, 2.639),
    (1.933, 1.004, 1.108, -1.929, 0.29, -0.566, 0.23, -2.337),
)


def default_spec() -> FixtureSpec:
    """The fixture of the field report (https://github.com/ggml-org/llama.cpp/issues/29975):
    eight letters a..h, prompt ``bcdbc``.

    After ``bcdbc`` the target picks ``f`` with probability 0.8421 (top-k 3, T=1); after
    ``f`` its top-3 distribution is e 0.345, g 0.452, h 0.203, while the draft's top
    candidate after ``f`` is ``e`` -- the token the broken example program always emits.
    """
    return FixtureSpec(
        name="specaudit-abcdefgh",
        letters=tuple("abcdefgh"),
        target=_DEFAULT_TARGET,
        draft=_DEFAULT_DRAFT,
        draft_seed=_DEFAULT_DRAFT_SEED,
        draft_noise_scale=_DEFAULT_NOISE,
    )


def make_spec(
    seed: int,
    *,
    name: str | None = None,
    letters: Sequence[str] = tuple("abcdefgh"),
    prompt: str = "bcdbc",
    logit_scale: float = 1.25,
    noise_scale: float = 0.5,
) -> FixtureSpec:
    """A fixture with pseudo-random numbers derived from ``seed`` (stable across NumPy).

    Target rows come from ``RandomState([seed, 1])`` (normal with ``logit_scale``, rounded
    to 3 decimals, a row is redrawn until its values are distinct); the draft is
    ``derive_draft(target, seed, noise_scale)``.
    """
    n = len(letters)
    rng = np.random.RandomState([seed, 1])
    rows: list[tuple[float, ...]] = []
    while len(rows) < n:
        row = tuple(_f32(float(v)) for v in np.round(logit_scale * rng.standard_normal(n), 3))
        if len(set(row)) == n:
            rows.append(row)
    target = tuple(rows)
    return FixtureSpec(
        name=name or f"specaudit-seed{seed}",
        letters=tuple(letters),
        target=target,
        draft=derive_draft(target, seed, noise_scale),
        draft_seed=seed,
        draft_noise_scale=noise_scale,
        prompt=prompt,
    )


def other_spec() -> FixtureSpec:
    """A second eight-letter fixture with other numbers (``make_spec(2)``)."""
    return make_spec(2, name="specaudit-abcdefgh-b")


# --------------------------------------------------------------------------------------
# GGUF writing
# --------------------------------------------------------------------------------------


def _tensors(spec: FixtureSpec, which: Which) -> list[tuple[str, np.ndarray]]:
    """Tensors in file order (numpy shapes are ggml's ``ne`` reversed)."""
    cfg, v, d = spec.config, spec.n_vocab, spec.config.n_embd
    embd = np.zeros((v, d), dtype=np.float32)
    embd[np.arange(v), np.arange(v)] = np.float32(cfg.embedding_value)
    ones = np.ones(d, dtype=np.float32)
    zeros_dd = np.zeros((d, d), dtype=np.float32)
    return [
        ("token_embd.weight", embd),
        ("output_norm.weight", np.full(d, cfg.output_norm_weight, dtype=np.float32)),
        ("output.weight", spec.output_matrix(which)),
        ("blk.0.attn_norm.weight", ones),
        ("blk.0.attn_q.weight", zeros_dd),
        ("blk.0.attn_k.weight", zeros_dd.copy()),
        ("blk.0.attn_v.weight", zeros_dd.copy()),
        ("blk.0.attn_output.weight", zeros_dd.copy()),
        ("blk.0.ffn_norm.weight", ones.copy()),
        ("blk.0.ffn_gate.weight", np.zeros((cfg.n_ff, d), dtype=np.float32)),
        ("blk.0.ffn_up.weight", np.zeros((cfg.n_ff, d), dtype=np.float32)),
        ("blk.0.ffn_down.weight", np.zeros((d, cfg.n_ff), dtype=np.float32)),
    ]


def _write_gguf(path: Path, spec: FixtureSpec, which: Which) -> None:
    import gguf  # local import: only building needs it

    cfg = spec.config
    n = len(spec.letters)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"{spec.name}-{which}")
    w.add_description(
        f"specaudit fixture ({which}): logits depend only on the last token; "
        "see the manifest for the closed-form definition"
    )
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_vocab_size(spec.n_vocab)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(1)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_freq_base)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_tokenizer_model("llama")
    w.add_token_list(list(spec.tokens))
    w.add_token_scores([0.0] * spec.n_vocab)
    w.add_token_types([_TOKEN_NORMAL] * n + [_TOKEN_CONTROL, _TOKEN_CONTROL, _TOKEN_UNKNOWN])
    w.add_bos_token_id(spec.bos_id)
    w.add_eos_token_id(spec.eos_id)
    w.add_unk_token_id(spec.unk_id)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for tname, array in _tensors(spec, which):
        w.add_tensor(tname, array)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()


def gguf_bytes(spec: FixtureSpec, which: Which = "target") -> bytes:
    """The exact bytes of one fixture model (written via a temporary file)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="specaudit-fixture-") as tmp:
        path = Path(tmp) / f"{which}.gguf"
        _write_gguf(path, spec, which)
        return path.read_bytes()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# --------------------------------------------------------------------------------------
# Manifest, build, load
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixtureSet:
    """A fixture on disk: paths, its definition and the files' SHA-256 digests."""

    dir: Path
    target: Path
    draft: Path
    manifest: Path
    spec: FixtureSpec
    sha256: dict[str, str]

    def path(self, which: Which) -> Path:
        return self.target if which == "target" else self.draft


def _definition(spec: FixtureSpec) -> dict[str, Any]:
    kinds = ["normal"] * len(spec.letters) + ["control", "control", "unknown"]
    return {
        "letters": list(spec.letters),
        "tokens": [
            {"id": i, "text": t, "type": k}
            for i, (t, k) in enumerate(zip(spec.tokens, kinds, strict=True))
        ],
        "bos_id": spec.bos_id,
        "eos_id": spec.eos_id,
        "unk_id": spec.unk_id,
        "prompt": spec.prompt,
        "prompt_token_ids": spec.tokenize(spec.prompt),
        "logits_semantics": "row = last letter, column = next letter; float32 values",
        "target_logits": [list(r) for r in spec.target],
        "draft_logits": [list(r) for r in spec.draft],
        "special_logit": spec.special_logit,
        "draft_derivation": {
            "seed": spec.draft_seed,
            "noise_scale": spec.draft_noise_scale,
            "recipe": spec.draft_derivation,
        },
        "model": spec.config.to_json(),
        "chat_template": CHAT_TEMPLATE,
    }


def _manifest(spec: FixtureSpec, files: Mapping[str, bytes]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": spec.name,
        "files": {
            fname: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            for fname, data in files.items()
        },
        "definition": _definition(spec),
    }


def _manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, ensure_ascii=True, allow_nan=False) + "\n").encode()


def build(out_dir: str | os.PathLike[str], spec: FixtureSpec | None = None) -> FixtureSet:
    """Write ``target.gguf``, ``draft.gguf`` and ``manifest.json`` into ``out_dir``.

    Output is byte-identical across runs and machines: no timestamps, fixed key and
    tensor order, little-endian F32. Files are replaced atomically.
    """
    spec = spec or default_spec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {TARGET_FILE: gguf_bytes(spec, "target"), DRAFT_FILE: gguf_bytes(spec, "draft")}
    for fname, data in files.items():
        _atomic_write(out / fname, data)
    manifest = _manifest(spec, files)
    _atomic_write(out / MANIFEST_FILE, _manifest_bytes(manifest))
    return FixtureSet(
        dir=out,
        target=out / TARGET_FILE,
        draft=out / DRAFT_FILE,
        manifest=out / MANIFEST_FILE,
        spec=spec,
        sha256={f: manifest["files"][f]["sha256"] for f in MODEL_FILES},
    )


def spec_from_definition(name: str, definition: Mapping[str, Any]) -> FixtureSpec:
    """Rebuild a :class:`FixtureSpec` from a manifest's ``definition`` block."""
    deriv = definition["draft_derivation"]
    spec = FixtureSpec(
        name=name,
        letters=tuple(definition["letters"]),
        target=definition["target_logits"],
        draft=definition["draft_logits"],
        draft_seed=int(deriv["seed"]),
        draft_noise_scale=float(deriv["noise_scale"]),
        prompt=definition["prompt"],
        special_logit=float(definition["special_logit"]),
        config=ModelConfig.from_json(definition["model"]),
    )
    if _definition(spec) != dict(definition):
        raise ValueError("definition is not in canonical form")
    return spec


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 16), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_gguf(path: Path, spec: FixtureSpec, which: Which) -> None:
    """Cross-check a model file against the definition (independent of writer version)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure means a corrupt file
        raise FixtureError(f"{path.name}: not a readable GGUF file ({exc})") from exc
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    for tname, expected in _tensors(spec, which):
        got = tensors.get(tname)
        if got is None or got.shape != expected.shape or not np.array_equal(got, expected):
            raise FixtureError(f"{path.name}: tensor {tname} does not match the manifest")
    tok_field = reader.get_field("tokenizer.ggml.tokens")
    tokens = tuple(tok_field.contents()) if tok_field is not None else ()
    if tokens != spec.tokens:
        raise FixtureError(f"{path.name}: vocabulary does not match the manifest")


def load(dir: str | os.PathLike[str], verify: bool = True) -> FixtureSet:
    """Open a fixture directory written by :func:`build`.

    With ``verify`` the SHA-256 and size of each model file are recomputed and the GGUF
    tensors are checked against the manifest's definition. Ground truth always comes
    from the definition, never from llama.cpp. Raises :class:`FixtureError`.
    """
    root = Path(dir)
    mpath = root / MANIFEST_FILE
    if not mpath.is_file():
        raise FixtureError(f"{MANIFEST_FILE}: missing in {root}")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FixtureError(f"{MANIFEST_FILE}: unreadable ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FixtureError(f"{MANIFEST_FILE}: not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise FixtureError(
            f"{MANIFEST_FILE}: unsupported format_version {manifest.get('format_version')!r} "
            f"(this specaudit reads {FORMAT_VERSION})"
        )
    try:
        spec = spec_from_definition(str(manifest["name"]), manifest["definition"])
        files = {f: manifest["files"][f] for f in MODEL_FILES}
        sha = {f: str(files[f]["sha256"]) for f in MODEL_FILES}
        sizes = {f: int(files[f]["size"]) for f in MODEL_FILES}
    except (KeyError, TypeError, ValueError) as exc:
        raise FixtureError(f"{MANIFEST_FILE}: invalid definition ({exc})") from exc
    for fname in MODEL_FILES:
        path = root / fname
        if not path.is_file():
            raise FixtureError(f"{fname}: missing in {root}")
        if not verify:
            continue
        size = path.stat().st_size
        if size != sizes[fname]:
            raise FixtureError(
                f"{fname}: size mismatch (expected {sizes[fname]} bytes, got {size})"
            )
        got = _sha256_file(path)
        if got != sha[fname]:
            raise FixtureError(f"{fname}: SHA-256 mismatch (expected {sha[fname]}, got {got})")
        _check_gguf(path, spec, "target" if fname == TARGET_FILE else "draft")
    return FixtureSet(
        dir=root,
        target=root / TARGET_FILE,
        draft=root / DRAFT_FILE,
        manifest=mpath,
        spec=spec,
        sha256=sha,
    )


# --------------------------------------------------------------------------------------
# Closed-form distributions
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplerSettings:
    """The sampler knobs the closed form models, with llama.cpp's defaults.

    Defaults are ``common_params_sampling`` (common/common.h:233-239), which llama-server
    uses unless the GGUF carries ``general.sampling.*`` keys (fixtures do not). Penalties,
    DRY, typical-p, XTC, top-n-sigma, dynatemp and mirostat must stay at their (disabled)
    defaults for the closed form to hold.
    """

    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    temperature: float = 0.8

    def request_fields(self) -> dict[str, int | float]:
        """The llama-server ``/completion`` request fields that set these knobs."""
        return {
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "temperature": self.temperature,
        }


#: The field report's settings: top-k 3, temperature 1, top-p and min-p off.
REPORT_SAMPLER = SamplerSettings(top_k=3, top_p=1.0, min_p=0.0, temperature=1.0)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - np.max(z))
    return e / e.sum()


def _chain(z: np.ndarray, s: SamplerSettings, ties: Literal["low", "high"]) -> np.ndarray:
    """One resolution of llama.cpp's chain; ``ties`` orders equal logits by id up or down."""
    cand = list(range(len(z)))
    is_sorted = False

    def order(ids: list[int]) -> list[int]:
        sign = 1 if ties == "low" else -1
        return sorted(ids, key=lambda t: (-z[t], sign * t))

    # top-k (llama_sampler_top_k_impl): k <= 0 is a no-op; otherwise sort and truncate.
    if s.top_k > 0:
        cand = order(cand)[: min(s.top_k, len(cand))]
        is_sorted = True
    # top-p (llama_sampler_top_p_apply): softmax of the untempered survivors, sorted,
    # keep the shortest prefix whose cumulative probability reaches p.
    if s.top_p < 1.0:
        if not is_sorted:
            cand = order(cand)
            is_sorted = True
        probs = _softmax(z[cand])
        cum = 0.0
        keep = len(cand)
        for i, p in enumerate(probs):
            cum += float(p)
            if abs(cum - s.top_p) <= _TOP_P_TOL:
                raise AmbiguousSamplingError(
                    f"top_p={s.top_p} lands within float32 rounding of a cumulative sum"
                )
            if cum >= s.top_p:
                keep = i + 1
                break
        cand = cand[:keep]
    # min-p (llama_sampler_min_p_apply): keep logit >= max + log(p); order preserved.
    if s.min_p > 0.0:
        threshold = max(z[cand]) + math.log(s.min_p)
        if any(abs(z[t] - threshold) <= _MIN_P_TOL * max(1.0, abs(threshold)) for t in cand):
            raise AmbiguousSamplingError(
                f"min_p={s.min_p} puts a token within float32 rounding of its threshold"
            )
        cand = [t for t in cand if z[t] >= threshold]
    out = np.zeros(len(z))
    # temperature (llama_sampler_temp_impl): <= 0 keeps the first maximal candidate in
    # the current order; 1 is a no-op; otherwise divide logits.
    if s.temperature <= 0.0:
        best = cand[0]
        for t in cand[1:]:
            if z[t] > z[best]:
                best = t
        out[best] = 1.0
        return out
    zz = z[cand] / s.temperature if s.temperature != 1.0 else z[cand]
    out[cand] = _softmax(zz)
    return out


def _sampling_probs(z: np.ndarray, s: SamplerSettings) -> np.ndarray:
    low = _chain(z, s, "low")
    high = _chain(z, s, "high")
    if not np.array_equal(low, high):
        raise AmbiguousSamplingError(
            "tied logits straddle a sampler cut-off; llama.cpp's choice is unspecified"
        )
    return low


def _last_token(spec: FixtureSpec, prefix: str) -> str:
    if not prefix:
        raise ValueError("prefix must hold at least one letter (fixtures add no BOS)")
    spec.tokenize(prefix)  # validates letters
    return prefix[-1]


def raw_distribution(spec: FixtureSpec, prefix: str, which: Which = "target") -> dict[str, float]:
    """Softmax of the full logits (all tokens, specials included) after ``prefix``.

    This is what llama-server reports as pre-sampling ``n_probs`` probabilities.
    """
    z = spec.logits(_last_token(spec, prefix), which)
    return dict(zip(spec.tokens, (float(p) for p in _softmax(z)), strict=True))


def next_token_distribution(
    spec: FixtureSpec, prefix: str, sampler: SamplerSettings, which: Which = "target"
) -> dict[str, float]:
    """Exact distribution of the token sampled after ``prefix`` under ``sampler``.

    Keys are all tokens in id order (zero for tokens the chain removes). Raises
    :class:`AmbiguousSamplingError` when llama.cpp's outcome depends on tie order or on
    float32 rounding at a top-p/min-p boundary.
    """
    z = spec.logits(_last_token(spec, prefix), which)
    probs = _sampling_probs(z, sampler)
    return dict(zip(spec.tokens, (float(p) for p in probs), strict=True))


def conditional_distribution(
    spec: FixtureSpec,
    prompt: str,
    generated_prefix: str,
    sampler: SamplerSettings,
    which: Which = "target",
) -> dict[str, float]:
    """Distribution of the next generated token given the prompt and what came so far."""
    return next_token_distribution(spec, prompt + generated_prefix, sampler, which)


def sequence_distribution(
    spec: FixtureSpec,
    prompt: str,
    n_tokens: int,
    sampler: SamplerSettings,
    which: Which = "target",
) -> dict[str, float]:
    """Exact joint distribution of the next ``n_tokens`` generated letters.

    Keys are letter strings of length ``n_tokens`` with non-zero probability. Raises
    ``ValueError`` if a special token (which would stop or corrupt generation) could be
    sampled on the way.
    """
    if n_tokens < 0:
        raise ValueError("n_tokens must be >= 0")
    _last_token(spec, prompt)
    n = len(spec.letters)
    cache: dict[str, np.ndarray] = {}

    def step(last: str) -> np.ndarray:
        if last not in cache:
            probs = _sampling_probs(spec.logits(last, which), sampler)
            if np.any(probs[n:] > 0.0):
                raise ValueError(
                    f"a special token has non-zero probability after {last!r}; "
                    "the letter sequence distribution is undefined"
                )
            cache[last] = probs[:n]
        return cache[last]

    dist: dict[str, float] = {"": 1.0}
    for _ in range(n_tokens):
        nxt: dict[str, float] = {}
        for seq, p in dist.items():
            probs = step(seq[-1] if seq else prompt[-1])
            for j, q in enumerate(probs):
                if q > 0.0:
                    nxt[seq + spec.letters[j]] = p * float(q)
        dist = nxt
    return dist
