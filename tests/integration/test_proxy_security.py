"""Security: nothing in a request redirects the proxy, Authorization goes only to the
configured backend and never into a log, and limits hold. Real fixture servers as backends;
a recording fake plays the place a request tries to reach (it must stay untouched)."""

from __future__ import annotations

import logging
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from fakes import Fake, Served, serve
from proxy_helpers import PATHS, request_body
from specaudit.llama import free_port
from specaudit.proxy import H_BACKEND, ProxyConfig, serve_in_thread

Server = Callable[[str], Any]
CliFn = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="module")
def urls(server: Server) -> tuple[str, str]:
    return server("fixture-plain").url, server("fixture-spec").url


@pytest.fixture(scope="module")
def evil() -> Iterator[tuple[Fake, Served]]:
    """A recording backend that requests try to send the proxy to."""
    fake = Fake("ok")
    with serve(fake) as srv:
        yield fake, srv


@pytest.fixture(scope="module")
def proxy(urls: tuple[str, str]) -> Iterator[Any]:
    with serve_in_thread(ProxyConfig(urls[0], urls[1], port=0, max_body_bytes=65536)) as px:
        yield px


def raw_http(port: int, request: bytes, timeout: float = 30) -> bytes:
    """Send bytes as they are (no client normalising them) and read the answer until the
    server closes (requests say Connection: close, or are bad enough to be closed on)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def test_requests_cannot_redirect_the_proxy(proxy: Any, evil: tuple[Fake, Served]) -> None:
    recorder, evil_srv = evil
    e_host = f"127.0.0.1:{evil_srv.port}"
    evil_url = evil_srv.url
    body = request_body("completions", stream=False, logprobs=False, n=2)
    attempts: list[tuple[str, dict[str, str], dict[str, Any]]] = [
        ("/v1/completions", {"Host": e_host}, body),
        (
            "/v1/completions",
            {
                "X-Forwarded-Host": e_host,
                "Forwarded": f"host={e_host}",
                "X-Forwarded-For": "127.0.0.1",
                "X-Original-URL": evil_url,
                "X-Rewrite-URL": evil_url + "/v1/completions",
            },
            body,
        ),
        (f"/v1/completions?url={evil_url}&backend={evil_url}&base_url={evil_url}", {}, body),
        (
            "/v1/completions",
            {},
            {
                **body,
                "base_url": evil_url,
                "api_base": evil_url,
                "url": evil_url,
                "backend": evil_url,
                "model": evil_url,
            },
        ),
        ("/v1/completions", {}, {**body, "logprobs": 2, "server": evil_url}),
        (
            "/completion",
            {},
            {
                "prompt": "abc",
                "n_predict": 2,
                "proxy": evil_url,
                "endpoint": evil_url + "/completion",
            },
        ),
    ]
    with httpx.Client(timeout=60) as c:
        for path, headers, b in attempts:
            r = c.post(proxy.url + path, json=b, headers=headers)
            assert r.status_code == 200, (path, r.text)
            assert r.headers[H_BACKEND] in ("plain", "spec")
        for path in (
            f"//{e_host}/v1/completions",
            "/v1/completions/../../x",
            "/%2e%2e/v1/completions",
            "/v1/completions%00",
            "/v1/completions;x",
            "/v1/completions/",
            f"/{evil_url}/v1/completions",
        ):
            r = c.post(proxy.url + path, json=body)
            assert r.status_code == 404, path
    port = int(proxy.url.rsplit(":", 1)[1])
    payload = b'{"prompt": "abc", "max_tokens": 2}'
    absolute = (
        f"POST {evil_url}/v1/completions HTTP/1.1\r\nHost: {e_host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + payload
    answer = raw_http(port, absolute)
    # absolute-form: the path is honoured, the host is not
    assert status_of(answer) == 200 and b"X-Specaudit-Backend: spec" in answer
    connect = f"CONNECT {e_host} HTTP/1.1\r\nHost: {e_host}\r\nConnection: close\r\n\r\n"
    assert 400 <= status_of(raw_http(port, connect.encode())) < 500
    assert recorder.hits == [], [h.path for h in recorder.hits]


def test_authorization_never_logged_in_process(
    urls: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    secret = "sk-" + secrets.token_hex(12)
    auth = {"Authorization": f"Bearer {secret}"}
    plain, spec = urls
    with (
        caplog.at_level(logging.DEBUG),
        serve(Fake("garbage-json")) as garbage,
        serve(Fake("slow", delay=3)) as slow,
    ):
        for p, s in (
            (plain, spec),
            (f"http://127.0.0.1:{free_port()}", garbage.url),
            (slow.url, slow.url),
        ):
            cfg = ProxyConfig(p, s, port=0, read_timeout=0.5, max_body_bytes=1024)
            kinds = list(PATHS) if p == plain else ["chat"]
            with serve_in_thread(cfg) as px, httpx.Client(timeout=30, headers=auth) as c:
                for kind in kinds:
                    for lp in (False, True):
                        for stream in (False, True):
                            c.post(
                                px.url + PATHS[kind],
                                json=request_body(kind, stream=stream, logprobs=lp, n=2),
                            )
                c.post(px.url + "/v1/completions", content=b"{bad json")
                c.post(px.url + "/v1/completions", content=b"x" * 5000)
                c.get(px.url + "/nope")
                c.get(px.url + "/v1/models")
                port = int(px.url.rsplit(":", 1)[1])
                raw_http(
                    port,
                    f"GET /health HTTP/1.1\r\nAuthorization: Bearer {secret}\r\n"
                    f"Bad Header Line {secret}\r\nConnection: close\r\n\r\n".encode(),
                )
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "POST /v1/completions" in text  # the access log was captured
    assert secret not in text
    assert all(secret not in str(r.args) for r in caplog.records)


def test_cli_logs_no_authorization_and_stops_cleanly(urls: tuple[str, str]) -> None:
    secret = "sk-" + secrets.token_hex(12)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from specaudit.cli import main; main()",
            "proxy",
            "--plain",
            urls[0],
            "--spec",
            urls[1],
            "--listen",
            f"127.0.0.1:{port}",
            "--log-level",
            "debug",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.1)
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {secret}"}) as c:
            for lp in (False, True):
                r = c.post(
                    url + "/v1/chat/completions",
                    json=request_body("chat", stream=True, logprobs=lp, n=3),
                )
                assert r.status_code == 200
            assert c.post(url + "/v1/chat/completions", content=b"[]").status_code == 400
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()[-500:]
    logs = (out + err).decode()
    assert "route=logprobs backend=plain status=200" in logs
    assert "route=default backend=spec status=200" in logs
    assert secret not in logs


def test_body_limit_checked_before_reading(proxy: Any) -> None:
    port = int(proxy.url.rsplit(":", 1)[1])
    # a 10 GB claim is refused from the header alone, without waiting for the body
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10000000000\r\nConnection: close\r\n\r\n{"
    )
    answer = raw_http(port, head)
    assert status_of(answer) == 413 and b"limit is 65536" in answer
    r = httpx.post(
        proxy.url + "/v1/completions", timeout=30, json={"prompt": "a" * 70000, "max_tokens": 1}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_cli_refuses_a_speculating_plain_backend(urls: tuple[str, str], cli: CliFn) -> None:
    code, _, err = cli("proxy", "--plain", urls[1], "--spec", urls[1], "--listen", "127.0.0.1:0")
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "refusing to start" in lines[0] and "speculates" in lines[0]
    assert "Traceback" not in err
