"""The LiteLLM callback without a llama-server: which requests ask for logprobs, the token
check on LiteLLM's own response objects (pydantic) and on plain dicts, the routing decision,
LiteLLM's synchronous selection under the callback (a real `Router`, roles set by hand), and
the background role checks (against a closed port and a port that never answers). The
routing and the checks in front of real llama-servers: tests/integration/test_litellm_*.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from lazy_module import LazyModule
from specaudit.llama.server import free_port

if TYPE_CHECKING:
    import litellm
    from litellm import Router, exceptions
    from litellm.types import utils as lt
    from litellm.types.utils import ChatCompletionTokenLogprob, ModelResponse

    from specaudit.integrations import litellm as sa
    from specaudit.integrations import litellm_wrappers
else:  # imported by the first test that uses them: collecting the suite skips LiteLLM (6 s)
    litellm = LazyModule("litellm")
    exceptions = LazyModule("litellm.exceptions")
    lt = LazyModule("litellm.types.utils")
    sa = LazyModule("specaudit.integrations.litellm")
    litellm_wrappers = LazyModule("specaudit.integrations.litellm_wrappers")


@pytest.mark.parametrize(
    ("request_", "n"),
    [
        ({"messages": [], "logprobs": True, "top_logprobs": 3}, 3),
        ({"messages": [], "logprobs": True}, 20),  # llama-server's default top_logprobs
        ({"messages": [], "logprobs": False}, 0),
        ({"messages": []}, 0),
        ({"prompt": "x", "logprobs": 2}, 2),
        ({"prompt": "x", "logprobs": 0}, 0),
        ({"prompt": "x", "n_probs": 4}, 4),
        # chat without logprobs: true: llama-server computes none, but it still asks
        ({"messages": [], "top_logprobs": 2}, 0),
    ],
)
def test_requested(request_: dict, n: int) -> None:
    assert sa.requested(request_) == n
    assert sa.wants(request_) == (n > 0 or "top_logprobs" in request_)


def _entry(k: int) -> ChatCompletionTokenLogprob:
    tops = [lt.TopLogprob(token="a", bytes=[97], logprob=-0.5) for _ in range(k)]
    return lt.ChatCompletionTokenLogprob(token="a", bytes=[97], logprob=0.0, top_logprobs=tops)


def test_check_entries_nulls_placeholders_only() -> None:
    entries = [_entry(3), _entry(0), _entry(3), _entry(0)]
    assert sa.check_entries(entries, 3) == (4, 2)
    assert [e.logprob for e in entries] == [0.0, None, 0.0, None]  # 0.0 with candidates is real


def test_check_response_dicts_and_legacy() -> None:
    body: dict[str, Any] = {
        "choices": [
            {"logprobs": {"content": [{"logprob": 0.0, "top_logprobs": []}]}},
            {
                "logprobs": {
                    "tokens": ["a", "b"],
                    "token_logprobs": [0.0, -1.0],
                    "top_logprobs": [{}, {"b": -1.0}],
                }
            },
            {"logprobs": None},
        ]
    }
    assert sa.check_response(body, 1) == (3, 2)
    assert body["choices"][0]["logprobs"]["content"][0]["logprob"] is None
    assert body["choices"][1]["logprobs"]["token_logprobs"] == [None, -1.0]


def test_check_chunk_adds_the_missing_entry() -> None:
    chunk = lt.ModelResponseStream(choices=[lt.StreamingChoices(delta=lt.Delta(content="c"))])
    assert sa.check_chunk(chunk, 3) == (1, 1)
    lp = chunk.choices[0].logprobs
    assert lp is not None and lp.content is not None
    # read as data: LiteLLM types `logprob` as a float, and a placeholder's is None
    entry = lp.content[0].model_dump()
    assert entry["token"] == "c" and entry["logprob"] is None
    assert entry["top_logprobs"] == []
    assert '"logprob":null' in chunk.model_dump_json().replace(" ", "")
    real = lt.ModelResponseStream(
        choices=[
            lt.StreamingChoices(
                delta=lt.Delta(content="a"), logprobs=lt.ChoiceLogprobs(content=[_entry(3)])
            )
        ]
    )
    assert sa.check_chunk(real, 3) == (1, 0)
    empty = lt.ModelResponseStream(choices=[lt.StreamingChoices(delta=lt.Delta(content=None))])
    assert sa.check_chunk(empty, 3) == (0, 0)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="on_plain_down"):
        sa.SpecauditRouting(on_plain_down="ignore")
    with pytest.raises(ValueError, match="> 0"):
        sa.SpecauditRouting(check_interval=0)


def test_server_root() -> None:
    assert sa.server_root("http://h:1/v1/") == "http://h:1"


# ---------------------------------------------------------------------------------------------
# the routing decision and LiteLLM's synchronous selection

PLAIN, PLAIN2, SPEC, DEAD = (f"http://127.0.0.1:{free_port()}" for _ in range(4))
MSG = [{"role": "user", "content": "x"}]
LOGPROBS = {"logprobs": True, "top_logprobs": 3}


def _dep(url: str) -> dict:
    return {"litellm_params": {"api_base": url + "/v1"}, "model_info": {"id": url}}


def _roles() -> dict[str, sa.Role]:
    return {
        PLAIN: sa.Role(PLAIN, "up", False),
        PLAIN2: sa.Role(PLAIN2, "up", False),
        SPEC: sa.Role(SPEC, "up", True),
        DEAD: sa.Role(DEAD, "down", None, "connection refused"),
    }


@pytest.fixture
def registered() -> Iterator[Callable[..., sa.SpecauditRouting]]:
    """``registered(**options)``: a handler in ``litellm.callbacks``, closed afterwards."""
    made: list[sa.SpecauditRouting] = []
    saved = list(litellm.callbacks)

    def make(**kw: Any) -> sa.SpecauditRouting:
        h = sa.SpecauditRouting(**kw)
        litellm.callbacks = [h]
        made.append(h)
        return h

    try:
        yield make
    finally:
        litellm.callbacks = saved
        for h in made:
            h.close()
            assert not h.checking


def test_choose() -> None:
    h = sa.SpecauditRouting()
    h.roles = _roles()
    deps = [_dep(u) for u in (PLAIN, SPEC, DEAD)]
    roles: list[sa.Role | None] = [h.roles[u] for u in (PLAIN, SPEC, DEAD)]
    assert h.choose("g", deps, roles, {"messages": MSG, **LOGPROBS}) == [deps[0]]
    assert h.choose("g", deps, roles, {"messages": MSG}) == [deps[1]]  # speculating preferred
    with pytest.raises(exceptions.ServiceUnavailableError) as e:
        h.choose("g", deps[1:], roles[1:], {"prompt": "x", "logprobs": 2})
    assert e.value.status_code == 503
    assert f"{SPEC}: speculates" in str(e.value) and f"{DEAD}: down (connection refused)" in str(
        e.value
    )
    h.on_plain_down = "annotate"
    assert h.choose("g", deps[1:], roles[1:], {"messages": MSG, **LOGPROBS}) == [deps[1]]
    assert (h.stats.logprobs_requests, h.stats.refused, h.stats.annotated) == (3, 1, 1)
    # a role not read yet is no plain deployment: the 503 says so
    with pytest.raises(exceptions.ServiceUnavailableError, match="not checked yet"):
        sa.SpecauditRouting().choose("g", deps[:1], [sa.Role(PLAIN)], {"messages": MSG, **LOGPROBS})


def _router(urls: list[str]) -> Router:
    return litellm.Router(
        model_list=[
            {
                "model_name": "g",
                "litellm_params": {"model": "openai/x", "api_base": u + "/v1", "api_key": "k"},
                "model_info": {"id": u},
            }
            for u in urls
        ]
    )


def _picks(r: Router, n: int = 30, **request: object) -> set[str]:
    return {
        r.get_available_deployment(model="g", messages=MSG, request_kwargs=dict(request))[
            "model_info"
        ]["id"]
        for _ in range(n)
    }


def test_sync_selection_routes(registered: Callable[..., sa.SpecauditRouting]) -> None:
    h = registered(check_interval=3600)
    h.roles = _roles()  # known: the Router's construction reads none of them
    r = _router([PLAIN, PLAIN2, SPEC, DEAD])
    assert _picks(r, **LOGPROBS) == {PLAIN, PLAIN2}
    assert _picks(r) == {SPEC}
    # LiteLLM's own exclusions (weighted failover) are kept, ours added
    assert _picks(r, _excluded_deployment_ids=[PLAIN], **LOGPROBS) == {PLAIN2}
    # the sync text path: the request comes from Router.text_completion's wrapper
    token = litellm_wrappers.SYNC_TEXT.set({"prompt": "x", "logprobs": 2})
    try:
        assert _picks(r) == {PLAIN, PLAIN2}
    finally:
        litellm_wrappers.SYNC_TEXT.reset(token)
    # a pinned deployment is left alone
    pinned = r.get_available_deployment(model=SPEC, messages=MSG, request_kwargs=dict(LOGPROBS))
    assert pinned["model_info"]["id"] == SPEC
    # no plain deployment up: the 503, or (annotate) anything not down
    r2 = _router([SPEC, DEAD])
    with pytest.raises(exceptions.ServiceUnavailableError, match="asks for logprobs"):
        r2.get_available_deployment(model="g", messages=MSG, request_kwargs=dict(LOGPROBS))
    h.on_plain_down = "annotate"
    assert _picks(r2, **LOGPROBS) == {SPEC}
    assert h.stats.role_checks == 0  # every decision above from the roles already known


def test_async_call_under_a_legacy_strategy_routes(
    registered: Callable[..., sa.SpecauditRouting],
) -> None:
    # 'usage-based-routing' (v1) has no async selector: LiteLLM's acompletion falls back to
    # the sync selection, which never runs async_filter_deployments; the wrapper routes it
    h = registered(check_interval=3600)
    h.roles = _roles()
    model_list = _router([PLAIN, SPEC]).model_list
    r = litellm.Router(model_list=model_list, routing_strategy="usage-based-routing")

    async def picks(**request: object) -> set[str]:
        got = set()
        for _ in range(30):
            d = await r.async_get_available_deployment(
                model="g", messages=MSG, request_kwargs=dict(request)
            )
            got.add(d["model_info"]["id"])
        return got

    assert asyncio.run(picks(**LOGPROBS)) == {PLAIN}
    assert asyncio.run(picks()) == {SPEC}


def _response(tops: list[int]) -> ModelResponse:
    content = [_entry(k) for k in tops]
    choice = lt.Choices(
        message=lt.Message(content="a"), logprobs=lt.ChoiceLogprobs(content=content)
    )
    resp = lt.ModelResponse(choices=[choice])
    resp._hidden_params["api_base"] = PLAIN + "/v1"
    return resp


def _content(resp: ModelResponse) -> list[ChatCompletionTokenLogprob]:
    """The first choice's logprob entries (which `_response` always sets)."""
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.content is not None
    return lp.content


