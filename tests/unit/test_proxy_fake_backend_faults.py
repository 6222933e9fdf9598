"""Faults from small fake backends: each request gets a well-formed answer or a clear error,
none hangs (every client call has a deadline). A client that leaves mid-stream closes the
upstream connection; a backend that answers garbage gets a 502 (an error event mid-stream) and
the proxy keeps serving. tests/integration/test_proxy_faults.py holds the cases with real
llama-servers."""

from __future__ import annotations

import time

import httpx
import pytest

from fakes import Fake, not_http, serve, serve_tcp
from proxy_helpers import dead_url, error_of, request_body, sse_objects
from specaudit.proxy import ProxyConfig, serve_in_thread


def test_client_disconnect_closes_the_upstream_connection() -> None:
    fake = Fake("endless-stream")
    with (
        serve(fake) as backend,
        serve_in_thread(ProxyConfig(dead_url(), backend.url, port=0)) as px,
    ):
        with (
            httpx.Client(timeout=30) as c,
            c.stream(
                "POST",
                px.url + "/v1/completions",
                json=request_body("completions", stream=True, logprobs=False),
            ) as r,
        ):
            for _chunk in r.iter_raw():
                break
        assert fake.stream_closed.wait(10), "upstream stream still open after the client left"
        deadline = time.monotonic() + 10
        while px.proxy.metrics.in_flight.get() != 0:
            assert time.monotonic() < deadline, "request still in flight"
            time.sleep(0.05)


@pytest.mark.parametrize("mode", ["garbage-json", "garbage-sse", "binary-sse", "not-http"])
def test_backend_answers_garbage(mode: str) -> None:
    def through_the_proxy(url: str) -> None:
        with (
            serve_in_thread(ProxyConfig(dead_url(), url, port=0)) as px,
            httpx.Client(timeout=30) as c,
        ):
            stream = mode.endswith("sse")
            r = c.post(
                px.url + "/v1/completions",
                json=request_body("completions", stream=stream, logprobs=False),
            )
            if stream:
                assert r.status_code == 200
                objs = sse_objects(r.content)  # every forwarded event parses
                assert len(objs) == 2 and objs[-1]["error"]["code"] == 502
                assert "invalid stream" in objs[-1]["error"]["message"]
            else:
                assert r.status_code == 502
                assert error_of(r)["type"] == "upstream_error"
            # the proxy keeps serving
            assert c.get(px.url + "/health").status_code in (200, 503)

    with serve_tcp(not_http) if mode == "not-http" else serve(Fake(mode)) as backend:
        through_the_proxy(backend.url)
