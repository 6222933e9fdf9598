"""The forwarding core's memory per connection is bounded when a client pipelines requests
and does not read the answers.

It used to start each next pipelined request as soon as the previous answer was written,
whether or not the client was reading: 4 connections x 150 pipelined requests, never read,
grew the proxy by about 70 MB. Now, while a client's transport is paused (its unread answers
above the high-water mark), no next request starts, and at most `forwarding.PIPELINE_BUFFER` bytes
of pipelined requests (plus one read) are read ahead. What is asserted is the behaviour, not
time: how many requests reached the backend, and how many bytes the proxy holds.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

from aiohttp import web

import fakes
from specaudit.proxy import ProxyConfig, RunningProxy, forwarding, serve_in_thread

N = 40  # pipelined requests on the connection
ANSWER = 256 * 1024  # bytes of each answer: N of them are far more than any socket buffers
READ = 256 * 1024  # the most one read from a socket brings (asyncio's and uvloop's)


def request(i: int) -> bytes:
    body = json.dumps({"prompt": str(i), "max_tokens": 1}).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )


def settled(count: list[int], quiet: float = 1.5, limit: float = 30.0) -> int:
    """The backend's request count once it has not changed for `quiet` seconds (bounded)."""
    end = time.monotonic() + limit
    last, since = -1, time.monotonic()
    while time.monotonic() < end:
        if count[0] != last:
            last, since = count[0], time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
        time.sleep(0.1)
    return last


def held_bytes(p: RunningProxy) -> list[int]:
    """Bytes of requests each of the core's client connections holds."""

    async def sizes() -> list[int]:
        return [len(f.buf) for f in p.proxy.fronts]

    return asyncio.run_coroutine_threadsafe(sizes(), p.loop).result(10)


def test_a_client_that_does_not_read_stops_its_pipelined_requests() -> None:
    hits = [0]
    answer = json.dumps({"choices": [{"index": 0, "text": "x" * ANSWER}]}).encode()

    async def spec(request: web.BaseRequest) -> web.StreamResponse:
        if request.path in ("/slots", "/health"):
            body = [{"id": 0, "speculative": True}] if request.path == "/slots" else {}
            return web.json_response(body)
        await request.read()
        hits[0] += 1
        return web.Response(body=answer, content_type="application/json")

    with (
        fakes.serve(fakes.Fake("ok")) as plain,
        fakes.serve(spec) as backend,
        serve_in_thread(ProxyConfig(plain.url, backend.url, port=0, check_interval=3600)) as p,
    ):
        host, port = p.url.removeprefix("http://").split(":")
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # little kernel buffering
            s.settimeout(30)
            s.connect((host, int(port)))
            s.sendall(b"".join(request(i) for i in range(N)))  # and read nothing, for now
            started = settled(hits)
            # a few answers fill the socket buffers and the transport's; then it waits
            assert started < N // 2, f"{started} of {N} requests started for a client not reading"
            assert max(held_bytes(p)) <= forwarding.PIPELINE_BUFFER + READ
            # the client reads: every request is answered, in order
            buf = b""
            got = 0
            while got < N:
                while b"\r\n\r\n" not in buf:
                    chunk = s.recv(1 << 20)
                    assert chunk, f"closed after {got} answers"
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 "), head
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buf) < length:
                    chunk = s.recv(1 << 20)
                    assert chunk, f"closed in answer {got}"
                    buf += chunk
                assert buf[:length] == answer
                buf = buf[length:]
                got += 1
        assert hits[0] == N
