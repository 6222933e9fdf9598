"""The floor under any Python proxy on this machine: a byte relay that reads nothing.

Each client connection gets one upstream connection, and bytes are copied both ways as they
arrive, with no parsing, routing or checking. benchmarks/bench_proxy.py measures it next to
`specaudit proxy` (the ``relay`` rows). Whatever this costs per request, every proxy written
on asyncio pays at least that: the event loop's wakeups, the socket calls of a second hop,
and a connection accepted and opened per stream.

    .venv/bin/python benchmarks/relay_floor.py UP_HOST UP_PORT LISTEN_PORT [uvloop|asyncio]
"""

from __future__ import annotations

import asyncio
import sys


class Upstream(asyncio.Protocol):
    def __init__(self, down: asyncio.Transport) -> None:
        self.down = down

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.down.write(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.down.close()


class Downstream(asyncio.Protocol):
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.up: asyncio.Transport | None = None
        self.pending: list[bytes] = []
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            up, _ = await loop.create_connection(
                # a stream transport, so it writes; uvloop's is not an asyncio.Transport subclass,
                # which rules out narrowing with isinstance
                lambda: Upstream(self.transport),  # type: ignore[arg-type]
                self.host,
                self.port,
            )
        except OSError:
            self.transport.close()
            return
        if self.closed:
            up.close()
            return
        self.up = up
        for d in self.pending:
            up.write(d)
        self.pending.clear()

    def data_received(self, data: bytes) -> None:
        if self.up is None:
            self.pending.append(data)
        else:
            self.up.write(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        if self.up is not None:
            self.up.close()


async def serve(host: str, port: int, listen: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Downstream(host, port), "127.0.0.1", listen)
    await server.serve_forever()


def main() -> None:
    host, port, listen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kind = sys.argv[4] if len(sys.argv) > 4 else "uvloop"
    if kind == "uvloop":
        import uvloop

        uvloop.run(serve(host, port, listen))
    else:
        asyncio.run(serve(host, port, listen))


if __name__ == "__main__":
    main()
