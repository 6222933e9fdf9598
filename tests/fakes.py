"""Fake servers for the tests: one way to serve something on 127.0.0.1, always stopped.

`serve(handler)` runs an aiohttp low-level handler (``async (request) -> response``) on
127.0.0.1 on a port the kernel picks, from an event loop in a background thread, and stops it
on exit whatever happened inside the block: the listener is closed, handlers still running
(a stream that never ends, a slow answer) are cancelled, the thread is joined. A handler sees
a client going away as a cancellation (``handler_cancellation``). `serve_tcp(on_connect)` is
the same for a raw TCP server (bytes that are not HTTP, a relay).

Canned answers (`Canned`: a plain function from `Asked` to `Answer`) reach the code under test
either way from one handler: `serve(serving(canned))` on a socket, for a test whose client is
another process; `route_clients(monkeypatch, canned)` with no socket at all, through
`specaudit.client`'s transport seam (an `httpx.MockTransport`), for everything run in-process.

The fakes built on it, for what a real llama-server cannot play:

- `Fake`: a proxy backend that is slow, answers garbage, streams forever (and notices the
  cancel), or answers "ok" while recording every request (one that must never be reached);
- `not_http`: a TCP server answering every connection with bytes that are not HTTP;
- `Relay`: a TCP relay in front of a real server that records what the server sent.

Importable as ``import fakes`` from any test: pytest's default (prepend) import mode puts this
directory on sys.path for tests/conftest.py, which sits next to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import pytest
from aiohttp import web

from specaudit import client

HOST = "127.0.0.1"
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
OnConnect = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
T = TypeVar("T")


@dataclass(frozen=True)
class Served:
    """Where a fake listens."""

    port: int
    host: str = HOST

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _run(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(10)


async def _cancel_the_rest() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.contextmanager
def _loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a daemon thread; on exit every task left is cancelled."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-server", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        try:
            _run(loop, _cancel_the_rest())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


@contextlib.contextmanager
def serve(handler: Handler) -> Iterator[Served]:
    """Serve `handler` over HTTP on 127.0.0.1:<free port> until the block ends."""
    with _loop_thread() as loop:

        async def start() -> tuple[web.Server, asyncio.Server]:
            server = web.Server(handler, handler_cancellation=True)
            return server, await loop.create_server(server, HOST, 0)

        server, listener = _run(loop, start())
        try:
            yield Served(listener.sockets[0].getsockname()[1])
        finally:

            async def stop() -> None:
                listener.close()
                await server.shutdown(1.0)

            _run(loop, stop())


@contextlib.contextmanager
def serve_tcp(on_connect: OnConnect) -> Iterator[Served]:
    """Serve raw TCP on 127.0.0.1:<free port>: `on_connect(reader, writer)` per connection."""
    with _loop_thread() as loop:
        listener = _run(loop, asyncio.start_server(on_connect, HOST, 0))
        try:
            yield Served(listener.sockets[0].getsockname()[1])
        finally:

            async def stop() -> None:
                listener.close()

            _run(loop, stop())


# ------------------------------------------------------------------------------ canned answers


@dataclass(frozen=True)
class Asked:
    """One request as a canned handler sees it, however it arrived."""

    method: str
    path: str  # without the query
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Answer:
    """What a canned handler answers; `delay` (seconds) keeps the request in flight first."""

    body: bytes = b""
    status: int = 200
    content_type: str = "application/json"
    delay: float = 0.0

    @classmethod
    def json(cls, value: Any, status: int = 200, delay: float = 0.0) -> Answer:
        return cls(json.dumps(value).encode(), status, delay=delay)

    def response(self) -> httpx.Response:
        return httpx.Response(
            self.status, content=self.body, headers={"Content-Type": self.content_type}
        )


Canned = Callable[[Asked], Answer]
URL = "http://canned.test"  # what `route_clients` answers; nothing listens there


def serving(canned: Canned) -> Handler:
    """`canned` as an aiohttp handler, for `serve`: the same answers over a socket."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        answer = canned(Asked(request.method, request.path, await request.read()))
        await asyncio.sleep(answer.delay)
        return web.Response(
            status=answer.status, body=answer.body, content_type=answer.content_type
        )

    return handle


