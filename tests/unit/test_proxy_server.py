"""The in-process proxy's own answers when no backend is reachable (error paths only; the
real-backend behaviour is in tests/integration/test_proxy_*.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from specaudit.llama import free_port
from specaudit.proxy import ProxyConfig, RunningProxy, serve_in_thread


@pytest.fixture(scope="module")
def px() -> Iterator[RunningProxy]:
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with serve_in_thread(ProxyConfig(dead[0], dead[1], port=0, check_interval=3600)) as p:
        yield p


def test_listens_on_loopback_by_default(px: RunningProxy) -> None:
    assert px.url.startswith("http://127.0.0.1:")


def test_health_when_both_backends_are_down(px: RunningProxy) -> None:
    r = httpx.get(px.url + "/health")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "down" and body["logprobs_requests_served_by"] is None
    assert {b["state"] for b in body["backends"].values()} == {"down"}
    assert all(b["detail"] == "connection refused" for b in body["backends"].values())


def test_own_endpoints_take_get_only(px: RunningProxy) -> None:
    for path in ("/health", "/metrics"):
        r = httpx.post(px.url + path, content=b"{}")
        assert r.status_code == 405 and "takes GET" in r.json()["error"]["message"]


def test_no_backend_is_a_503_with_both_reasons(px: RunningProxy) -> None:
    r = httpx.post(px.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "unavailable_error" and err["code"] == 503
    assert "plain connection refused" in err["message"]
    assert "spec connection refused" in err["message"]
    r = httpx.post(px.url + "/v1/completions", json={"prompt": "a", "logprobs": 1})
    assert r.status_code == 503 and "asks for logprobs" in r.json()["error"]["message"]


def test_metrics_are_prometheus_text(px: RunningProxy) -> None:
    httpx.post(px.url + "/v1/completions", content=b"nope")
    r = httpx.get(px.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'specaudit_proxy_errors_total{kind="bad_request"}' in r.text
    assert 'specaudit_proxy_backend_up{backend="plain"} 0' in r.text
    assert 'specaudit_proxy_backend_speculating{backend="spec"} -1' in r.text


def test_a_scrape_does_not_count_itself_in_flight(px: RunningProxy) -> None:
    """`specaudit_proxy_in_flight` counts requests being served; the /metrics request that
    reads it (or a /health check) is the proxy answering about itself, not one of them."""
    httpx.get(px.url + "/health")
    r = httpx.get(px.url + "/metrics")
    assert "\nspecaudit_proxy_in_flight 0\n" in r.text
