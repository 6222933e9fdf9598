"""specaudit inside LiteLLM's SDK `Router`, in front of real llama-servers: two plain and two
speculating fixture deployments of one model group, one plain one killed mid-test.

What must hold, on the async (`acompletion`, `atext_completion`) and the synchronous
(`completion`, `text_completion`) paths alike: every deployment's role is read from /slots
when the Router is built and again every check_interval, with no request; every logprobs
request (chat and text completion, streamed and not) is served by a deployment that does not
speculate and every token comes back real; other requests go to the speculating ones; with a
plain deployment dead, LiteLLM still answers from the other (a failed call re-checks it at
once); with none up, a clear 503 (or, in annotate mode, placeholders as None and counted),
never a placeholder passed off as real.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import litellm
import pytest
from litellm import Router
from litellm.exceptions import ServiceUnavailableError

from litellm_helpers import LITELLM_ENV, extra_server
from specaudit import audit
from specaudit.integrations.litellm import Role, SpecauditRouting, server_root
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
        h.close()
        assert not h.checking  # the background checks end with the handler


@pytest.fixture(scope="module")
def spec_b(fixture_spec_b: str) -> str:
    return fixture_spec_b


def _router(urls: list[str], group: str = "fx") -> Router:
    return Router(
        model_list=[
            {
                "model_name": group,
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
    # litellm types acompletion's messages as TypedDicts and completion's as plain dicts;
    # one list serves both
    return await r.acompletion(model="fx", messages=MSG, max_tokens=6, **kw)  # type: ignore[arg-type]


def _sync_chat(r: Router, **kw: Any) -> Any:
    kw.setdefault("seed", 1)
    return r.completion(model="fx", messages=MSG, max_tokens=6, **kw)


def _sync_stream_entries(r: Router, **kw: Any) -> tuple[list[Any], int]:
    """(logprob entries, content chunks) of one streamed chat request, synchronously."""
    entries: list[Any] = []
    chunks = 0
    for ch in _sync_chat(r, stream=True, **kw):
        if ch.choices and ch.choices[0].delta.content:
            chunks += 1
            lp = ch.choices[0].logprobs
            assert lp is not None, "a streamed token reached the caller without any entry"
            entries += lp.content
    return entries, chunks


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


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


def _text_ok(resp: Any, plains: set[str]) -> None:
    assert _served_by(resp) in plains
    content = resp.choices[0].logprobs.content
    assert len(content) == 6
    assert all(e["logprob"] is not None and len(e["top_logprobs"]) == K for e in content)
    assert resp._hidden_params["specaudit_placeholders"] == 0


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
        # LiteLLM's sync Router.text_completion sends the group name as the model: only a
        # group named like a provider model works there (LiteLLM's behaviour, not ours)
        rt = _router([plain_a, plain_b, spec_a, spec_b], group="openai/fixture")

        # at start: every role read from /slots by the Router's construction, no request made
        _wait_for(lambda: all(handler.roles.get(u, Role(u)).state == "up" for u in plains | specs))
        assert handler.stats.logprobs_requests == handler.stats.default_requests == 0
        assert all(handler.roles[u].plain for u in plains)
        assert all(handler.roles[u].speculating for u in specs)
        # and again every check_interval (1 s), still with no request
        first = {u: handler.roles[u].checked_at for u in plains | specs}
        _wait_for(lambda: all(handler.roles[u].checked_at > t for u, t in first.items()))
        assert handler.stats.logprobs_requests == handler.stats.default_requests == 0

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
            _text_ok(text, plains)

        asyncio.run(before_kill())
        # the synchronous paths, routed and checked the same way
        for i in range(8):
            resp = _sync_chat(r, logprobs=True, top_logprobs=K, seed=i)
            assert _served_by(resp) in plains
            assert _all_real(resp.choices[0].logprobs.content)
            assert resp._hidden_params["specaudit_placeholders"] == 0
        for i in range(8):
            assert _served_by(_sync_chat(r, seed=i)) in specs
        entries, chunks = _sync_stream_entries(r, logprobs=True, top_logprobs=K)
        assert chunks == 6 and len(entries) == 6 and _all_real(entries)
        for i in range(4):
            text = rt.text_completion(
                model="openai/fixture", prompt="bcdbc", max_tokens=6, logprobs=K, seed=i
            )
            _text_ok(text, plains)
        assert set(handler.stats.served_by) <= plains and handler.stats.placeholders == 0
        assert handler.stats.responses_checked == 8 + 1 + 8 + 4

        # from here on no periodic check: what notices the kill is a failed call
        handler.close()
        handler.check_interval = 3600.0
    # plain_b is gone now; LiteLLM may still pick it before anyone knows
    assert not pb.alive()
    assert handler.roles[plain_b].plain  # nobody knows yet

    # only the dead plain deployment and the speculating ones: LiteLLM picks plain_b (the
    # only candidate), the call fails, the sync failure hook re-checks it before LiteLLM
    # retries, and the retry gets the 503; nothing is served
    r2 = _router([plain_b, spec_a, spec_b])
    with pytest.raises(ServiceUnavailableError) as e:
        _sync_chat(r2, logprobs=True, top_logprobs=K)
    msg = str(e.value)
    assert e.value.status_code == 503 and "asks for logprobs" in msg
    assert f"{plain_b}: down" in msg and f"{spec_a}: speculates" in msg
    assert handler.roles[plain_b].state == "down"

    # the same on the async path (its failure hook), from a stale "plain" again
    handler.roles[plain_b] = Role(plain_b, "up", False)
    with pytest.raises(ServiceUnavailableError) as e:
        asyncio.run(_chat(r2, logprobs=True, top_logprobs=K))
    assert f"{plain_b}: down" in str(e.value) and handler.roles[plain_b].state == "down"
    refused = handler.stats.refused
    assert refused >= 2
    assert _served_by(asyncio.run(_chat(r2))) in {spec_a, spec_b}  # no logprobs: served
    assert _served_by(_sync_chat(r2)) in {spec_a, spec_b}

    async def after_kill() -> None:
        for i in range(8):
            resp = await _chat(r, logprobs=True, top_logprobs=K, seed=i)
            assert _served_by(resp) == plain_a
            assert _all_real(resp.choices[0].logprobs.content)
        entries, _ = await _stream_entries(r, logprobs=True, top_logprobs=K)
        assert _all_real(entries)

    asyncio.run(after_kill())
    for i in range(8):
        resp = _sync_chat(r, logprobs=True, top_logprobs=K, seed=i)
        assert _served_by(resp) == plain_a
        assert _all_real(resp.choices[0].logprobs.content)
    entries, _ = _sync_stream_entries(r, logprobs=True, top_logprobs=K)
    assert _all_real(entries)
    assert handler.stats.placeholders == 0 and handler.stats.refused == refused

    # the periodic check notices a change with no request at all
    handler.close()  # the checker sleeping its 3600 s ends; the next one runs every 0.5 s
    handler.roles[plain_b] = Role(plain_b, "up", False)
    handler.check_interval = 0.5
    handler.watch([])  # (re)starts the background checks
    _wait_for(lambda: handler.roles[plain_b].state == "down")


def test_sync_router_without_a_plain_deployment(
    server: Callable[..., Any], spec_b: str, handler: SpecauditRouting
) -> None:
    spec_a = server("fixture-spec").url
    r = _router([spec_a, spec_b])
    rt = _router([spec_a, spec_b], group="openai/fixture")
    with pytest.raises(ServiceUnavailableError) as e:
        _sync_chat(r, logprobs=True, top_logprobs=K)
    assert e.value.status_code == 503 and f"{spec_a}: speculates" in str(e.value)
    with pytest.raises(ServiceUnavailableError):
        _sync_chat(r, logprobs=True, top_logprobs=K, stream=True)
    with pytest.raises(ServiceUnavailableError):
        rt.text_completion(model="openai/fixture", prompt="bcdbc", max_tokens=6, logprobs=K)
    assert handler.stats.refused >= 3 and handler.stats.responses_checked == 0
    assert _served_by(_sync_chat(r)) in {spec_a, spec_b}  # no logprobs: served


def test_annotate_mode_nulls_placeholders(
    server: Callable[..., Any], spec_b: str, handler: SpecauditRouting
) -> None:
    handler.on_plain_down = "annotate"
    spec_a = server("fixture-spec").url
    r = _router([spec_a, spec_b])
    rt = _router([spec_a, spec_b], group="openai/fixture")

    def nulled(content: list[Any], resp: Any) -> None:
        ph = [e for e in content if not e.top_logprobs]
        assert ph and all(e.logprob is None for e in ph)  # never 0.0 passed off as real
        assert content[0].logprob is not None and len(content[0].top_logprobs) == K
        assert resp._hidden_params["specaudit_placeholders"] == len(ph)

    def streamed(entries: list[Any], chunks: int) -> None:
        assert len(entries) == chunks == 6
        missing = [e for e in entries if e.logprob is None]
        assert missing and all(e.top_logprobs == [] for e in missing)
        assert all(len(e.top_logprobs) == K for e in entries if e.logprob is not None)

    async def go() -> None:
        resp = await _chat(r, logprobs=True, top_logprobs=K)
        nulled(resp.choices[0].logprobs.content, resp)
        streamed(*await _stream_entries(r, logprobs=True, top_logprobs=K))

    asyncio.run(go())
    assert handler.stats.annotated == 2 and handler.stats.placeholders > 0

    # synchronously: the same nulls and counts
    resp = _sync_chat(r, logprobs=True, top_logprobs=K)
    nulled(resp.choices[0].logprobs.content, resp)
    streamed(*_sync_stream_entries(r, logprobs=True, top_logprobs=K))
    text = rt.text_completion(model="openai/fixture", prompt="bcdbc", max_tokens=6, logprobs=K)
    content = text.choices[0].logprobs.content
    ph = [e for e in content if not e["top_logprobs"]]
    assert ph and all(e["logprob"] is None for e in ph)
    assert text._hidden_params["specaudit_placeholders"] == len(ph)
    assert handler.stats.annotated == 5
