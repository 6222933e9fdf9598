"""A client that sends its request slowly is timed out, and such connections cannot pile up.

What this guards against: connections that trickle their request body one byte at a time were never
closed (0 of 150 after 100 s). Now headers and body must arrive within ``client_timeout`` of
the request's first byte (of the connection, for its first request); after that the proxy
answers 408 and closes. At most ``max_incomplete_requests`` connections may be sending a
request at once: a new one pushes out the one that has been sending longest (408).

Every client here is a raw socket on 127.0.0.1 with bounded loops and socket timeouts; the
only timing asserted is "closed within the configured timeout plus generous slack".
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

import fakes
from specaudit.proxy import ProxyConfig, RunningProxy, serve_in_thread

TIMEOUT = 1.0  # the proxy's client timeout in these tests
SLACK = 6.0  # generous: a loaded 2-core machine
BODY_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n{"
)
HEADER_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "


@dataclass
class Trickle:
    """A client sending `head`, then `drip` every `interval` s, until the proxy answers or
    closes (at most `max_drips` times); then reads until EOF."""

    port: int
    head: bytes = BODY_HEAD
    drip: bytes = b" "
    interval: float = 0.2
    max_drips: int = 75  # bounded: 15 s at most
    stop: threading.Event = field(default_factory=threading.Event)
    answer: bytes = b""
    closed_after: float | None = None  # seconds from connect to EOF (or reset)
    reset: bool = False
    thread: threading.Thread | None = None

    def start(self) -> Trickle:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def join(self) -> Trickle:
        assert self.thread is not None
        self.thread.join(SLACK + 30)
        assert not self.thread.is_alive()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        with socket.create_connection((fakes.HOST, self.port), timeout=10) as s:
            try:
                s.sendall(self.head)
                for _ in range(self.max_drips):
                    if self.stop.is_set():
                        return
                    readable, _, _ = select.select([s], [], [], self.interval)
                    if readable:
                        break
                    if self.drip:
                        s.sendall(self.drip)
                while chunk := s.recv(65536):
                    self.answer += chunk
            except ConnectionResetError:
                self.reset = True
            except (TimeoutError, OSError):
                return  # never closed: closed_after stays None
            self.closed_after = time.monotonic() - t0

    @property
    def status(self) -> int | None:
        parts = self.answer.split(b" ", 2)
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None

    def error(self) -> dict[str, object]:
        body = self.answer.partition(b"\r\n\r\n")[2]
        err = json.loads(body)["error"]
        assert isinstance(err, dict)
        return err


@contextlib.contextmanager
def proxy(**kw: Any) -> Iterator[RunningProxy]:
    """A proxy over two fakes; `kw` are ProxyConfig options, which ProxyConfig checks."""
    with (
        fakes.serve(fakes.Fake("ok")) as plain,
        fakes.serve(fakes.Fake("ok", speculative=True)) as spec,
        serve_in_thread(ProxyConfig(plain.url, spec.url, port=0, check_interval=3600, **kw)) as p,
    ):
        yield p


def port_of(p: RunningProxy) -> int:
    return int(p.url.rsplit(":", 1)[1])


def normal_request(p: RunningProxy) -> httpx.Response:
    return httpx.post(p.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}, timeout=30)


def assert_timed_out(t: Trickle, within: float) -> None:
    assert t.closed_after is not None, f"never closed; got {t.answer[:200]!r}"
    assert t.closed_after <= within, t.closed_after
    assert t.status == 408, t.answer[:300]
    assert b"connection: close" in t.answer.lower()
    err = t.error()
    assert err["code"] == 408 and "timeout" in str(err["message"])


@pytest.mark.parametrize("head", [BODY_HEAD, HEADER_HEAD], ids=["body", "headers"])
def test_trickling_clients_get_408_and_are_closed_while_others_are_served(head: bytes) -> None:
    with proxy(client_timeout=TIMEOUT) as p:
        slow = [Trickle(port_of(p), head=head).start() for _ in range(6)]
        time.sleep(0.3)  # they are all trickling now
        r = normal_request(p)  # served meanwhile
        assert r.status_code == 200, r.text
        for t in slow:
            assert_timed_out(t.join(), TIMEOUT + SLACK)
        stats = p.stats()
        assert stats.errors.get("client_timeout") == 6, stats.errors
        assert normal_request(p).status_code == 200  # and still serves afterwards


def test_a_silent_connection_is_closed_without_an_answer() -> None:
    with proxy(client_timeout=TIMEOUT) as p:
        t = Trickle(port_of(p), head=b"", drip=b"").start().join()
        assert t.closed_after is not None and t.closed_after <= TIMEOUT + SLACK
        assert t.answer == b""  # nothing was asked, so nothing is answered


def test_the_deadline_is_per_request_not_per_byte_nor_per_idle_keep_alive() -> None:
    """A keep-alive connection may idle past the client timeout (the keep-alive timeout
    governs idling); the next request's deadline starts at its own first byte."""
    body = b'{"prompt": "a", "max_tokens": 1}'
    req = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with (
        proxy(client_timeout=TIMEOUT) as p,
        socket.create_connection((fakes.HOST, port_of(p)), timeout=10) as s,
    ):
        for _ in range(2):
            s.sendall(req)
            answer = b""
            while b'"text": "a"' not in answer and b'"text":"a"' not in answer:
                chunk = s.recv(65536)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer
            time.sleep(TIMEOUT * 1.5)


def test_connections_still_sending_are_bounded_oldest_pushed_out_first() -> None:
    limit = 3
    with proxy(client_timeout=60.0, max_incomplete_requests=limit) as p:
        slow: list[Trickle] = []
        try:
            for _ in range(limit + 2):
                slow.append(Trickle(port_of(p), interval=0.2).start())
                time.sleep(0.3)  # in order: the first is the oldest
            # two over the limit: the two oldest were answered 408 at once, not after 60 s
            for t in slow[:2]:
                assert_timed_out(t.join(), SLACK + 1.0)
            assert all(t.closed_after is None for t in slow[2:])
            r = normal_request(p)  # a new client is served (it pushes out the next oldest)
            assert r.status_code == 200, r.text
            assert p.stats().errors.get("client_timeout", 0) >= 2
        finally:
            for t in slow:
                t.stop.set()
            for t in slow:
                t.join()
