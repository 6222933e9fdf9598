"""specaudit inside LiteLLM's SDK `Router`, in front of real llama-servers: two plain and two
speculating fixture deployments of one model group, one plain one killed mid-test.

What must hold: every logprobs request (chat and text completion, streamed and not) is served
by a deployment that does not speculate and every token comes back real; other requests go to
the speculating ones; with a plain deployment dead, LiteLLM still answers from the other; with
none up, a clear 503 (or, in annotate mode, placeholders as None and counted), never a
placeholder passed off as real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import litellm
import pytest
from litellm import Router
from litellm.exceptions import ServiceUnavailableError

from litellm_helpers import LITELLM_ENV, extra_server
from specaudit import audit
from specaudit.integrations.litellm import SpecauditRouting, server_root
from specaudit.llama.build import LlamaBinaries

MSG = [{"role": "user", "content": "bcdbc"}]  # the fixture's letters
K = 3


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in LITELLM_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def handler() -> Iterator[SpecauditRouting]:
    h = SpecauditRouting(check_interval=1.0)
    saved = list(litellm.callbacks)
    litellm.callbacks = [h]
    try:
        yield h
    finally:
        litellm.callbacks = saved


@pytest.fixture(scope="module")
def spec_b(audit_ctx: audit.AuditContext, llama_bins: LlamaBinaries) -> Iterator[str]:
    with extra_server(audit_ctx, llama_bins, "fixture-spec", "litellm-spec-b") as srv:
        yield srv.url


def _router(urls: list[str]) -> Router:
    return Router(
        model_list=[
            {
                "model_name": "fx",
                "litellm_params": {
                    "model": "openai/fixture",
                    "api_base": u + "/v1",
                    "api_key": "none",
                },
            }
            for u in urls
        ],
        num_retries=3,
        retry_after=0,
    )


def _served_by(resp: Any) -> str:
    return server_root(resp._hidden_params["api_base"])


def _all_real(entries: list[Any]) -> bool:
    return bool(entries) and all(
        e.logprob is not None and e.logprob <= 0 and len(e.top_logprobs) == K for e in entries
    )


async def _chat(r: Router, **kw: Any) -> Any:
    kw.setdefault("seed", 1)
    return await r.acompletion(model="fx", messages=MSG, max_tokens=6, **kw)


async def _stream_entries(r: Router, **kw: Any) -> tuple[list[Any], int]:
    """(logprob entries, content chunks) of one streamed chat request."""
    entries: list[Any] = []
    chunks = 0
    st = await _chat(r, stream=True, **kw)
    async for ch in st:
        if ch.choices and ch.choices[0].delta.content:
            chunks += 1
            lp = ch.choices[0].logprobs
            assert lp is not None, "a streamed token reached the caller without any entry"
            entries += lp.content
    return entries, chunks


def test_router_routes_and_checks_with_a_deployment_killed(
    server: Callable[..., Any],
    audit_ctx: audit.AuditContext,
    llama_bins: LlamaBinaries,
    spec_b: str,
    handler: SpecauditRouting,
) -> None:
    plain_a, spec_a = server("fixture-plain").url, server("fixture-spec").url
    with extra_server(audit_ctx, llama_bins, "fixture-plain", "litellm-plain-b") as pb:
        plain_b = pb.url
        plains, specs = {plain_a, plain_b}, {spec_a, spec_b}
        r = _router([plain_a, plain_b, spec_a, spec_b])

        async def before_kill() -> None:
            for i in range(8):
                resp = await _chat(r, logprobs=True, top_logprobs=K, seed=i)
                assert _served_by(resp) in plains
                assert _all_real(resp.choices[0].logprobs.content)
                assert resp._hidden_params["specaudit_placeholders"] == 0
            for i in range(8):
                assert _served_by(await _chat(r, seed=i)) in specs
            entries, chunks = await _stream_entries(r, logprobs=True, top_logprobs=K)
            assert chunks == 6 and len(entries) == 6 and _all_real(entries)
            text = await r.atext_completion(model="fx", prompt="bcdbc", max_tokens=6, logprobs=K)
            assert _served_by(text) in plains
            content = text.choices[0].logprobs.content
            assert len(content) == 6
            assert all(e["logprob"] is not None and len(e["top_logprobs"]) == K for e in content)

        asyncio.run(before_kill())
        assert handler.roles[plain_a].plain and handler.roles[plain_b].plain
        assert handler.roles[spec_a].speculating and handler.roles[spec_b].speculating
        assert set(handler.stats.served_by) <= plains and handler.stats.placeholders == 0
    # plain_b is gone now; LiteLLM may still pick it before anyone knows
    assert not pb.alive()

    async def after_kill() -> None:
        for i in range(8):
            resp = await _chat(r, logprobs=True, top_logprobs=K, seed=i)
            assert _served_by(resp) == plain_a
            assert _all_real(resp.choices[0].logprobs.content)
        entries, _ = await _stream_entries(r, logprobs=True, top_logprobs=K)
        assert _all_real(entries)

    asyncio.run(after_kill())
    assert handler.roles[plain_b].state == "down"
    assert handler.stats.placeholders == 0 and handler.stats.refused == 0

    # only the dead plain deployment and the speculating ones: a clear 503, nothing served
    r2 = _router([plain_b, spec_a, spec_b])
    with pytest.raises(ServiceUnavailableError) as e:
        asyncio.run(_chat(r2, logprobs=True, top_logprobs=K))
    msg = str(e.value)
    assert e.value.status_code == 503 and "asks for logprobs" in msg
    assert f"{plain_b}: down" in msg and f"{spec_a}: speculates" in msg
    assert handler.stats.refused >= 1
    resp = asyncio.run(_chat(r2))  # requests without logprobs are still served
    assert _served_by(resp) in {spec_a, spec_b}


def test_annotate_mode_nulls_placeholders(
    server: Callable[..., Any], spec_b: str, handler: SpecauditRouting
) -> None:
    handler.on_plain_down = "annotate"
    spec_a = server("fixture-spec").url
    r = _router([spec_a, spec_b])

    async def go() -> None:
        resp = await _chat(r, logprobs=True, top_logprobs=K)
        content = resp.choices[0].logprobs.content
        ph = [e for e in content if not e.top_logprobs]
        assert ph and all(e.logprob is None for e in ph)  # never 0.0 passed off as real
        assert content[0].logprob is not None and len(content[0].top_logprobs) == K
        assert resp._hidden_params["specaudit_placeholders"] == len(ph)
        entries, chunks = await _stream_entries(r, logprobs=True, top_logprobs=K)
        assert len(entries) == chunks == 6
        missing = [e for e in entries if e.logprob is None]
        assert missing and all(e.top_logprobs == [] for e in missing)
        assert all(len(e.top_logprobs) == K for e in entries if e.logprob is not None)

    asyncio.run(go())
    assert handler.stats.annotated == 2 and handler.stats.placeholders > 0
