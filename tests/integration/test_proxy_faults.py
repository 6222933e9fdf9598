"""Fault matrix: in every case each request gets a well-formed answer or a clear error, and
none hangs (every client call has a deadline) or is lost.

- plain backend down at start (error policy and annotate policy), with the real fixture-spec;
- plain backend killed in the middle of a stream (a real Gemma plain server of this module:
  Gemma is slow enough on CPU that a long stream is still running when it is killed);
- client disconnects mid-stream (the real Gemma server stops generating);
- a backend slow past the timeout (a small fake against the real fixture-spec); the fake-only
  faults are in tests/unit/test_proxy_fake_backend_faults.py.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fakes import Fake, serve
from proxy_helpers import (
    PATHS,
    TOP,
    assert_nothing_fake,
    dead_url,
    error_of,
    request_body,
    sse_objects,
)
from specaudit.llama import LlamaServer, presets
from specaudit.llama.build import LlamaBinaries
from specaudit.proxy import (
    H_ANNOTATED,
    H_BACKEND,
    H_FALLBACK,
    H_PLACEHOLDERS,
    OnPlainDown,
    ProxyConfig,
    serve_in_thread,
)

Server = Callable[[str], Any]
KINDS = ["chat", "completions", "completion"]


@pytest.fixture(scope="module")
def spec_url(server: Server) -> str:
    return server("fixture-spec").url


def test_plain_down_at_start_error_policy(spec_url: str) -> None:
    with (
        serve_in_thread(ProxyConfig(dead_url(), spec_url, port=0)) as px,
        httpx.Client(timeout=60) as c,
    ):
        h = c.get(px.url + "/health")
        assert h.status_code == 200 and h.json()["status"] == "degraded"
        assert h.json()["backends"]["plain"]["state"] == "down"
        for kind in KINDS:
            for stream in (False, True):
                r = c.post(
                    px.url + PATHS[kind], json=request_body(kind, stream=stream, logprobs=True)
                )
                assert r.status_code == 503
                err = error_of(r)
                assert err["type"] == "unavailable_error"
                assert "logprobs" in err["message"] and "down" in err["message"]
                assert "connection refused" in err["message"]
                # requests without logprobs are unaffected
                r = c.post(
                    px.url + PATHS[kind], json=request_body(kind, stream=stream, logprobs=False)
                )
                assert r.status_code == 200 and r.headers[H_BACKEND] == "spec"
        stats = px.stats()
    assert stats.errors["plain_down"] == 6
    assert stats.placeholders_caught == {}


@pytest.mark.parametrize("kind", KINDS)
def test_plain_down_at_start_annotate_policy(spec_url: str, kind: str) -> None:
    cfg = ProxyConfig(dead_url(), spec_url, port=0, on_plain_down=OnPlainDown.ANNOTATE)
    with serve_in_thread(cfg) as px, httpx.Client(timeout=60) as c:
        r = c.post(px.url + PATHS[kind], json=request_body(kind, stream=False, logprobs=True))
        assert r.status_code == 200
        assert r.headers[H_BACKEND] == "spec" and r.headers[H_ANNOTATED] == "true"
        assert r.headers[H_FALLBACK] == "plain-down"
        n_ph = int(r.headers[H_PLACEHOLDERS])
        tokens, nulls = assert_nothing_fake(kind, [r.json()], stream=False)
        assert tokens == 8 and nulls == n_ph and n_ph > 0

        r = c.post(px.url + PATHS[kind], json=request_body(kind, stream=True, logprobs=True))
        assert r.status_code == 200 and r.headers[H_ANNOTATED] == "true"
        objs = sse_objects(r.content)
        tokens, nulls = assert_nothing_fake(kind, objs, stream=True)
        assert tokens == 8 and nulls > 0
        assert f": specaudit-placeholders {nulls}\n\n".encode() in r.content
        stats = px.stats()
    assert stats.placeholders_caught["spec"] == n_ph + nulls


# --------------------------------------------------------------- Gemma: kill and disconnect


@pytest.fixture(scope="module")
def gemma_plain(
    llama_bins: LlamaBinaries, gemma_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """A plain Gemma server this module owns (the kill test stops it for good)."""
    log = tmp_path_factory.mktemp("proxy-gemma") / "gemma-plain.log"
    with presets.server(llama_bins, gemma_path, kind="gemma", parallel=1, ctx_per_slot=4096,
                        log_path=log, name="proxy-gemma-plain") as srv:  # fmt: skip
        yield srv


def long_chat(stream: bool = True) -> dict[str, object]:
    return {
        "messages": [
            {
                "role": "user",
                "content": "Write a very long story about a lighthouse keeper, chapter by chapter.",
            }
        ],
        "max_tokens": 3000,
        "temperature": 1.0,
        "seed": 1,
        "stream": stream,
        "logprobs": True,
        "top_logprobs": TOP,
        "ignore_eos": True,
    }


def slots_busy(url: str) -> bool:
    return any(s.get("is_processing") for s in httpx.get(url + "/slots", timeout=10).json())


@pytest.mark.gemma
def test_client_disconnect_stops_the_generation(gemma_plain: LlamaServer, spec_url: str) -> None:
    with serve_in_thread(ProxyConfig(gemma_plain.url, spec_url, port=0)) as px:
        with (
            httpx.Client(timeout=60) as c,
            c.stream("POST", px.url + PATHS["chat"], json=long_chat()) as r,
        ):
            assert r.status_code == 200
            it = r.iter_raw()  # kept referenced: dropping it would close the connection
            seen = b""
            while seen.count(b"\n\n") < 3:
                seen += next(it)
            assert slots_busy(gemma_plain.url)  # still connected: still generating
        # the client is gone; 3000 tokens would take minutes, so an idle slot within this
        # deadline means the proxy cancelled the upstream request
        deadline = time.monotonic() + 30
        while slots_busy(gemma_plain.url):
            assert time.monotonic() < deadline, "llama-server kept generating for nobody"
            time.sleep(0.2)
        # and the proxy serves the next request normally
        r = httpx.post(
            px.url + PATHS["chat"], timeout=120, json={**long_chat(stream=False), "max_tokens": 4}
        )
        assert r.status_code == 200 and r.headers[H_PLACEHOLDERS] == "0"
        stats = px.stats()
    assert stats.errors.get("client_disconnect", 0) >= 1


@pytest.mark.gemma
def test_plain_killed_mid_stream(gemma_plain: LlamaServer, spec_url: str) -> None:
    """Runs last in this module: it kills the module's Gemma server."""
    with (
        serve_in_thread(ProxyConfig(gemma_plain.url, spec_url, port=0)) as px,
        httpx.Client(timeout=httpx.Timeout(60.0)) as c,
    ):
        raw = b""
        with c.stream("POST", px.url + PATHS["chat"], json=long_chat()) as r:
            assert r.status_code == 200
            killed = False
            for chunk in r.iter_raw():  # ends: the proxy closes the stream after the error
                raw += chunk
                if not killed and raw.count(b"\n\n") >= 3:
                    assert gemma_plain.proc is not None
                    os.killpg(gemma_plain.proc.pid, signal.SIGKILL)  # the exact group we started
                    killed = True
        assert killed
        objs = sse_objects(raw)
        assert len(objs) >= 3
        err = objs[-1].get("error")
        assert isinstance(err, dict) and err["code"] == 502
        assert "plain backend" in err["message"] and "incomplete" in err["message"]
        assert_nothing_fake("chat", objs[:-1], stream=True)
        assert b"[DONE]" not in raw  # an incomplete answer is never dressed as complete
        # the next logprobs request is answered at once with a clear error
        r = c.post(px.url + PATHS["chat"], json=request_body("chat", stream=False, logprobs=True))
        assert r.status_code == 503 and "down" in error_of(r)["message"]
        assert c.get(px.url + "/health").json()["backends"]["plain"]["state"] == "down"
        r = c.post(px.url + PATHS["chat"], json=request_body("chat", stream=False, logprobs=False))
        assert r.status_code == 200 and r.headers[H_BACKEND] == "spec"


