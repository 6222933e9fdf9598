"""When a generation request may reach a backend a second time (docs/proxy.md, "When a request
is sent twice"), on both transports, and that a request the forwarding core hands to aiohttp's
path is planned once.

The rule: a request is sent again only when the backend did not take it (a refused
connection: nothing was written; a 503: llama-server generated nothing) or closed a reused
kept-alive connection without a byte of answer. Anything else that goes wrong once its bytes
were written is answered by the transport that wrote them (the backend's own error, a JSON
502/504) and the request goes nowhere else.

Which transport serves: a proxy with ``total_timeout`` set hands every request to aiohttp's
path (`state.ProxyState.direct_role`); the core's counter (``fast_path_total``) confirms it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web

import fakes
from proxy_helpers import metric
from specaudit.proxy import H_BACKEND, H_FALLBACK, ProxyConfig, RunningProxy, routing
from specaudit.proxy import serve_in_thread as serve_proxy

BODY = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
TRANSPORTS = ["core", "aiohttp"]


class Backend:
    """A speculating backend whose generation endpoints answer as `answer` says; every
    generation request it receives is recorded in `hits`."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.hits: list[bytes] = []

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/health":
            return web.json_response({"status": "ok"})
        if request.path == "/slots":
            return web.json_response([{"id": 0, "speculative": True}])
        self.hits.append(await request.read())
        if self.answer == "error":
            return web.json_response(
                {"error": {"message": "context too long", "code": 400}}, status=400
            )
        if self.answer == "503":
            return web.json_response(
                {"error": {"message": "Loading model", "code": 503}}, status=503
            )
        if self.answer == "not-json":
            return web.Response(body=b"<html>oops</html>", content_type="text/html")
        if self.answer == "close":
            assert request.transport is not None
            request.transport.abort()  # took the request, then went away without a byte
            await asyncio.sleep(1)
        return web.json_response({"choices": [{"index": 0, "text": "a"}]})


@contextlib.contextmanager
def rig(answer: str, transport: str) -> Iterator[tuple[RunningProxy, Backend, fakes.Fake]]:
    plain_fake = fakes.Fake("ok")
    spec = Backend(answer)
    with (
        fakes.serve(plain_fake) as plain,
        fakes.serve(spec) as spec_served,
        serve_proxy(
            ProxyConfig(
                plain.url,
                spec_served.url,
                port=0,
                check_interval=3600,
                total_timeout=60.0 if transport == "aiohttp" else None,
            )
        ) as p,
    ):
        yield p, spec, plain_fake


def generations(fake: fakes.Fake) -> int:
    return sum(1 for h in fake.hits if h.path.startswith("/v1/"))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_backend_error_status_is_relayed_and_never_re_sent(transport: str) -> None:
    with rig("error", transport) as (p, spec, plain):
        r = httpx.post(p.url + "/v1/completions", content=BODY)
        assert r.status_code == 400 and r.json()["error"]["message"] == "context too long"
        assert r.headers[H_BACKEND] == "spec"
        # counted once, by the transport that answered
        reqs = metric(p, "requests_total")
        assert sum(reqs.values()) == 1 and next(iter(reqs)).endswith('status="400"}')
        expected = {'{outcome="served"}': 1} if transport == "core" else {}
        assert metric(p, "fast_path_total") == expected
    assert len(spec.hits) == 1 and generations(plain) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_answer_that_is_not_json_is_a_502_and_never_re_sent(transport: str) -> None:
    with rig("not-json", transport) as (p, spec, plain):
        r = httpx.post(p.url + "/v1/completions", content=BODY)
        assert r.status_code == 502 and r.json()["error"]["code"] == 502
        assert "not JSON" in r.json()["error"]["message"]
    assert len(spec.hits) == 1 and generations(plain) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_connection_closed_before_any_answer_is_a_502_and_never_re_sent(transport: str) -> None:
    """The backend read the request and closed a fresh connection: it may be generating, so
    the request goes to no backend again (not this one, not the other)."""
    with rig("close", transport) as (p, spec, plain):
        r = httpx.post(p.url + "/v1/completions", content=BODY, timeout=20)
        assert r.status_code == 502 and r.json()["error"]["code"] == 502
        assert "not re-sent" in r.json()["error"]["message"]
    assert len(spec.hits) == 1 and generations(plain) == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_503_goes_to_the_other_backend_planned_once(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-server's 503 means it did not take the request: the plain backend serves it
    (a fallback, as for a backend that is down), and the request is planned once."""
    plans: list[Any] = []
    plan = routing.plan

    def counting(*a: Any) -> routing.Plan:
        plans.append(a)
        return plan(*a)

    monkeypatch.setattr(routing, "plan", counting)
    with rig("503", transport) as (p, spec, plain):
        r = httpx.post(p.url + "/v1/completions", content=BODY)
        assert r.status_code == 200, r.text
        assert r.headers[H_BACKEND] == "plain" and r.headers[H_FALLBACK] == "spec-down"
        expected = {'{outcome="given_back"}': 1} if transport == "core" else {}
        assert metric(p, "fast_path_total") == expected
    assert len(spec.hits) == 1 and generations(plain) == 1
    assert len(plans) == 1


def test_a_refused_connection_is_handed_over_with_its_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing was written to the backend: aiohttp's path serves the request from the plan the
    core made (falling back to the plain backend) and does not try the refused one again."""
    plans: list[Any] = []
    plan = routing.plan

    def counting(*a: Any) -> routing.Plan:
        plans.append(a)
        return plan(*a)

    monkeypatch.setattr(routing, "plan", counting)
    plain_fake = fakes.Fake("ok")
    with contextlib.ExitStack() as spec_stack, fakes.serve(plain_fake) as plain:
        spec = spec_stack.enter_context(fakes.serve(fakes.Fake("ok", speculative=True)))
        with serve_proxy(ProxyConfig(plain.url, spec.url, port=0, check_interval=3600)) as p:
            assert p.stats().backends["spec"]["state"] == "up"
            spec_stack.close()  # the speculating backend is gone; the proxy does not know yet
            r = httpx.post(p.url + "/v1/completions", content=BODY)
            assert r.status_code == 200, r.text
            assert r.headers[H_BACKEND] == "plain" and r.headers[H_FALLBACK] == "spec-down"
            assert metric(p, "fast_path_total") == {'{outcome="given_back"}': 1}
    assert generations(plain_fake) == 1
    assert len(plans) == 1


@pytest.mark.parametrize(
    ("body", "status"),
    [(BODY, 200), (json.dumps({"prompt": "a", "max_tokens": "x"}).encode(), 400)],
    ids=["planned", "refused-by-routing"],
)
def test_a_request_handed_over_is_never_planned_twice(
    body: bytes, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core plans every request it reads whole; one it hands over (here: its backend is
    not known to be up; or routing refused it) carries that plan (or refusal) along."""
    plans: list[Any] = []
    plan = routing.plan

    def counting(*a: Any) -> routing.Plan:
        plans.append(a)
        return plan(*a)

    monkeypatch.setattr(routing, "plan", counting)
    with (
        fakes.serve(fakes.Fake("ok")) as plain,
        serve_proxy(ProxyConfig(plain.url, "http://127.0.0.1:9", port=0, check_interval=3600)) as p,
    ):
        r = httpx.post(p.url + "/v1/completions", content=body)
        assert r.status_code == status, r.text
    assert len(plans) == 1
