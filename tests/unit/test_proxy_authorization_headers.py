"""Authorization goes only to the backend that serves the request: never on the proxy's own
role checks, and no other client header is passed on (fake backends record what reached
them; tests/integration/test_proxy_security.py holds the checks against real servers)."""

from __future__ import annotations

import json
import secrets

import httpx

from fakes import Fake, serve
from proxy_helpers import TOP, request_body
from specaudit.proxy import ProxyConfig, serve_in_thread


def test_authorization_goes_to_the_backend_only() -> None:
    """The client's Authorization reaches the backend serving its request, unchanged; the
    proxy's own /slots checks never carry it."""
    token = "Bearer sk-" + secrets.token_hex(8)
    plain, spec = Fake("ok"), Fake("ok", speculative=True)
    with (
        serve(plain) as plain_srv,
        serve(spec) as spec_srv,
        serve_in_thread(ProxyConfig(plain_srv.url, spec_srv.url, port=0)) as px,
    ):
        px.check_backends()
        httpx.post(
            px.url + "/v1/completions",
            headers={"Authorization": token},
            json=request_body("completions", stream=False, logprobs=True),
            timeout=30,
        )
        httpx.post(
            px.url + "/v1/completions",
            headers={"Authorization": token},
            json=request_body("completions", stream=False, logprobs=False),
            timeout=30,
        )
        px.check_backends()
    # one request each: the logprobs one went to plain, the other to spec
    (to_plain,) = [h for h in plain.hits if h.path == "/v1/completions"]
    (to_spec,) = [h for h in spec.hits if h.path == "/v1/completions"]
    assert json.loads(to_plain.body)["logprobs"] == TOP
    assert "logprobs" not in json.loads(to_spec.body)
    gen = [to_plain, to_spec]
    assert all(h.headers.get("Authorization") == token for h in gen)
    probes = [h for f in (plain, spec) for h in f.hits if h.path in ("/health", "/slots")]
    assert probes and all("Authorization" not in h.headers for h in probes)
    # no other client header is passed on
    assert all(
        set(h.headers)
        <= {"Host", "Authorization", "Content-Type", "Content-Length", "Accept", "Accept-Encoding"}
        for h in gen
    )
