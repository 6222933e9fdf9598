"""The forwarding core's side of the backends: where each is, its kept-alive connections,
and how many requests the core is serving on it.

Why its own piece: a kept-alive connection is only worth reusing while the backend still
holds it (llama-server drops an idle one after 5 s), and the core only sends a backend as
many requests as it may (``max_connections``); both rules live here, behind `get`/`put`.
"""

from __future__ import annotations

import asyncio
from typing import Protocol
from urllib.parse import urlsplit

from specaudit.proxy.backends import PLAIN, SPEC

POOL_IDLE = 4.0  # seconds a pooled backend connection may idle (llama-server drops it at 5)


class Pooled(Protocol):
    """A kept-alive backend connection (`exchange.Upstream`)."""

    lost: bool
    idle_since: float
    transport: asyncio.Transport | None

    def close(self) -> None: ...


class Target:
    """Where one backend's requests go: host, port and the request line's path prefix."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host = u.hostname or ""
        self.port = u.port or 80
        self.prefix_b = u.path.encode()
        self.host_header = u.netloc.encode()


def target(url: str) -> Target | None:
    """A plain-HTTP backend the core can reach; None for https (aiohttp's path serves those)."""
    return Target(url) if urlsplit(url).scheme == "http" else None


class BackendPool:
    """Per backend role: its `Target` (None: https), its idle kept-alive connections, and the
    requests the core is serving on it (`busy`)."""

    def __init__(self, plain_url: str, spec_url: str) -> None:
        self.targets = {PLAIN: target(plain_url), SPEC: target(spec_url)}
        self.idle: dict[str, list[Pooled]] = {PLAIN: [], SPEC: []}
        self.busy = {PLAIN: 0, SPEC: 0}

    def get(self, role: str) -> Pooled | None:
        """A kept-alive connection to `role` still fresh enough to reuse, if there is one."""
        pool = self.idle[role]
        now = asyncio.get_running_loop().time()
        self._prune(pool, now)
        while pool:
            up = pool.pop()
            if not up.lost and now - up.idle_since < POOL_IDLE:
                return up
            up.close()
        return None

    def put(self, role: str, up: Pooled) -> None:
        if up.transport is not None:
            up.transport.resume_reading()  # never pool a connection left paused
        up.idle_since = now = asyncio.get_running_loop().time()
        pool = self.idle[role]
        self._prune(pool, now)
        pool.append(up)

    def prune(self) -> None:
        """Close every connection idle too long (after a load, nothing else would)."""
        now = asyncio.get_running_loop().time()
        for pool in self.idle.values():
            self._prune(pool, now)

    @staticmethod
    def _prune(pool: list[Pooled], now: float) -> None:
        """Close the connections idle too long, oldest first. `get` takes the newest, so under
        steady load the ones a burst left at the bottom would otherwise stay (closed by the
        backend, their transports and parsers held) until the pool emptied."""
        stale = 0
        while stale < len(pool) and (pool[stale].lost or now - pool[stale].idle_since >= POOL_IDLE):
            pool[stale].close()
            stale += 1
        if stale:
            del pool[:stale]

    def close(self) -> None:
        """Close every idle connection (the proxy is stopping)."""
        for pool in self.idle.values():
            while pool:
                pool.pop().close()
