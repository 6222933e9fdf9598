"""llama-cpp-python: its wheel built once and cached, and its OpenAI-compatible server
(`python -m llama_cpp.server`) started on a fixture and always stopped.

Why a cache: PyPI ships llama-cpp-python as an sdist that compiles llama.cpp (about 10 min
on two cores). `ensure_wheel` builds the pinned version once into the specaudit cache (a file
lock serialises concurrent builds; later calls reuse the wheel), and `install` puts it, with
its server extra, into the running interpreter's environment: `./run test` calls
``python -m specaudit.llama_cpp_python install`` before pytest, so no test waits for it and
none is skipped.

The server binds 127.0.0.1 on a free port, runs in its own process group with PDEATHSIG,
and is stopped on exit: the lifecycle of `specaudit.llama.process.ManagedServer`, shared with
`specaudit.llama.server.LlamaServer`. Its speculation
(``--draft_model prompt-lookup-decoding``) is invisible from outside: no ``/slots``, no
``/props``, no draft counts in responses (docs/engines.md).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from specaudit.errors import BuildError, ServerError
from specaudit.llama.process import ManagedServer, last_error, log_tail
from specaudit.paths import cache_root, file_lock

VERSION = "0.3.36"
PACKAGE = "llama-cpp-python"
# What the wheel leaves out: the multimodal library, llama.cpp's tools, tests and examples
# (not needed by the server on a text fixture; halves the build). GGML_NATIVE off keeps the
# cached wheel portable across machines of this kind.
CMAKE_ARGS = (
    "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF"
)
SERVER_DEPS = (  # llama-cpp-python[server], as its pyproject lists them
    "uvicorn>=0.22.0",
    "fastapi>=0.100.0",
    "pydantic-settings>=2.0.1",
    "sse-starlette>=1.6.1",
    "starlette-context>=0.3.6,<0.4",
    "PyYAML>=5.1",
)
PROMPT_LOOKUP = "prompt-lookup-decoding"  # its only --draft_model
DEFAULT_PRED_TOKENS = 4  # --draft_model_num_pred_tokens


def wheel_dir(version: str = VERSION) -> Path:
    return cache_root() / "llama-cpp-python" / version


def cached_wheel(version: str = VERSION) -> Path | None:
    """The cached wheel of `version`, if built."""
    d = wheel_dir(version)
    wheels = sorted(d.glob("llama_cpp_python-*.whl")) if d.is_dir() else []
    return wheels[-1] if wheels else None


def _pip(*args: str, env: dict[str, str] | None = None, log: Path | None = None) -> None:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log.open("ab")) if log else subprocess.DEVNULL
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        where = f" (log {log}: {last_error(log_tail(log))})" if log else ""
        raise BuildError(f"pip {' '.join(args[:2])} {PACKAGE} failed with code {rc}{where}")


def ensure_wheel(version: str = VERSION, *, verbose: bool = False) -> Path:
    """The wheel of llama-cpp-python `version`, built from PyPI's sdist on first use."""
    found = cached_wheel(version)
    if found:
        return found
    d = wheel_dir(version)
    with file_lock(d.parent / f".{version}.lock"):
        found = cached_wheel(version)  # built by another process while we waited
        if found:
            return found
        d.mkdir(parents=True, exist_ok=True)
        log = d.parent / f"build-{version}.log"
        if verbose:
            print(f"[specaudit] building {PACKAGE}=={version} (log {log})", file=sys.stderr)
        env = {
            **os.environ,
            "CMAKE_ARGS": CMAKE_ARGS,
            "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
        }
        with tempfile.TemporaryDirectory(dir=d.parent) as tmp:
            _pip("wheel", "--no-deps", f"{PACKAGE}=={version}", "-w", tmp, env=env, log=log)
            built = sorted(Path(tmp).glob("llama_cpp_python-*.whl"))
            if not built:
                raise BuildError(f"pip wheel {PACKAGE}=={version} produced no wheel (log {log})")
            os.replace(built[-1], d / built[-1].name)  # atomic: a wheel is whole or absent
    found = cached_wheel(version)
    assert found is not None
    return found


def installed_version() -> str | None:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def install(version: str = VERSION, *, verbose: bool = False) -> Path:
    """llama-cpp-python `version` and its server extra in this interpreter's environment,
    from the cached wheel (built first if needed). Nothing happens if already installed."""
    wheel = ensure_wheel(version, verbose=verbose)
    if installed_version() != version:
        log = wheel_dir(version).parent / f"install-{version}.log"
        _pip("install", "-q", str(wheel), *SERVER_DEPS, log=log)
    return wheel


class LlamaCppPythonServer(ManagedServer):
    """``python -m llama_cpp.server`` on a GGUF, ready when `__enter__` returns.

    `draft`: ``prompt-lookup-decoding`` (llama-cpp-python's only speculative mode) or None.
    One thread, a context of `n_ctx`, `logits_all` (its completions need it for logprobs);
    `f32_cache`: an f32 KV cache (the context fixture's policy, `presets`). The lifecycle is
    `ManagedServer`'s; ready once ``/v1/models`` answers (it has no ``/health``).
    """

    ready_path = "/v1/models"
    not_ready = "not ready"
    poll_interval = 0.2

    def __init__(
        self,
        model: Path,
        *,
        draft: str | None = PROMPT_LOOKUP,
        pred_tokens: int = DEFAULT_PRED_TOKENS,
        n_ctx: int = 256,
        log_path: Path | None = None,
        startup_timeout: float = 120.0,
        python: str = sys.executable,
        f32_cache: bool = False,
    ) -> None:
        super().__init__(
            name="llama_cpp.server", log_path=log_path, startup_timeout=startup_timeout
        )
        self.model = Path(model)
        self.draft = draft
        self.pred_tokens = pred_tokens
        self.n_ctx = n_ctx
        self.python = python
        self.f32_cache = f32_cache

    def argv(self) -> list[str]:
        out = [
            self.python, "-m", "llama_cpp.server",
            "--model", str(self.model),
            "--host", self.host, "--port", str(self.port),
            "--n_ctx", str(self.n_ctx), "--n_threads", "1", "--n_threads_batch", "1",
            "--logits_all", "true", "--verbose", "false",
        ]  # fmt: skip
        if self.f32_cache:  # GGML_TYPE_F32: the context fixture is exact in f32 (presets)
            out += ["--type_k", "0", "--type_v", "0"]
        if self.draft:
            out += ["--draft_model", self.draft]
            out += ["--draft_model_num_pred_tokens", str(self.pred_tokens)]
        return out

    def preflight(self) -> None:
        if not self.model.is_file():
            raise ServerError(f"model file not found: {self.model}")
        if installed_version() is None:
            raise ServerError(
                f"{PACKAGE} is not installed (python -m specaudit.llama_cpp_python install)"
            )


def main(argv: list[str] | None = None) -> int:
    """``python -m specaudit.llama_cpp_python install``: build or reuse the cached wheel,
    install it here. Exit 0, or 2 with one line on failure."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["install"]:
        print("usage: python -m specaudit.llama_cpp_python install", file=sys.stderr)
        return 2
    try:
        wheel = install(verbose=True)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[specaudit] {PACKAGE} {VERSION} installed from {wheel}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "CMAKE_ARGS",
    "PROMPT_LOOKUP",
    "VERSION",
    "LlamaCppPythonServer",
    "cached_wheel",
    "ensure_wheel",
    "install",
    "installed_version",
    "main",
]
