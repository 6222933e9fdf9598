"""Loaded at interpreter start by every process of a vLLM server whose PYTHONPATH holds this
folder: imports the fixes named in ``SPECAUDIT_VLLM_FIXES`` (comma-separated; ``cpu-sampler``
is ``fix_cpu_sampler``). Set by `specaudit.vllm.server.VllmServer`; nothing else loads it."""

from __future__ import annotations

import importlib
import os

for _name in filter(None, os.environ.get("SPECAUDIT_VLLM_FIXES", "").split(",")):
    importlib.import_module("fix_" + _name.strip().replace("-", "_"))
