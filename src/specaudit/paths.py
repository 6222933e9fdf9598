"""Where specaudit keeps its per-user cache (llama.cpp builds, models, fixtures, crash logs).

One place decides it so every module, test and CLI command agrees; `SPECAUDIT_CACHE`
overrides it (tests and CI can point it anywhere), otherwise XDG's cache dir is used. A root
that cannot be a directory (``/proc/foo``, an existing file) is a one-line `CacheError`
(exit 2), never a traceback.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from platformdirs import user_cache_dir

from specaudit.errors import SpecauditError

ENV_CACHE = "SPECAUDIT_CACHE"


class CacheError(SpecauditError):
    """The cache root cannot be created or is not a directory."""


def cache_root() -> Path:
    """The root of specaudit's cache, created on demand; `CacheError` if it cannot be."""
    env = os.environ.get(ENV_CACHE)
    where = f"{ENV_CACHE}={env}" if env else "the cache directory"
    try:
        root = Path(env).expanduser() if env else Path(user_cache_dir("specaudit"))
        root.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        hint = f"; point {ENV_CACHE} at a writable directory"
        raise CacheError(f"{where}: cannot create the cache directory: {reason}{hint}") from None
    if not root.is_dir():
        raise CacheError(f"{where}: {root} is not a directory; point {ENV_CACHE} elsewhere")
    return root


__all__ = ["ENV_CACHE", "CacheError", "cache_root"]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (created with its parents): one process at a time
    builds a cache entry; the others wait, then find it built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
