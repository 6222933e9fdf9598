"""The sources a variant compiles: which files its patches touch, the bytes those files must
have (derived from the sdist alone), and keeping the shared work tree equal to them.

Why this shape: the cmake work tree (``llama/work/b<N>``) is shared by every variant of a build,
so a patched variant after a stock build is an incremental rebuild (seconds), not a cold one
(minutes). Because it is shared, an entry's variant is proven from bytes, not from a record.
Only the files a bundled patch touches can differ between variants, so they are what the tree
is checked on. Their expected bytes for a variant come from the sdist alone (pristine, or
pristine + the variant's patches applied in a scratch dir), never from the work tree, and a
build compiles only a tree whose bytes equal them. The work tree is only ever written with those
expected bytes, under a "dirty" state record (``patched.json``) first, so a failed patch never
reaches it and an interrupted write is repaired by the next build. The expected hashes are
memoised per build (``llama/.b<N>-sources.json``) so a lookup stays a couple of small reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specaudit.errors import BuildError
from specaudit.llama import sdist
from specaudit.llama.patches import (
    Patch,
    available_mutants,
    available_patches,
    resolve_all,
    variant_name,
)

_DIFF_FILE = re.compile(r"^(?:\+\+\+ b/|--- a/)(\S+)", re.M)
_MEMO_VERSION = 1


def patch_files(patch: Patch) -> set[str]:
    """Files `patch` creates, edits or deletes (relative to the llama.cpp tree)."""
    files = set(_DIFF_FILE.findall(patch.text))
    if not files:
        raise BuildError(f"patch {patch.display} touches no file (not a unified diff?)")
    for rel in files:
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise BuildError(f"patch {patch.display} touches a path outside the source tree: {rel}")
    return files


def all_patch_files(build: int) -> set[str]:
    """Files any bundled patch or mutant touches: checked (and restored) on every build."""
    out: set[str] = set()
    for patch in resolve_all(available_patches(build) + available_mutants(build), build):
        out |= patch_files(patch)
    return out


def variant_sources(
    build: int, patches: tuple[Patch, ...], rels: set[str], download: bool = True
) -> dict[str, bytes | None]:
    """The bytes `rels` must have in variant `patches`, from the sdist alone.

    The patches run in a scratch dir holding only the pristine files they touch, so a patch
    that fails partway leaves nothing behind anywhere.
    """
    touched: set[str] = set()
    for patch in patches:
        touched |= patch_files(patch)
    data = sdist.read_sdist(build, rels | touched, download)
    if not patches:
        return {rel: data[rel] for rel in rels}
    with tempfile.TemporaryDirectory(prefix="specaudit-patch-") as td:
        tmp = Path(td)
        for rel, b in data.items():
            if b is not None:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(b)
        for patch in patches:
            r = subprocess.run(  # the diff on stdin: the bytes resolved once, never the file
                ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-r", "-"],
                cwd=tmp,
                input=patch.data,
                capture_output=True,
            )
            if r.returncode != 0:
                said = (r.stdout + r.stderr).decode(errors="replace")
                out = said.strip().splitlines()
                bad = [ln for ln in out if "FAILED" in ln or "can't find" in ln.lower()]
                why = (bad or out or ["?"])[-1]
                raise BuildError(f"patch {patch.display} does not apply to b{build}: {why}")
        return {rel: (tmp / rel).read_bytes() if (tmp / rel).is_file() else None for rel in rels}


def hashes(data: dict[str, bytes | None]) -> dict[str, str | None]:
    return {rel: None if b is None else hashlib.sha256(b).hexdigest() for rel, b in data.items()}


def source_fingerprint(files: Mapping[str, str | None]) -> str:
    """One SHA-256 over (relpath, sha256 of its bytes or absent) of each file, path-sorted."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel] or '-'}\n".encode())
    return h.hexdigest()


def _memo_path(build: int) -> Path:
    return sdist.llama_dir() / f".b{build}-sources.json"


def expected_hashes(
    build: int, patches: tuple[Patch, ...], rels: set[str], download: bool = True
) -> dict[str, str | None]:
    """sha256 each of `rels` must have in variant `patches` (see `variant_sources`).

    Memoised per (build, variant, file) in ``llama/.b<N>-sources.json`` so that `find` stays a
    couple of small file reads; the memo is derived from the sdist (fixed per build, SHA-256
    checked) and the patch bytes (hashed into the variant name) only.
    """
    variant = variant_name(patches)
    memo = _read_memo(build)
    have = memo.get(variant)
    if isinstance(have, dict) and rels <= have.keys():
        return {rel: have[rel] for rel in rels}
    got = hashes(variant_sources(build, patches, rels, download))
    _remember(build, variant, got)
    return got


def _read_memo(build: int) -> dict[str, Any]:
    """The sources memo of `build`; empty if absent, unreadable or of another version."""
    try:
        memo = json.loads(_memo_path(build).read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) and memo.get("version") == _MEMO_VERSION else {}


def _remember(build: int, variant: str, hashes: dict[str, str | None]) -> None:
    memo_file = _memo_path(build)
    memo = _read_memo(build)
    memo["version"] = _MEMO_VERSION
    entry = memo.get(variant)
    memo[variant] = {**(entry if isinstance(entry, dict) else {}), **hashes}
    sdist.write_atomic(memo_file, json.dumps(memo, indent=1, sort_keys=True).encode())


def _write_source(path: Path, data: bytes | None) -> None:
    """Set one work-tree file to `data` (None: delete it); atomic, so never half-written."""
    if data is None:
        path.unlink(missing_ok=True)
        return
    try:
        mode = path.stat().st_mode & 0o7777  # keep e.g. a script's exec bit
    except FileNotFoundError:
        mode = 0o644
    sdist.write_atomic(path, data, mode)


