"""specaudit.proxy pure parts: routing, placeholder rewriting, SSE cutting, config, metrics,
role assessment. Placeholder tests run on responses recorded from real llama-servers
(tests/data/responses/fixture-{plain,spec}-*)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specaudit import logprobs
from specaudit.proxy import backends, config, metrics, routing, sse
from specaudit.proxy.placeholders import check_body, check_event
from specaudit.proxy.routing import Kind, RequestError, Route

DATA = Path(__file__).parent.parent / "data" / "responses"


def plan(kind: Kind, body: object) -> routing.Plan:
    return routing.plan(kind, json.dumps(body).encode())


CHAT = {"messages": [{"role": "user", "content": "abc"}]}
PROMPT = {"prompt": "abc"}

# --------------------------------------------------------------------------------- routing


@pytest.mark.parametrize(
    ("kind", "extra", "route", "requested"),
    [
        (Kind.CHAT, {}, Route.DEFAULT, 0),
        (Kind.CHAT, {"logprobs": False}, Route.DEFAULT, 0),
        (Kind.CHAT, {"logprobs": True}, Route.LOGPROBS, 20),  # llama-server's default
        (Kind.CHAT, {"logprobs": True, "top_logprobs": 3}, Route.LOGPROBS, 3),
        (Kind.CHAT, {"logprobs": True, "top_logprobs": 0}, Route.LOGPROBS, 0),
        (Kind.CHAT, {"top_logprobs": 2}, Route.LOGPROBS, 0),  # llama-server answers 400
        (Kind.CHAT, {"n_probs": 4}, Route.LOGPROBS, 4),
        (Kind.CHAT, {"logprobs": 5}, Route.LOGPROBS, 5),  # copied through as n_probs alias
        (Kind.CHAT, {"n_probs": 0, "logprobs": None}, Route.DEFAULT, 0),
        (Kind.COMPLETIONS, {}, Route.DEFAULT, 0),
        (Kind.COMPLETIONS, {"logprobs": 2}, Route.LOGPROBS, 2),
        (Kind.COMPLETIONS, {"logprobs": True}, Route.LOGPROBS, 1),
        (Kind.COMPLETIONS, {"logprobs": 0}, Route.DEFAULT, 0),
        (Kind.COMPLETIONS, {"n_probs": 3, "logprobs": 1}, Route.LOGPROBS, 3),
        (Kind.COMPLETION, {"n_probs": 2}, Route.LOGPROBS, 2),
        (Kind.COMPLETION, {"n_probs": 0}, Route.DEFAULT, 0),
        (Kind.COMPLETION, {"n_probs": 2, "post_sampling_probs": True}, Route.LOGPROBS, 2),
        (Kind.COMPLETION, {"post_sampling_probs": True}, Route.DEFAULT, 0),
    ],
)
def test_routing_rule(kind: Kind, extra: dict, route: Route, requested: int) -> None:
    base = CHAT if kind is Kind.CHAT else PROMPT
    p = plan(kind, {**base, **extra})
    assert p.route is route
    assert p.requested == requested


def test_plan_keeps_body_bytes_and_stream_flag() -> None:
    raw = b'{"prompt": "abc",   "stream": true, "n_probs": 1}'
    p = routing.plan(Kind.COMPLETION, raw)
    assert p.body == raw  # forwarded unchanged, whitespace and all
    assert p.stream and p.route is Route.LOGPROBS


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2]", "must be a JSON object, got array"),
        (b"null", "got null"),
        (b"[" * 100_000, "nested too deeply"),
        (b'{"messages": 5}', "'messages' must be an array"),
        (b'{"messages": []}', "must not be empty"),
        (b'{"messages": [1]}', "messages[0]"),
        (b'{"messages": [{"content": "a"}]}', "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"prompt": "a"}', "'messages' is required"),
        (b'{"messages": [{"role":"user","content":"a"}], "stream": "yes"}', "'stream'"),
        (b'{"messages": [{"role":"user","content":"a"}], "logprobs": "true"}', "'logprobs'"),
        (b'{"messages": [{"role":"user","content":"a"}], "logprobs": -1}', "'logprobs'"),
        (b'{"messages": [{"role":"user","content":"a"}], "top_logprobs": 1.5}', "top_logprobs"),
        (b'{"messages": [{"role":"user","content":"a"}], "n_probs": []}', "'n_probs'"),
        (b'{"messages": [{"role":"user","content":"a"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role":"user","content":"a"}], "max_tokens": 1e3}', "max_tokens"),
        (b'{"messages": [{"role":"user","content":"a"}], "stop": [1]}', "'stop'"),
    ],
)
def test_chat_bodies_refused_with_a_message(raw: bytes, needle: str) -> None:
    with pytest.raises(RequestError) as ei:
        routing.plan(Kind.CHAT, raw)
    assert ei.value.status == 400
    assert needle in ei.value.message


def test_native_completion_needs_a_prompt() -> None:
    with pytest.raises(RequestError, match="'prompt' is required"):
        routing.plan(Kind.COMPLETION, b"{}")
    with pytest.raises(RequestError, match="'prompt' must be"):
        routing.plan(Kind.COMPLETIONS, b'{"prompt": 5}')
    assert routing.plan(Kind.COMPLETIONS, b'{"prompt": [1, 2, 3]}').route is Route.DEFAULT


def test_bool_is_not_an_integer() -> None:
    with pytest.raises(RequestError, match="top_logprobs"):
        plan(Kind.CHAT, {**CHAT, "logprobs": True, "top_logprobs": True})


# ---------------------------------------------------------------------------- placeholders


def load(name: str) -> dict[str, Any]:
    """A recorded response body (always a JSON object)."""
    body = json.loads((DATA / name).read_text())
    assert isinstance(body, dict), name
    return body


def events(name: str) -> list[bytes]:
    evs, rest = sse.split_events((DATA / name).read_bytes())
    assert rest == b""
    return evs


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("chat-logprobs2", Kind.CHAT),
        ("completions-logprobs2", Kind.COMPLETIONS),
        ("completion-n_probs2", Kind.COMPLETION),
        ("completion-n_probs2-post", Kind.COMPLETION),
    ],
)
def test_recorded_spec_body_placeholders_become_null(name: str, kind: Kind) -> None:
    body = load(f"fixture-spec-{name}.json")
    t = check_body(kind, body, requested=2)
    assert t.tokens == 6
    assert t.placeholders == 5  # every token after the first came from the speculative loop
    recs = logprobs.from_response(kind.value, body, 2)
    assert [r.reported_logprob for r in recs][1:] == [None] * 5
    assert recs[0].klass is logprobs.TokenClass.REAL
    # nothing a client could average is left on the rewritten tokens
    assert logprobs.values(recs, logprobs.Missing.NAIVE)[1:] == [0.0] * 5


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("chat-logprobs2", Kind.CHAT),
        ("completions-logprobs2", Kind.COMPLETIONS),
        ("completion-n_probs2", Kind.COMPLETION),
        ("completion-n_probs2-post", Kind.COMPLETION),
    ],
)
def test_recorded_plain_body_is_left_alone(name: str, kind: Kind) -> None:
    body = load(f"fixture-plain-{name}.json")
    before = json.dumps(body)
    t = check_body(kind, body, requested=2)
    assert (t.tokens, t.placeholders) == (6, 0)
    assert json.dumps(body) == before


def test_post_sampling_placeholder_prob_becomes_null() -> None:
    body = load("fixture-spec-completion-n_probs2-post.json")
    check_body(Kind.COMPLETION, body, requested=2)
    probs = body["completion_probabilities"]
    assert probs[0]["prob"] > 0
    assert all(e["prob"] is None and "logprob" not in e for e in probs[1:])


@pytest.mark.parametrize(
    ("name", "kind", "post"),
    [
        ("chat-logprobs2", Kind.CHAT, False),
        ("completions-logprobs2", Kind.COMPLETIONS, False),
        ("completion-n_probs2", Kind.COMPLETION, False),
        ("completion-n_probs2-post", Kind.COMPLETION, True),
    ],
)
def test_recorded_spec_stream_missing_entries_are_added_as_null(
    name: str, kind: Kind, post: bool
) -> None:
    total = 0
    rewritten: list[dict] = []
    for ev in events(f"fixture-spec-{name}-stream.sse"):
        obj = sse.parse_event(ev)
        if not isinstance(obj, dict):
            continue
        t = check_event(kind, obj, 2, post)
        total += t.placeholders
        if t.placeholders:
            rewritten.append(obj)
    assert total == 5
    recs = logprobs.from_stream(kind.value, rewritten, 2)
    assert len(recs) == 5
    assert all(r.klass is logprobs.TokenClass.PLACEHOLDER and r.logprob is None for r in recs)
    key = "prob" if post else "logprob"
    for obj in rewritten:
        entries = (
            obj["completion_probabilities"]
            if kind is Kind.COMPLETION
            else obj["choices"][0]["logprobs"]["content"]
        )
        assert entries[0][key] is None


@pytest.mark.parametrize(
    "name",
    ["chat-logprobs2", "completions-logprobs2", "completion-n_probs2", "completion-n_probs2-post"],
)
def test_recorded_plain_stream_passes_untouched(name: str) -> None:
    kind = (
        Kind.CHAT
        if name.startswith("chat")
        else (Kind.COMPLETIONS if name.startswith("completions") else Kind.COMPLETION)
    )
    n = 0
    for ev in events(f"fixture-plain-{name}-stream.sse"):
        obj = sse.parse_event(ev)
        if isinstance(obj, dict):
            t = check_event(kind, obj, 2, name.endswith("post"))
            assert t.placeholders == 0
            n += t.tokens
    assert n == 6


def test_nothing_checked_when_no_candidates_requested() -> None:
    body = load("fixture-spec-chat-logprobs2.json")
    assert check_body(Kind.CHAT, body, requested=0).tokens == 0
    for ev in events("fixture-spec-chat-nologprobs-stream.sse"):
        obj = sse.parse_event(ev)
        if isinstance(obj, dict):
            assert check_event(Kind.CHAT, obj, 0).placeholders == 0
            assert "logprobs" not in obj["choices"][0]


def test_native_stream_event_with_several_token_ids() -> None:
    ev: dict[str, Any] = {"content": "ab", "tokens": [0, 1], "stop": False}
    t = check_event(Kind.COMPLETION, ev, 3)
    assert (t.tokens, t.placeholders) == (2, 2)
    assert [e["id"] for e in ev["completion_probabilities"]] == [0, 1]
    final = {"content": "", "tokens": [], "stop": True}
    assert check_event(Kind.COMPLETION, final, 3).tokens == 0
    assert "completion_probabilities" not in final


def test_legacy_completions_form() -> None:
    body: dict[str, Any] = {
        "choices": [
            {
                "text": "ab",
                "logprobs": {
                    "tokens": ["a", "b"],
                    "token_logprobs": [-0.5, 0.0],
                    "top_logprobs": [{"a": -0.5, "b": -1.0}, {}],
                },
            }
        ]
    }
    t = check_body(Kind.COMPLETIONS, body, 2)
    assert (t.tokens, t.placeholders) == (2, 1)
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, None]


def test_several_choices_are_all_checked() -> None:
    entry_real = {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}]}
    entry_ph = {"token": "b", "logprob": 0.0, "top_logprobs": []}
    body = {
        "choices": [
            {"index": 0, "logprobs": {"content": [dict(entry_real), dict(entry_ph)]}},
            {"index": 1, "logprobs": {"content": [dict(entry_ph)]}},
        ]
    }
    assert check_body(Kind.CHAT, body, 1).placeholders == 2


# ------------------------------------------------------------------------------------- sse


def test_split_events_keeps_bytes_and_rest() -> None:
    buf = b'data: {"a":1}\n\ndata: [DONE]\n\ndata: {"b"'
    evs, rest = sse.split_events(buf)
    assert evs == [b'data: {"a":1}\n\n', b"data: [DONE]\n\n"]
    assert rest == b'data: {"b"'
    assert b"".join(evs) + rest == buf


def test_split_events_crlf_and_comments() -> None:
    buf = b"data: 1\r\n\r\n:\n\ndata: 2\n\n"
    evs, rest = sse.split_events(buf)
    assert evs == [b"data: 1\r\n\r\n", b":\n\n", b"data: 2\n\n"] and rest == b""
    assert sse.parse_event(evs[1]) is None  # llama-server's keep-alive ping


def test_parse_event_rejects_garbage() -> None:
    with pytest.raises(sse.BadEvent):
        sse.parse_event(b"hello world\n\n")
    with pytest.raises(sse.BadEvent):
        sse.parse_event(b"data: {not json\n\n")
    assert sse.parse_event(b'event: x\ndata: {"a": 1}\n\n') == {"a": 1}


def test_encode_event_is_compact_like_llama_server() -> None:
    assert sse.encode_event({"a": None, "b": "é"}) == 'data: {"a":null,"b":"é"}\n\n'.encode()


# ---------------------------------------------------------------------------------- config


def test_backend_urls_are_normalised_and_checked() -> None:
    assert config.backend_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080"
    assert config.backend_url("http://h:1/prefix/") == "http://h:1/prefix"
    for bad, why in (
        ("127.0.0.1:8080", "must start with http:// or https://"),
        ("ftp://h", "must start with http:// or https://"),
        ("http://user:pw@h:1", "must not carry credentials"),
        ("http://h:1/?x=1", "must not have a query or fragment"),
        ("http://", "has no host"),
        ("http://h:99999", "has an invalid port"),
    ):
        with pytest.raises(config.ProxyError, match=why):
            config.backend_url(bad)


def test_listen_parsing_defaults_to_loopback() -> None:
    assert config.parse_listen("8081") == ("127.0.0.1", 8081)
    assert config.parse_listen(":0") == ("127.0.0.1", 0)
    assert config.parse_listen("0.0.0.0:9") == ("0.0.0.0", 9)
    assert config.parse_listen("[::1]:9") == ("::1", 9)
    for bad, why in (
        ("host:", "--listen port must be a number"),
        ("h:99999", "--listen port must be a number"),
        ("[::1]9", "--listen must be HOST:PORT"),
    ):
        with pytest.raises(config.ProxyError, match=why):
            config.parse_listen(bad)
    c = config.ProxyConfig("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert c.host == "127.0.0.1" and c.loopback
    assert "api_key" not in repr(
        config.ProxyConfig("http://a:1", "http://b:2", plain_api_key="sekrit")
    )


def test_config_rejects_nonsense() -> None:
    with pytest.raises(config.ProxyError, match="read-timeout must be positive"):
        config.ProxyConfig("http://a:1", "http://b:2", read_timeout=0)
    with pytest.raises(config.ProxyError, match="port 70000 is out of range"):
        config.ProxyConfig("http://a:1", "http://b:2", port=70000)
    with pytest.raises(ValueError, match="'ignore' is not a valid"):
        config.ProxyConfig("http://a:1", "http://b:2", on_plain_down="ignore")  # type: ignore[arg-type]  # on purpose


# --------------------------------------------------------------------------------- metrics


def test_prometheus_text() -> None:
    m = metrics.Metrics()
    m.requests.inc("/v1/completions", "logprobs", "plain", "200")
    m.requests.inc("/v1/completions", "logprobs", "plain", "200")
    m.placeholders.inc("spec", by=5)
    m.backend_up.set("plain", value=1)
    text = m.render()
    assert (
        'specaudit_proxy_requests_total{endpoint="/v1/completions",route="logprobs",'
        'backend="plain",status="200"} 2'
    ) in text
    assert 'specaudit_proxy_placeholders_caught_total{backend="spec"} 5' in text
    assert "# TYPE specaudit_proxy_errors_total counter" in text
    for line in text.splitlines():
        assert line.startswith("#") or line.startswith("specaudit_proxy_")


# ---------------------------------------------------------------------------- role checks


def status(role: str) -> backends.BackendStatus:
    return backends.BackendStatus(role, "http://x:1")


def state(s: backends.BackendStatus) -> backends.State:
    """`s.state` read anew: `assess` changes `s` in place, which narrowing cannot see."""
    return s.state


def test_plain_that_speculates_is_unusable() -> None:
    s = status("plain")
    backends.assess(s, backends.Probe(True, 200, [{"speculative": True}, {"speculative": False}]))
    assert state(s) is backends.State.UNUSABLE and "1/2" in s.detail
    backends.assess(s, backends.Probe(True, 200, [{"speculative": False}] * 2))
    assert state(s) is backends.State.UP and s.speculating is False


def test_spec_that_does_not_speculate_is_a_warning() -> None:
    s = status("spec")
    backends.assess(s, backends.Probe(True, 200, [{"speculative": False}]))
    assert s.state is backends.State.UP and s.warning and "does not speculate" in s.warning


def test_unreadable_slots_is_a_warning_and_down_is_down() -> None:
    s = status("plain")
    backends.assess(s, backends.Probe(True, 200, None, 501))
    assert state(s) is backends.State.UP and s.speculating is None
    assert s.warning and "--no-slots" in s.warning
    backends.assess(s, backends.Probe(True, 200, None, 401))
    assert s.warning and "SPECAUDIT_PLAIN_API_KEY" in s.warning
    backends.assess(s, backends.Probe(True, 503))
    assert state(s) is backends.State.DOWN
    backends.assess(s, backends.Probe(False, error="connection refused"))
    assert state(s) is backends.State.DOWN and s.detail == "connection refused"