class CannedTransport(httpx.MockTransport):
    """`canned` as an httpx transport for sync and async clients alike; an answer's delay is
    slept without holding the event loop, so concurrent requests really overlap."""

    def __init__(self, canned: Canned) -> None:
        super().__init__(self._answer)
        self.canned = canned

    def _answer(self, request: httpx.Request) -> httpx.Response:
        answer = self.canned(_asked(request))
        time.sleep(answer.delay)
        return answer.response()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        answer = self.canned(_asked(request))
        await asyncio.sleep(answer.delay)
        return answer.response()


def _asked(request: httpx.Request) -> Asked:
    return Asked(request.method, request.url.path, request.content)


def route_clients(monkeypatch: pytest.MonkeyPatch, canned: Canned) -> str:
    """Until the test ends, every `specaudit.client` client built without a transport (the
    ones a command builds deep inside) is answered by `canned`, with no socket; returns the
    base URL to give them."""
    monkeypatch.setattr(client, "default_transport", CannedTransport(canned))
    return URL


# ------------------------------------------------------------------------------ proxy backends

EVENT = b'data: {"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}\n\n'


@dataclass
class Hit:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Fake:
    """A fake backend (`serve(Fake(...))`); `mode` decides how generation endpoints answer.

    ``/health`` says ok and ``/slots`` one slot, speculative or not; every request is recorded
    in `hits`.
    """

    mode: str  # slow | garbage-json | garbage-sse | binary-sse | endless-stream | ok
    delay: float = 5.0
    speculative: bool = False
    hits: list[Hit] = field(default_factory=list)
    stream_closed: threading.Event = field(default_factory=threading.Event)
    stream_started: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        self.hits.append(Hit(request.method, request.path_qs, dict(request.headers), body))
        if request.path == "/health":
            return web.json_response({"status": "ok"})
        if request.path == "/slots":
            return web.json_response([{"id": 0, "speculative": self.speculative}])
        stream = b'"stream": true' in body or b'"stream":true' in body
        if self.mode == "ok":
            return web.json_response({"choices": [{"index": 0, "text": "a"}]})
        if self.mode == "slow":
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(EVENT)
                await asyncio.sleep(self.delay)
                return resp
            await asyncio.sleep(self.delay)
            return web.json_response({"choices": [{"index": 0, "text": "late"}]})
        if self.mode == "garbage-json":
            return web.Response(body=b"<html>502 oops</html>", content_type="text/html")
        if self.mode in ("garbage-sse", "binary-sse"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(EVENT)
            await resp.write(
                b"data: {broken json\n\n"
                if self.mode == "garbage-sse"
                else bytes(range(256)) + b"\n\n"
            )
            await asyncio.sleep(0.05)
            return resp
        if self.mode == "endless-stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            self.stream_started.set()
            try:
                while True:
                    await resp.write(EVENT)
                    await asyncio.sleep(0.05)
            except (ConnectionResetError, asyncio.CancelledError):
                self.stream_closed.set()
                raise
        raise AssertionError(self.mode)


async def not_http(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """`serve_tcp(not_http)`: answers every connection with bytes that are not HTTP."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(r.read(65536), 2)
        w.write(b"\x00\x01SSH-2.0-nope\r\n\r\n")
        await w.drain()
    w.close()


class Relay:
    """`serve_tcp(Relay(port))`: a TCP relay in front of a real server on `target_port`.

    Records what the server sent on each connection (to compare with what a proxy forwarded);
    setting `target_port` switches new connections to another server.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._recs: list[bytearray] = []

    @property
    def responses(self) -> list[bytes]:
        """Server->client bytes, one entry per connection, in connection order."""
        return [bytes(r) for r in self._recs]

    @staticmethod
    async def _pipe(
        r: asyncio.StreamReader, w: asyncio.StreamWriter, record: bytearray | None
    ) -> None:
        try:
            while data := await r.read(65536):
                if record is not None:
                    record += data
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                w.close()

    async def __call__(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            cw.close()
            return
        rec = bytearray()
        self._recs.append(rec)  # filled before each byte is passed on
        await asyncio.gather(self._pipe(cr, sw, None), self._pipe(sr, cw, rec))


def http_body(raw: bytes) -> bytes:
    """The body of one recorded HTTP/1.1 response, chunked transfer decoded."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    if b"chunked" not in head.lower():
        return rest
    out = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    return bytes(out)