def tree_hashes(src: Path, rels: set[str]) -> dict[str, str | None]:
    return hashes(
        {rel: (src / rel).read_bytes() if (src / rel).is_file() else None for rel in rels}
    )


def _written_since_unpack(src: Path) -> set[str]:
    """Source files (not under build/) written after the tree was unpacked.

    Unpacking keeps the sdist's mtimes and every rewrite creates a new file, so these are the
    files any patch (bundled or a user's .patch file touching anything) may have changed: what
    an unreadable state record must not make us forget. Milliseconds for ~4000 files.
    """
    try:
        since = (src.parent / "unpacked").stat().st_mtime
    except OSError:
        return set()
    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(src):
        here = Path(dirpath)
        if here == src:
            dirnames[:] = [d for d in dirnames if d != "build"]
        for f in filenames:
            path = here / f
            with contextlib.suppress(OSError):
                if path.lstat().st_mtime >= since and path.is_file():
                    out.add(path.relative_to(src).as_posix())
    return out


def _strays(src: Path, rels: set[str]) -> list[Path]:
    """Backup and reject files patch(1) left next to `rels` (the pre-D14 code applied in place)."""
    return [p for rel in rels for ext in (".orig", ".rej") if (p := src / (rel + ext)).exists()]


def _read_state(state: Path) -> tuple[str, set[str]]:
    """(variant, files) of the work tree's patch record; an unreadable record is "dirty"."""
    if not state.exists():
        return "stock", set()  # fresh from the sdist
    try:
        got = json.loads(state.read_text())
    except (OSError, ValueError):
        got = None
    if not isinstance(got, dict) or not isinstance(got.get("files"), list):
        return "dirty", set()
    files = {
        f
        for f in got["files"]
        if isinstance(f, str) and f and not f.startswith("/") and ".." not in Path(f).parts
    }
    variant = got.get("variant")
    if not isinstance(variant, str):  # written before variants were recorded
        variant = "stock" if not got.get("patches") else "dirty"
    return variant, files


def set_patches(build: int, src: Path, patches: tuple[Patch, ...]) -> dict[str, str | None]:
    """Make the work tree equal to pristine source + `patches`, touching only what changes.

    Checked on the bytes, not on the record: every file any bundled patch (or the record)
    touches is hashed and compared with its expected hash for this variant, so a tree that a
    failed patch, an interrupt or a hand edit left different is rewritten from the sdist. A
    patch that does not apply raises BuildError with the tree restored to stock. Only files
    whose bytes change are written, so make recompiles just the objects that depend on them.
    Returns the verified per-file hashes (the ``sources`` of the cache entry).
    """
    state_file = src.parent / "patched.json"
    variant, recorded = _read_state(state_file)
    want = variant_name(patches)
    touched: set[str] = set()
    for patch in patches:
        touched |= patch_files(patch)
    rels = all_patch_files(build) | recorded | touched
    if variant == "dirty":  # the record may have lost a patch file's files: scan the tree
        rels |= _written_since_unpack(src)
    try:
        expected = expected_hashes(build, patches, rels)
        clean = variant == want and not _strays(src, rels)
        if clean and tree_hashes(src, rels) == expected:
            return expected
        data = variant_sources(build, patches, rels)
    except BuildError:
        if patches:  # leave a stock tree and a true record, not whatever was there
            _rewrite(src, state_file, (), "stock", set(), variant_sources(build, (), rels))
        raise
    _rewrite(src, state_file, patches, want, touched, data)
    got = tree_hashes(src, rels)
    if got != hashes(data):
        raise BuildError(f"cannot make the work tree {src} equal to b{build} {want}")
    if got != expected:  # a stale memo; the sdist and the patches just said otherwise
        _remember(build, want, got)
    return got


def _rewrite(
    src: Path,
    state_file: Path,
    patches: tuple[Patch, ...],
    variant: str,
    touched: set[str],
    data: dict[str, bytes | None],
) -> None:
    """Write `data` into the tree under a "dirty" record naming every file it may change."""
    rels = set(data)
    dirty = {"patches": [p.name for p in patches], "variant": "dirty", "files": sorted(rels)}
    sdist.write_atomic(state_file, json.dumps(dirty).encode())
    for p in _strays(src, rels):
        p.unlink()
    for rel in sorted(rels):
        path = src / rel
        now = path.read_bytes() if path.is_file() else None
        if now != data[rel]:
            _write_source(path, data[rel])
    clean = {"patches": [p.name for p in patches], "variant": variant, "files": sorted(touched)}
    sdist.write_atomic(state_file, json.dumps(clean).encode())


def sources_prove_variant(build: int, patches: tuple[Patch, ...], sources: object) -> bool:
    """Whether an entry's recorded ``sources`` are exactly what its variant compiles.

    The file hashes must reproduce the fingerprint, cover every file the variant's own patches
    touch, and equal the hashes this variant must have (from the sdist and the patches, see
    `expected_hashes`; memoised, and never downloaded here: unverifiable means not found).

    Entries without ``sources`` were built before sources were recorded (D14, issue 11) and
    are accepted as they are: their bytes were not kept, so they can't be proven after the
    fact, and refusing them would force a cold rebuild of every existing cache. Every entry
    built since carries ``sources`` and is checked here.
    """
    if not isinstance(sources, dict):
        return False
    files = sources.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in files.items()
    ):
        return False
    if source_fingerprint(files) != sources.get("fingerprint"):
        return False
    try:
        need: set[str] = set()
        for patch in patches:
            need |= patch_files(patch)
        if not need <= files.keys():
            return False
        return expected_hashes(build, patches, set(files), download=False) == files
    except (BuildError, OSError, tarfile.TarError):
        return False
