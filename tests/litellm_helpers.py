"""What the LiteLLM tests share: extra fixture llama-servers of a role (to kill mid-test), a
LiteLLM ``config.yaml`` writer, and the ``litellm`` proxy process, always stopped.

Importable as ``import litellm_helpers`` from any test, like tests/fakes.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from specaudit import audit
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer, free_port

# No network at start-up: LiteLLM otherwise fetches its model price map from the internet.
LITELLM_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}


def extra_server(ctx: audit.AuditContext, bins: LlamaBinaries, role: str, name: str) -> LlamaServer:
    """A second fixture server of a `presets.PRESETS` role (not started): one the test owns."""
    preset = presets.PRESETS[role]
    ctx.log_dir.mkdir(parents=True, exist_ok=True)
    return presets.for_preset(
        preset,
        bins,
        ctx.model_path(preset.model),
        ctx.draft_path(preset.model) if preset.uses_draft else None,
        log_path=ctx.log_dir / f"{name}.log",
        name=name,
    )


def write_config(
    path: Path,
    groups: dict[str, Sequence[str]],
    *,
    callbacks: str | None = "specaudit.integrations.litellm.handler",
) -> Path:
    """A LiteLLM proxy config: each model group's deployments are llama-server roots."""
    lines = ["model_list:"]
    for group, urls in groups.items():
        for url in urls:
            lines += [
                f"  - model_name: {group}",
                "    litellm_params:",
                "      model: openai/fixture",
                f"      api_base: {url}/v1",
                "      api_key: none",
            ]
    lines += ["router_settings:", "  num_retries: 3"]
    if callbacks:
        lines += ["litellm_settings:", f"  callbacks: {callbacks}"]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def litellm_proxy(
    config: Path, env: dict[str, str] | None = None, workers: int = 1
) -> Iterator[str]:
    """``litellm --config FILE`` on 127.0.0.1 and a free port; yields its URL; always stopped."""
    port = free_port()
    log = config.with_suffix(".log")
    exe = Path(sys.executable).with_name("litellm")
    argv = [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    if workers > 1:
        argv += ["--num_workers", str(workers)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=config.parent,
            env={**os.environ, **LITELLM_ENV, **(env or {})},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"litellm exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health/liveliness", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"litellm did not start in 120 s: {log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
