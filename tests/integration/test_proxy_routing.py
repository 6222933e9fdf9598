"""specaudit proxy in front of REAL llama-servers (the session's fixture-plain and fixture-spec):
routing on every endpoint in both modes, byte-identical SSE, the keep-alive pitfall, and role
verification through /slots."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import httpx
import pytest

from fakes import Fake, Relay, http_body, serve, serve_tcp
from proxy_helpers import PATHS, TOP, assert_nothing_fake, request_body, sse_objects
from specaudit import logprobs
from specaudit.proxy import (
    H_BACKEND,
    H_PLACEHOLDERS,
    ProxyConfig,
    ProxyError,
    State,
    serve_in_thread,
)

Server = Callable[[str], Any]


@pytest.fixture(scope="module")
def urls(server: Server) -> tuple[str, str]:
    return server("fixture-plain").url, server("fixture-spec").url


@pytest.fixture(scope="module")
def proxy_url(urls: tuple[str, str]) -> Iterator[str]:
    plain, spec = urls
    with serve_in_thread(ProxyConfig(plain, spec, port=0)) as px:
        yield px.url


def timings(kind: str, objs: list[dict]) -> dict:
    for o in reversed(objs):
        if isinstance(o.get("timings"), dict):
            return o["timings"]
    return {}


@pytest.mark.parametrize("kind", ["chat", "completions", "completion"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("lp", [True, False], ids=["logprobs", "plain"])
def test_routing(proxy_url: str, kind: str, stream: bool, lp: bool) -> None:
    body = request_body(kind, stream=stream, logprobs=lp)
    with httpx.Client(timeout=60) as c:
        r = c.post(proxy_url + PATHS[kind], json=body)
    assert r.status_code == 200, r.text
    assert r.headers[H_BACKEND] == ("plain" if lp else "spec")
    objs = sse_objects(r.content) if stream else [r.json()]
    t = timings(kind, objs)
    if lp:
        # served by the server that does not speculate: every value real
        assert "draft_n" not in t
        if not stream:
            assert r.headers[H_PLACEHOLDERS] == "0"
            recs = logprobs.from_response(kind, objs[0], TOP)
        else:
            recs = logprobs.from_stream(kind, objs, TOP)
        c_ = logprobs.counts(recs)
        assert c_.total == 8 and c_.real == 8, c_
        assert assert_nothing_fake(kind, objs, stream) == (8, 0)
    else:
        # served by the speculating server, which drafted
        assert t.get("draft_n", 0) > 0, t
        assert H_PLACEHOLDERS not in r.headers
        assert assert_nothing_fake(kind, objs, False) == (0, 0)  # no probabilities at all


def test_models_passthrough(proxy_url: str, urls: tuple[str, str]) -> None:
    r = httpx.get(proxy_url + "/v1/models", timeout=30)
    direct = httpx.get(urls[1] + "/v1/models", timeout=30)
    assert r.status_code == 200 and r.headers[H_BACKEND] == "spec"
    assert [m["id"] for m in r.json()["data"]] == [m["id"] for m in direct.json()["data"]]


def test_health_and_metrics(proxy_url: str) -> None:
    h = httpx.get(proxy_url + "/health", timeout=30)
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "ok"
    assert body["backends"]["plain"]["speculating"] is False
    assert body["backends"]["spec"]["speculating"] is True
    httpx.post(
        proxy_url + "/completion",
        json=request_body("completion", stream=False, logprobs=True),
        timeout=60,
    )
    text = httpx.get(proxy_url + "/metrics", timeout=30).text
    assert (
        'specaudit_proxy_requests_total{endpoint="/completion",route="logprobs",'
        'backend="plain",status="200"}'
    ) in text
    assert 'specaudit_proxy_backend_speculating{backend="spec"} 1' in text
    assert 'specaudit_proxy_backend_up{backend="plain"} 1' in text


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("lp", [True, False], ids=["logprobs", "plain"])
def test_stream_forwarded_byte_identical(urls: tuple[str, str], kind: str, lp: bool) -> None:
    """What the client receives is exactly the body the llama-server sent (seen on the wire by
    a relay between proxy and server)."""
    plain, spec = urls
    target = plain if lp else spec
    relay = Relay(int(target.rsplit(":", 1)[1]))
    with serve_tcp(relay) as front:
        cfg = ProxyConfig(front.url if lp else plain, front.url if not lp else spec, port=0)
        with serve_in_thread(cfg) as px, httpx.Client(timeout=60) as c:
            got = []
            for seed in (1, 2, 3):
                body = request_body(kind, stream=True, logprobs=lp, n=12, seed=seed)
                with c.stream("POST", px.url + PATHS[kind], json=body) as r:
                    assert r.status_code == 200
                    got.append(b"".join(r.iter_raw()))
        streamed = [http_body(x) for x in relay.responses if b"text/event-stream" in x[:400]]
    assert len(streamed) == 3
    assert got == streamed
    assert all(x.count(b"\n\n") >= 12 for x in got)


def test_stream_is_not_buffered(urls: tuple[str, str]) -> None:
    """Events of a stream that never ends reach the client: nothing waits for the end."""
    plain, _ = urls
    with (
        serve(Fake("endless-stream")) as fake,
        serve_in_thread(ProxyConfig(plain, fake.url, port=0)) as px,
        httpx.Client(timeout=30) as c,
        c.stream(
            "POST",
            px.url + "/v1/completions",
            json=request_body("completions", stream=True, logprobs=False),
        ) as r,
    ):
        seen = b""
        for chunk in r.iter_raw():
            seen += chunk
            if seen.count(b"\n\n") >= 3:
                break
    assert seen.count(b"data: ") >= 3


def test_keepalive_pitfall(urls: tuple[str, str], proxy_url: str) -> None:
    """llama-server closes a streamed connection it advertised as keep-alive. A naive pooled
    client trips on that (premise checked directly); through the proxy, streamed and
    non-streamed requests alternate on kept-alive client connections and all succeed."""
    plain, spec = urls

    async def alternate(url: str, n: int) -> tuple[int, int]:
        ok = bad = 0
        async with aiohttp.ClientSession() as s:  # one pooled, kept-alive client
            for i in range(n):
                kind = ("chat", "completions", "completion")[i % 3]
                for stream in (True, False):
                    body = request_body(kind, stream=stream, logprobs=i % 2 == 0, n=4)
                    try:
                        async with s.post(url + PATHS[kind], json=body) as r:
                            await r.read()
                            ok += r.status == 200
                            bad += r.status != 200
                    except aiohttp.ClientError:
                        bad += 1
        return ok, bad

    naive_ok, naive_bad = asyncio.run(alternate(spec, 6))
    assert naive_bad > 0, "premise: llama-server no longer drops streamed keep-alive connections"
    ok, bad = asyncio.run(alternate(proxy_url, 30))
    assert (ok, bad) == (60, 0)


def test_refuses_a_plain_backend_that_speculates(urls: tuple[str, str]) -> None:
    _, spec = urls
    with (
        pytest.raises(
            ProxyError,
            match=r"refusing to start: the plain backend .* speculates "
            r"\(/slots: \d+/\d+ slots speculative\)",
        ),
        serve_in_thread(ProxyConfig(spec, spec, port=0)),
    ):
        pass


def test_warns_about_a_spec_backend_that_does_not_speculate(
    urls: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    plain, _ = urls
    with (
        caplog.at_level(logging.WARNING, logger="specaudit.proxy"),
        serve_in_thread(ProxyConfig(plain, plain, port=0)) as px,
    ):
        h = httpx.get(px.url + "/health", timeout=30).json()
        r = httpx.post(
            px.url + "/v1/completions",
            timeout=60,
            json=request_body("completions", stream=False, logprobs=False),
        )
    assert "does not speculate" in h["backends"]["spec"]["warning"]
    assert any("does not speculate" in m for m in caplog.messages)
    assert r.status_code == 200  # a warning, not a refusal


def test_plain_backend_that_turns_speculative(urls: tuple[str, str]) -> None:
    """The 'plain' address starts answering from a speculating server (here: a relay switched
    over). The first logprobs response is caught by the token check (placeholders -> null,
    counted), which triggers a /slots re-check that marks plain unusable; the next logprobs
    request is refused with a 503 that says why."""
    plain, spec = urls
    relay = Relay(int(plain.rsplit(":", 1)[1]))
    with (
        serve_tcp(relay) as front,
        serve_in_thread(ProxyConfig(front.url, spec, port=0, check_interval=3600)) as px,
        httpx.Client(timeout=60) as c,
    ):
        # a stream first: its upstream connection is closed after, none stays pooled
        first = request_body("chat", stream=True, logprobs=True, n=8)
        r = c.post(px.url + PATHS["chat"], json=first)
        assert r.status_code == 200
        assert assert_nothing_fake("chat", sse_objects(r.content), True) == (8, 0)
        relay.target_port = int(spec.rsplit(":", 1)[1])  # new connections reach spec
        body = request_body("chat", stream=False, logprobs=True, n=8)
        r = c.post(px.url + PATHS["chat"], json=body)
        assert r.status_code == 200 and r.headers[H_BACKEND] == "plain"
        n_ph = int(r.headers[H_PLACEHOLDERS])
        assert n_ph > 0
        tokens, nulls = assert_nothing_fake("chat", [r.json()], False)
        assert nulls == n_ph and tokens == 8
        stream_body = request_body("chat", stream=True, logprobs=True, n=8, seed=2)
        # the caught placeholder woke the role check by itself (check_interval is an hour):
        # wait for it, bounded
        deadline = time.monotonic() + 30
        while px.stats().backends["plain"]["state"] != State.UNUSABLE.value:
            assert time.monotonic() < deadline, "no /slots re-check after the placeholder"
            time.sleep(0.05)
        r = c.post(px.url + PATHS["chat"], json=stream_body)
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == 503 and "speculates" in err["message"]
        stats = px.stats()
    assert stats.placeholders_caught.get("plain") == n_ph
    assert json.loads(json.dumps(stats.backends))["plain"]["speculating"] is True
