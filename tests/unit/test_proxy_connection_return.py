"""A kept-alive client connection that aiohttp's path served (because a backend check timed
out, so the backend was not known to be up) goes back to the forwarding core once that request
is answered: a slow check must not leave the connection on the slow path for good.

A real proxy process in front of fake llama-servers (`fakes.Fake`) whose ``/health`` can be
made to hang, which is what a check timing out on a busy machine looks like to the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from aiohttp import web

from fakes import Fake, serve
from specaudit.llama import free_port
from specaudit.proxy import ProxyConfig, serve_in_thread

BODY = json.dumps({"prompt": "a", "max_tokens": 1}).encode()  # no logprobs: the spec backend


@dataclass
class Stalling:
    """`inner`, except that ``/health`` hangs while `stall` is set (the proxy's check times
    out)."""

    inner: Fake
    stall: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/health" and self.stall.is_set():
            await asyncio.sleep(600)
        return await self.inner(request)


@contextlib.contextmanager
def proxy_process(plain: str, spec: str) -> Iterator[str]:
    """`specaudit proxy` as its own process, checking roles every 0.5 s, its checks timing
    out after 5.5 s (``--connect-timeout`` + 5)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from specaudit.cli import main; main()",
            "proxy",
            "--plain",
            plain,
            "--spec",
            spec,
            "--listen",
            f"127.0.0.1:{port}",
            "--check-interval",
            "0.5",
            "--connect-timeout",
            "0.5",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(url, lambda h: h.status_code == 200, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def wait_for(url: str, ok: object, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll the proxy's /health (each poll on a connection of its own) until `ok(response)`."""
    deadline = time.monotonic() + 60
    while True:
        if proc is not None:
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        with contextlib.suppress(httpx.HTTPError):
            if ok(httpx.get(url + "/health", timeout=2)):  # type: ignore[operator]
                return
        assert time.monotonic() < deadline, "the proxy's /health never showed that"
        time.sleep(0.1)


def spec_state(r: httpx.Response) -> str:
    return str(r.json()["backends"]["spec"]["state"])


def served_by_core(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    m = re.search(r'specaudit_proxy_fast_path_total\{outcome="served"\} (\S+)', text)
    return float(m[1]) if m else 0.0


def post(conn: http.client.HTTPConnection) -> tuple[int, str | None]:
    conn.request("POST", "/v1/completions", BODY, {"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    return r.status, r.getheader("X-Specaudit-Backend")


def test_a_connection_served_while_a_check_timed_out_returns_to_the_core() -> None:
    spec_fake = Stalling(Fake("ok", speculative=True))
    with (
        serve(Fake("ok")) as plain,
        serve(spec_fake) as spec,
        proxy_process(plain.url, spec.url) as url,
    ):
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            assert post(conn) == (200, "spec")
            sock = conn.sock  # the one connection every request below must use
            assert served_by_core(url) == 1

            spec_fake.stall.set()  # the next check of spec times out: spec is "down"
            wait_for(url, lambda h: spec_state(h) == "down")
            assert post(conn) == (200, "spec")  # aiohttp's path serves it (spec answers)
            assert conn.sock is sock
            assert served_by_core(url) == 1

            spec_fake.stall.clear()  # the next check finds spec up again
            wait_for(url, lambda h: spec_state(h) == "up")
            for _ in range(3):
                assert post(conn) == (200, "spec")
            assert conn.sock is sock, "the proxy closed the kept-alive connection"
            assert served_by_core(url) == 4, "the connection stayed on aiohttp's path"
        finally:
            conn.close()


def read_answer(s: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 answer with a Content-Length from `s`: (status, body)."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        assert chunk, f"closed after {got!r}"
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    assert len(body) == length, "more bytes than the answer"
    return int(head.split(b" ", 2)[1]), body


def test_a_pipelined_request_begun_behind_an_answer_is_not_split_between_the_paths() -> None:
    """``GET /health`` and the first half of a POST in one write: the connection holds the
    start of the POST when /health is answered, so it must not change hands then; the POST,
    completed later, gets the backend's answer, and so do the next ones, the core's."""
    post_bytes = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY)
    )
    half = len(post_bytes) // 2
    with (
        serve(Fake("ok")) as plain,
        serve(Fake("ok", speculative=True)) as spec,
        serve_in_thread(ProxyConfig(plain.url, spec.url, port=0)) as px,
        socket.create_connection(("127.0.0.1", int(px.url.rsplit(":", 1)[1])), 30) as s,
    ):
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post_bytes[:half])
        status, body = read_answer(s)
        assert status == 200 and json.loads(body)["status"] == "ok"
        time.sleep(0.2)  # the answer is out: a connection between requests would move now
        s.sendall(post_bytes[half:])
        status, body = read_answer(s)
        assert (status, json.loads(body)["choices"][0]["text"]) == (200, "a")
        # the connection is between requests now: it goes back to the core (a request that
        # arrives before it does is still aiohttp's, so a few tries, each answered right)
        for _ in range(50):
            s.sendall(post_bytes)
            status, body = read_answer(s)
            assert (status, json.loads(body)["choices"][0]["text"]) == (200, "a")
            if served_by_core(px.url):
                break
            time.sleep(0.1)
        assert served_by_core(px.url) == 1, "the connection never came back to the core"
