"""The forwarding core's kept-alive backend connections: a burst's leftovers do not stay."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from specaudit.proxy.pool import POOL_IDLE, BackendPool


@dataclass
class Conn:
    lost: bool = False
    idle_since: float = 0.0
    transport: asyncio.Transport | None = None
    closed: bool = False

    def close(self) -> None:
        self.closed = True


def test_connections_a_burst_left_below_the_reused_ones_are_closed() -> None:
    async def go() -> None:
        pool = BackendPool("http://127.0.0.1:1", "http://127.0.0.1:2")
        loop = asyncio.get_running_loop()
        burst = [Conn() for _ in range(50)]
        for c in burst:
            pool.put("spec", c)
        for c in burst:  # they have idled too long (the backend would have closed them)
            c.idle_since = loop.time() - POOL_IDLE - 1
        hot = Conn()
        for _ in range(3):  # steady load: one connection, taken and put back
            pool.put("spec", hot)
            assert pool.get("spec") is hot
        assert all(c.closed for c in burst)
        assert pool.idle["spec"] == []
        assert not hot.closed

    asyncio.run(go())


def test_prune_closes_the_idle_connections_nothing_asks_for() -> None:
    async def go() -> None:
        pool = BackendPool("http://127.0.0.1:1", "http://127.0.0.1:2")
        old, lost, fresh = Conn(), Conn(), Conn()
        pool.put("plain", old)
        pool.put("plain", lost)
        pool.put("plain", fresh)
        old.idle_since -= POOL_IDLE + 1
        lost.lost = True
        pool.prune()
        assert old.closed and lost.closed and not fresh.closed
        assert pool.idle["plain"] == [fresh]

    asyncio.run(go())