# ----------------------------------------------------------------------------- slow, garbage


@pytest.mark.parametrize("role", ["plain", "spec"])
def test_backend_slow_past_the_timeout(spec_url: str, role: str) -> None:
    with serve(Fake("slow", delay=5.0)) as fake:
        plain, spec = (fake.url, spec_url) if role == "plain" else (dead_url(), fake.url)
        cfg = ProxyConfig(plain, spec, port=0, read_timeout=0.5)
        with serve_in_thread(cfg) as px, httpx.Client(timeout=30) as c:
            lp = role == "plain"
            r = c.post(
                px.url + "/v1/completions",
                json=request_body("completions", stream=False, logprobs=lp),
            )
            assert r.status_code == 504
            err = error_of(r)
            assert err["type"] == "timeout_error" and f"{role} backend" in err["message"]
            r = c.post(
                px.url + "/v1/completions",
                json=request_body("completions", stream=True, logprobs=lp),
            )
            assert r.status_code == 200  # the headers and first event had gone out
            objs = sse_objects(r.content)
            assert objs[-1]["error"]["code"] == 504
            assert "went silent" in objs[-1]["error"]["message"]
            stats = px.stats()
    assert stats.errors["upstream_timeout"] == 2


def test_spec_down_falls_back_to_plain(server: Server) -> None:
    plain = server("fixture-plain").url
    with (
        serve_in_thread(ProxyConfig(plain, dead_url(), port=0)) as px,
        httpx.Client(timeout=60) as c,
    ):
        r = c.post(
            px.url + "/completion", json=request_body("completion", stream=True, logprobs=False)
        )
        assert r.status_code == 200
        assert r.headers[H_BACKEND] == "plain" and r.headers[H_FALLBACK] == "spec-down"
        assert sse_objects(r.content)[-1]["stop"] is True