def test_check_result() -> None:
    h = sa.SpecauditRouting()
    resp = _response([3, 0, 0])
    h.check_result({"messages": MSG, **LOGPROBS}, resp)
    assert [e.logprob for e in _content(resp)] == [0.0, None, None]
    assert resp._hidden_params[sa.HIDDEN_KEY] == 2
    assert (h.stats.responses_checked, h.stats.placeholders) == (1, 2)
    assert h.stats.served_by == {PLAIN: 1}
    other = _response([0])
    h.check_result({"messages": MSG}, other)  # no logprobs asked: nothing to check
    assert _content(other)[0].logprob == 0.0 and h.stats.responses_checked == 1


# ---------------------------------------------------------------------------------------------
# the background role checks


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def silent() -> Iterator[str]:
    """A server that accepts connections and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


def running(h: sa.SpecauditRouting) -> bool:
    """`h.checking` read anew: `close` and `watch` change it, which narrowing cannot see."""
    return h.checking


def test_roles_read_at_start_and_periodically_off_the_loop(
    registered: Callable[..., sa.SpecauditRouting], silent: str
) -> None:
    h = registered(check_interval=0.3, check_timeout=1.0)
    closed = f"http://127.0.0.1:{free_port()}"

    async def build_on_a_loop() -> None:
        # as in the proxy, the Router is built on the running loop: the checks of a server
        # that never answers must not hold it up (its check ends "down" after 1 s; had the
        # build or the loop waited for it, the role would no longer be unknown)
        _router([closed, silent])
        assert h.roles[silent].state == "unknown"
        await asyncio.sleep(0.05)
        assert h.roles[silent].state == "unknown"  # its check still runs, elsewhere
        assert h.checking and threading.current_thread() is not h._thread

    asyncio.run(build_on_a_loop())
    assert h.stats.logprobs_requests == h.stats.default_requests == 0
    _wait_for(lambda: h.roles[closed].state == "down" and h.roles[silent].state == "down")
    assert "timed out" in h.roles[silent].detail or "timeout" in h.roles[silent].detail.lower()
    # then every check_interval, with no request at all
    seen = h.roles[closed].checked_at
    _wait_for(lambda: h.roles[closed].checked_at > seen)
    # close() ends them: the thread is gone and nothing is read any more
    h.close()
    assert not running(h)
    n = h.stats.role_checks
    time.sleep(1.0)
    assert h.stats.role_checks == n
    # a handler taken out of litellm.callbacks stops its own checks
    h.watch([])
    assert running(h)
    litellm.callbacks = []
    _wait_for(lambda: not h.checking, timeout=3)


def test_async_filter_waits_for_a_check_without_blocking_the_loop(
    registered: Callable[..., sa.SpecauditRouting], silent: str
) -> None:
    h = registered(check_interval=3600, check_timeout=2.0)
    h.roles = {PLAIN: sa.Role(PLAIN, "up", False)}
    seen: list[str] = []  # the silent server's state at each turn of the loop

    async def ticker() -> None:
        while True:
            seen.append(h.roles[silent].state if silent in h.roles else "unread")
            await asyncio.sleep(0.05)

    async def go() -> list[dict]:
        t = asyncio.create_task(ticker())
        try:
            return await h.async_filter_deployments(
                "g", [_dep(PLAIN), _dep(silent)], MSG, dict(LOGPROBS)
            )
        finally:
            t.cancel()

    assert asyncio.run(go()) == [_dep(PLAIN)]
    assert h.roles[silent].state == "down"  # waited for
    # the loop kept turning while the filter waited for that check (a blocked loop would
    # only have run the ticker before the wait began or after the check ended)
    assert seen.count("unknown") + seen.count("unread") >= 2, seen


def test_sync_failure_hook_rechecks_before_the_retry(
    registered: Callable[..., sa.SpecauditRouting],
) -> None:
    h = registered(check_interval=3600)
    dead = f"http://127.0.0.1:{free_port()}"
    h.roles = {dead: sa.Role(dead, "up", False)}  # what /slots said before it died
    failure = {"litellm_params": {"api_base": dead + "/v1"}}

    async def on_a_loop() -> None:  # an async call: its async hook re-checks, not this one
        h.log_failure_event(failure, None, None, None)
        assert h.roles[dead].plain

    asyncio.run(on_a_loop())
    h.log_failure_event(failure, None, None, None)  # a sync call: re-checked before return
    assert h.roles[dead].state == "down"
