"""The proxy's forwarding core in front of REAL llama-servers (the session's fixture-plain and
fixture-spec): every endpoint, streamed and not, with and without logprobs, is served by the
core itself (never handed to aiohttp's path), on uvloop and on asyncio's own loop, with the
same answers aiohttp's path gives."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from proxy_helpers import PATHS, assert_nothing_fake, request_body, sse_objects
from specaudit.proxy import H_BACKEND, H_PLACEHOLDERS, ProxyConfig, serve_in_thread

Server = Callable[[str], Any]


def fast_counts(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.fullmatch(r'specaudit_proxy_fast_path_total\{outcome="(\w+)"\} (\S+)', line)
        if m:
            out[m[1]] = float(m[2])
    return out


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_every_generation_request_is_served_by_the_core(server: Server, loop: str) -> None:
    plain, spec = server("fixture-plain").url, server("fixture-spec").url
    n = 0
    with (
        serve_in_thread(ProxyConfig(plain, spec, port=0), loop) as px,
        httpx.Client(timeout=60) as c,
    ):
        for kind in ("chat", "completions", "completion"):
            for stream in (False, True):
                for lp in (False, True):
                    for _ in range(2):  # the second one rides a kept-alive connection
                        body = request_body(kind, stream=stream, logprobs=lp)
                        r = c.post(px.url + PATHS[kind], json=body)
                        n += 1
                        assert r.status_code == 200, r.text
                        assert r.headers[H_BACKEND] == ("plain" if lp else "spec")
                        objs = sse_objects(r.content) if stream else [r.json()]
                        assert objs
                        if lp:
                            tokens, nulls = assert_nothing_fake(kind, objs, stream)
                            assert tokens > 0 and nulls == 0  # plain: every value real
                            if not stream:
                                assert r.headers[H_PLACEHOLDERS] == "0"
        assert fast_counts(px.url) == {"served": n}


def test_the_core_and_aiohttps_path_give_the_same_answer(server: Server) -> None:
    """A seeded request answered by the core, then (as a chunked upload, which the core
    leaves to aiohttp) by aiohttp's path: the same body, byte for byte after the volatile
    timing fields."""
    plain, spec = server("fixture-plain").url, server("fixture-spec").url
    body = httpx.Request(
        "POST", "http://x", json=request_body("completion", stream=False, logprobs=True)
    ).content

    def strip(raw: bytes) -> bytes:
        return re.sub(rb'"timings":\{[^}]*\}', b"", raw)

    with serve_in_thread(ProxyConfig(plain, spec, port=0)) as px, httpx.Client(timeout=60) as c:
        fast = c.post(px.url + "/completion", content=body)
        slow = c.post(px.url + "/completion", content=iter([body]))  # chunked
        assert fast.status_code == slow.status_code == 200
        assert strip(fast.content) == strip(slow.content)
        assert fast_counts(px.url) == {"served": 1}
