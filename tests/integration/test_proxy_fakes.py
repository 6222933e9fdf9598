"""Small fake backends for the proxy tests that a real llama-server cannot play: a slow one,
one that answers garbage, one that streams forever (to see a cancel arrive), and a recorder
that must never be reached. Everything else in the proxy tests uses real llama-servers.

The module's own tests check the fakes do what the fault tests rely on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from aiohttp import web

from specaudit.llama import free_port

EVENT = b'data: {"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}\n\n'


@dataclass
class Hit:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Fake:
    """A fake backend; `mode` decides how generation endpoints answer."""

    mode: str  # slow | garbage-json | garbage-sse | binary-sse | endless-stream | ok
    delay: float = 5.0
    speculative: bool = False
    port: int = 0
    hits: list[Hit] = field(default_factory=list)
    stream_closed: threading.Event = field(default_factory=threading.Event)
    stream_started: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
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
            await resp.write(b"data: {broken json\n\n" if self.mode == "garbage-sse"
                             else bytes(range(256)) + b"\n\n")
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


@contextlib.contextmanager
def running(fake: Fake) -> Iterator[Fake]:
    """Serve `fake` from a background thread on 127.0.0.1:<free port>."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fake.port = free_port()

    async def start() -> tuple[web.Server, asyncio.AbstractServer]:
        server = web.Server(fake.handle, handler_cancellation=True)
        return server, await loop.create_server(server, "127.0.0.1", fake.port)

    server, srv = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield fake
    finally:
        async def stop() -> None:
            srv.close()
            await server.shutdown(1.0)
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def not_http() -> Iterator[str]:
    """A TCP server that answers every connection with bytes that are not HTTP."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = free_port()

    async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(r.read(65536), 2)
            w.write(b"\x00\x01SSH-2.0-nope\r\n\r\n")
            await w.drain()
        w.close()

    srv = asyncio.run_coroutine_threadsafe(
        asyncio.start_server(reply, "127.0.0.1", port), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(srv.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


class Relay:
    """A TCP relay in front of a real server: records what the server sent on each connection
    (to compare with what the proxy forwarded) and can be switched to another server."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._recs: list[bytearray] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._srv: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def responses(self) -> list[bytes]:
        """Server->client bytes, one entry per connection, in connection order."""
        return [bytes(r) for r in self._recs]

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter,
                    record: bytearray | None) -> None:
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

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            cw.close()
            return
        rec = bytearray()
        self._recs.append(rec)  # filled before each byte is passed on
        await asyncio.gather(self._pipe(cr, sw, None), self._pipe(sr, cw, rec))

    def __enter__(self) -> Relay:
        self._thread.start()
        self._srv = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._conn, "127.0.0.1", self.port), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._srv is not None

        async def stop() -> None:
            assert self._srv is not None
            self._srv.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


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
        rest = rest[size + 2:]
    return bytes(out)


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "completion": "/completion"}
TOP = 2


def request_body(kind: str, *, stream: bool, logprobs: bool, n: int = 8, seed: int = 1,
                 prompt: str = "abcab") -> dict[str, object]:
    """A generation request the fixture (letters a-h) can serve on each endpoint."""
    b: dict[str, object] = {"temperature": 1.0, "seed": seed, "stream": stream}
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    b["n_predict" if kind == "completion" else "max_tokens"] = n
    if logprobs:
        if kind == "chat":
            b.update(logprobs=True, top_logprobs=TOP)
        elif kind == "completions":
            b["logprobs"] = TOP
        else:
            b["n_probs"] = TOP
    return b


def sse_objects(raw: bytes) -> list[dict[str, object]]:
    """Every JSON event of an SSE body (comments and [DONE] left out); fails on torn events."""
    from specaudit.proxy import sse

    evs, rest = sse.split_events(raw)
    assert rest.strip() == b"", f"stream ended mid-event: {rest[:80]!r}"
    out = []
    for ev in evs:
        obj = sse.parse_event(ev)
        if isinstance(obj, dict):
            out.append(obj)
    return out


def token_entries(kind: str, obj: dict) -> list[dict]:
    if kind == "completion":
        return list(obj.get("completion_probabilities") or [])
    out = []
    for ch in obj.get("choices") or []:
        lp = ch.get("logprobs")
        if isinstance(lp, dict):
            out += lp.get("content") or []
    return out


def has_text(kind: str, ev: dict) -> bool:
    if kind == "completion":
        return bool(ev.get("content")) and ev.get("stop") is not True
    ch = (ev.get("choices") or [{}])[0]
    delta = ch.get("delta") if kind == "chat" else None
    return bool((delta or {}).get("content") if kind == "chat" else ch.get("text"))


def assert_nothing_fake(kind: str, objs: list[dict], stream: bool) -> tuple[int, int]:
    """No token value a client could take as real unless it is: every token entry has
    candidates or an explicit null; in streams every token chunk carries an entry.
    Returns (tokens, explicit nulls)."""
    tokens = nulls = 0
    for obj in objs:
        entries = token_entries(kind, obj)
        if stream and has_text(kind, obj):
            assert entries, f"streamed token without a probability entry: {obj}"
        for e in entries:
            tokens += 1
            cands = e.get("top_probs", e.get("top_logprobs"))
            value = e.get("prob", e.get("logprob"))
            if not cands:
                assert value is None, f"placeholder passed as real: {e}"
                nulls += 1
    return tokens, nulls


def test_fakes_behave() -> None:
    with running(Fake("endless-stream")) as f:
        assert httpx.get(f.url + "/slots").json() == [{"id": 0, "speculative": False}]
        with httpx.stream("POST", f.url + "/v1/completions", content=b'{"stream": true}') as r:
            it = r.iter_bytes()
            assert next(it).startswith(b"data:")
        assert f.stream_closed.wait(5)
    with running(Fake("slow", delay=0.3)) as f:
        r = httpx.post(f.url + "/v1/completions", content=b"{}")
        assert r.json()["choices"][0]["text"] == "late"
    with not_http() as url, httpx.Client() as c:
        try:
            c.get(url + "/health")
            raise AssertionError("not_http answered HTTP")
        except httpx.HTTPError:
            pass
