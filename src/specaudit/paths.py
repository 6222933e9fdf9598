"""Where specaudit keeps its per-user cache (llama.cpp builds, models, fixtures).

One place decides it so every module, test and CLI command agrees; `SPECAUDIT_CACHE`
overrides it (tests and CI can point it anywhere), otherwise XDG's cache dir is used.
"""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir


def cache_root() -> Path:
    """The root of specaudit's cache, created on demand."""
    env = os.environ.get("SPECAUDIT_CACHE")
    root = Path(env).expanduser() if env else Path(user_cache_dir("specaudit"))
    root.mkdir(parents=True, exist_ok=True)
    return root
