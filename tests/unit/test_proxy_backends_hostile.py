"""A hostile backend never fools a client of the proxy.

Every way of breaking HTTP on the wire in `hostile_backend.MODES` (bad chunk sizes, Content-Length
shorter or longer than the body, both framings, 1xx, garbage, a 5 MB event, one byte per write,
silence, HTTP/1.0, header injection, placeholder variants, a reset mid-stream, ...), each for a
streamed and a non-streamed request, with and without logprobs, through both transports: the
forwarding core (`proxy.forwarding`) and aiohttp's path. For every combination:

- no truncated body is presented as complete: a 200 JSON body is exactly what the backend sent
  (placeholders nulled), anything else is an error status with a JSON error; a stream either
  ends with its terminator (``[DONE]``, or the ``stop`` event on ``/completion``) after every
  event the backend sent and then a last chunk, or ends with one error event (nothing after
  it), or is cut without a last chunk; never an event after the terminator, never half an
  event, never garbage, never bytes after the message;
- no placeholder reaches the client as real: in a response to a logprobs request every token
  without candidates carries ``null`` (streamed: every token chunk has an entry), a JSON body
  says how many in exactly one ``X-Specaudit-Placeholders``, and no backend header can add or
  forge a header (CR, LF or NUL in a header line, ``Set-Cookie``); a logprobs request never
  reaches the speculating backend;
- an answer within the configured timeouts: connect and read timeouts are 2 s, and the client
  gives up after `BOUND`; nothing else about time is asserted.

Modes a well-behaved proxy must serve (1xx, one byte per write, body until close, HTTP/1.0, a
5 MB event, placeholders) are expected whole. Whatever the mode, a request reaches the
backends at most once: a backend that took it and then misbehaved is answered for, never sent
the request again (docs/proxy.md, "When a request is sent twice").

How aiohttp's path is chosen: a proxy with `ProxyConfig.total_timeout` set (here 60 s, far
above anything these backends do) hands every request to aiohttp's path
(`state.ProxyState.direct_role`); each combination checks the core's own counter (`fast_path_total`)
to confirm which transport served it.

Speed: eight proxies, one per (transport, stream, route), share two backends (plain and spec,
`hostile_backend.Backend`) for the whole module; a mode's eight requests run at once, one per
proxy. Before each mode every proxy re-reads its backends' roles (`check_backends`), so a mode
that gets a backend marked down (a reset, a close mid-body) does not change how the next mode
is routed.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

import fakes
from hostile_backend import (
    MODES,
    Ask,
    Backend,
    Plan,
    Reply,
    client_body,
    event_value,
    exchange,
    planned,
    split_events,
)
from proxy_helpers import PATHS, assert_nothing_fake
from specaudit.proxy import (
    H_BACKEND,
    H_FALLBACK,
    H_PLACEHOLDERS,
    H_ROUTE,
    ProxyConfig,
    RunningProxy,
    serve_in_thread,
)

CONNECT_TIMEOUT = 2.0
# 4 s: the backends are threads of this process; on a loaded machine (a suite beside an
# audit) the drip backend went 2 s without a write and a 2 s timeout turned it into a 504
READ_TIMEOUT = 4.0
BOUND = 15.0  # the client's deadline for the whole answer: the read timeout, retries, load
TRANSPORTS = ("core", "aiohttp")
ROUTES = ("logprobs", "default")


@dataclass(frozen=True)
class Combo:
    transport: str  # core | aiohttp
    stream: bool
    route: str  # logprobs | default

    @property
    def name(self) -> str:
        return f"{self.transport}-{'stream' if self.stream else 'json'}-{self.route}"


COMBOS = [Combo(t, s, r) for t in TRANSPORTS for s in (False, True) for r in ROUTES]


@dataclass
class ProxiedRequest:
    """One request through one proxy, and what the backends and the core saw of it."""

    mode: str
    combo: Combo
    ask: Ask
    plan: Plan  # what the backend sent
    reply: Reply
    hits: dict[str, int]  # generation requests that reached each backend
    core: dict[str, int]  # the core's fast_path_total: served, given_back


class Rig:
    """Two hostile backends and eight proxies; each mode's eight requests are run once, at
    once, the first time a test asks for one of them."""

    def __init__(self, backends: dict[str, Backend], proxies: dict[Combo, RunningProxy]) -> None:
        self.backends = backends
        self.proxies = proxies
        self._done: dict[str, dict[Combo, ProxiedRequest]] = {}

    def outcome(self, mode: str, combo: Combo) -> ProxiedRequest:
        if mode not in self._done:
            for p in self.proxies.values():
                p.check_backends()  # roles re-read: a backend the last mode broke is up again
            with ThreadPoolExecutor(len(self.proxies)) as pool:
                futures = {c: pool.submit(self._one, mode, c) for c in self.proxies}
                self._done[mode] = {c: f.result() for c, f in futures.items()}
        return self._done[mode][combo]

    def _one(self, mode: str, c: Combo) -> ProxiedRequest:
        m = MODES[mode]
        ask = Ask(m.kind, c.stream, c.route == "logprobs", m.post)
        p = self.proxies[c]
        fp = p.proxy.metrics.fast_path
        before = {k: int(fp.get(k)) for k in ("served", "given_back")}
        reply = exchange(p.url, PATHS[m.kind], client_body(mode, c.name, ask), BOUND)
        core = {k: int(fp.get(k)) - before[k] for k in before}
        hits = {
            role: sum(1 for h in b.hits if h.mode == mode and h.tag == c.name)
            for role, b in self.backends.items()
        }
        return ProxiedRequest(mode, c, ask, planned(mode, ask), reply, hits, core)


@contextlib.contextmanager
def running_rig(combos: list[Combo] = COMBOS) -> Iterator[Rig]:
    """The backends and one proxy per combination, all stopped on exit."""
    backends = {"plain": Backend(speculative=False), "spec": Backend(speculative=True)}
    with (
        fakes.serve_tcp(backends["plain"]) as plain,
        fakes.serve_tcp(backends["spec"]) as spec,
        contextlib.ExitStack() as stack,
    ):
        proxies = {
            c: stack.enter_context(
                serve_in_thread(
                    ProxyConfig(
                        plain.url,
                        spec.url,
                        port=0,
                        connect_timeout=CONNECT_TIMEOUT,
                        read_timeout=READ_TIMEOUT,
                        total_timeout=60.0 if c.transport == "aiohttp" else None,
                        check_interval=3600,
                        shutdown_grace=0,
                    )
                )
            )
            for c in combos
        }
        yield Rig(backends, proxies)


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with running_rig() as r:
        yield r


# ------------------------------------------------------------------------- the oracle


def _entry_lists(kind: str, obj: Any) -> list[list[Any]]:
    """The token entry lists of a body or event (mutable, in place)."""
    if not isinstance(obj, dict):
        return []
    if kind == "completion":
        lst = obj.get("completion_probabilities")
        return [lst] if isinstance(lst, list) else []
    out = []
    for ch in obj.get("choices") or []:
        lp = ch.get("logprobs") if isinstance(ch, dict) else None
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            out.append(lp["content"])
    return out


def _candidates(e: dict[str, Any]) -> int:
    c = e.get("top_probs") if "top_probs" in e else e.get("top_logprobs")
    return len(c) if isinstance(c, list | dict) else 0


def _value(e: dict[str, Any]) -> Any:
    return e["prob"] if "prob" in e else e.get("logprob")


def _token_text(kind: str, ch_or_obj: dict[str, Any]) -> str:
    if kind == "completion":
        return "" if ch_or_obj.get("stop") is True else str(ch_or_obj.get("content") or "")
    if kind == "chat":
        return str((ch_or_obj.get("delta") or {}).get("content") or "")
    return str(ch_or_obj.get("text") or "")


def placeholders_in(kind: str, obj: Any, stream: bool) -> int:
    """Placeholder tokens a backend sent: entries without candidates and, streamed, token
    chunks without any entry (the rule of `specaudit.logprobs.classify`, written out here)."""
    n = sum(1 for lst in _entry_lists(kind, obj) for e in lst if not _candidates(e))
    if stream and isinstance(obj, dict):
        if kind == "completion":
            if not obj.get("completion_probabilities") and _token_text(kind, obj):
                n += 1
        else:
            for ch in obj.get("choices") or []:
                lp = ch.get("logprobs")
                if not (isinstance(lp, dict) and lp.get("content")) and _token_text(kind, ch):
                    n += 1
    return n


def view(kind: str, obj: Any, *, sent: bool, stream: bool) -> Any:
    """`obj` with each placeholder entry reduced to its token and value; for what the backend
    `sent`, the value a client must see (null) and, streamed, the entry a token chunk without
    one must gain. Real entries and everything else stay as they are."""
    obj = copy.deepcopy(obj)
    for lst in _entry_lists(kind, obj):
        for i, e in enumerate(lst):
            if isinstance(e, dict) and not _candidates(e):
                lst[i] = {"token": e.get("token"), "placeholder": None if sent else _value(e)}
    if sent and stream and isinstance(obj, dict):
        if kind == "completion":
            text = _token_text(kind, obj)
            if text and not obj.get("completion_probabilities"):
                obj["completion_probabilities"] = [{"token": text, "placeholder": None}]
        else:
            for ch in obj.get("choices") or []:
                lp = ch.get("logprobs")
                text = _token_text(kind, ch)
                if text and not (isinstance(lp, dict) and lp.get("content")):
                    ch["logprobs"] = {"content": [{"token": text, "placeholder": None}]}
    return obj


def same(kind: str, got: bytes, sent: bytes, *, logprobs: bool, stream: bool) -> bool:
    """Did the client get what the backend sent? The same JSON with every placeholder null
    when a logprobs response holds one, else byte for byte (nothing else is re-encoded)."""
    try:
        s = _json_of(sent, stream)
    except ValueError:
        s = None
    if logprobs and s is not None and placeholders_in(kind, s, stream):
        try:
            g = _json_of(got, stream)
        except ValueError:
            return False
        return bool(
            view(kind, g, sent=False, stream=stream) == view(kind, s, sent=True, stream=stream)
        )
    return got == sent


def _json_of(raw: bytes, stream: bool) -> Any:
    return event_value(raw) if stream else json.loads(raw)


def _parses(body: bytes) -> bool:
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def _is_error_json(body: bytes) -> bool:
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)


def _code(body: bytes) -> Any:
    return json.loads(body)["error"].get("code")


def verify(o: ProxiedRequest) -> None:
    m, r, c, ask = MODES[o.mode], o.reply, o.combo, o.ask
    head = r.raw[:400]
    expect = m.stream if c.stream else m.json

    # an answer within the bound, framed so that a client can tell where it ends
    assert r.eof, f"no end of the answer within {BOUND}s (read timeout {READ_TIMEOUT}s): {head!r}"
    assert r.status, f"no HTTP answer, only {head!r}"
    assert not r.bad_lines, f"header lines a client would misread: {r.bad_lines}"
    assert not r.header("set-cookie"), f"a backend's header reached the client: {head!r}"
    assert len(r.header(H_PLACEHOLDERS)) <= 1, f"forged placeholder count: {head!r}"
    assert not r.framing_error, f"the proxy's own framing is broken ({r.framing_error}): {head!r}"
    assert not r.extra, f"bytes after the end of the answer: {r.extra[:200]!r}"

    ok = r.status == 200
    if ok:
        assert r.header(H_ROUTE) == [c.route], head
        role = "plain" if c.route == "logprobs" else "spec"
        if not r.header(H_FALLBACK):
            assert r.header(H_BACKEND) == [role], head

    sse = any(v.startswith("text/event-stream") for v in r.header("content-type"))
    if not (c.stream and ok and sse):
        assert r.complete, f"a body cut short: {head!r}"
        if ok:
            assert not c.stream, f"a stream request answered with a non-stream 200: {head!r}"
            assert _parses(r.body), f"a 200 body that is not JSON: {r.body[:300]!r}"
            assert same(ask.kind, r.body, o.plan.body, logprobs=ask.logprobs, stream=False), (
                f"a 200 body that is not the backend's whole body: got {r.body[:300]!r}, "
                f"sent {o.plan.body[:300]!r}"
            )
            if ask.logprobs:
                body = json.loads(r.body)
                assert_nothing_fake(ask.kind, [body], stream=False)
                n = placeholders_in(ask.kind, json.loads(o.plan.body), False)
                assert r.header(H_PLACEHOLDERS) == [str(n)], head
        else:
            assert r.status >= 500, f"an error status a client could take for its own: {head!r}"
            assert _is_error_json(r.body), f"an error that is not a JSON error: {head!r}"
        assert expect != "ok" or ok, f"{o.mode} ({m.why}) must be served: {head!r}"
        assert expect != "error" or not ok, f"{o.mode} ({m.why}) must be an error: {head!r}"
        if m.timeout:
            assert r.status == 504 and _code(r.body) == 504, (
                f"a silent backend must get the read timeout's 504: {head!r}"
            )
        _check_hits(o, expect, ok)
        return

    # a stream
    events, torn = split_events(r.body)
    assert not torn.strip(), f"half an event reached the client: {torn[:200]!r}"
    got: list[bytes] = []  # the backend's events as forwarded, comments left out
    errors: list[Any] = []
    for ev in events:
        try:
            value = event_value(ev)
        except ValueError:
            raise AssertionError(f"an event a client cannot parse: {ev[:200]!r}") from None
        if value is None:
            continue
        assert not errors, f"an event after the error event: {ev[:200]!r}"
        if isinstance(value, dict) and "error" in value:
            errors.append(value["error"])
            continue
        got.append(ev)
    sent = o.plan.events
    assert len(got) <= len(sent), f"more events than the backend sent: {got[len(sent) :]!r}"
    for i, (g, s) in enumerate(zip(got, sent, strict=False)):
        assert same(ask.kind, g, s, logprobs=ask.logprobs, stream=True), (
            f"event {i} is not the backend's: got {g[:300]!r}, sent {s[:300]!r}"
        )
    terminated = bool(got) and len(got) == len(sent) and _is_terminator(ask.kind, sent[-1])
    assert not (terminated and errors), (
        f"an error event after the stream's end ({sent[-1][:60]!r}): {errors}"
    )
    if terminated:
        assert expect != "error", f"{o.mode} ({m.why}) must not end as complete"
        if expect == "ok":
            assert r.complete, "a complete stream without its last chunk"
    else:
        assert errors or not r.complete, (
            f"a truncated stream presented as complete: {len(got)} of {len(sent)} events, "
            "no error event, then the last chunk"
        )
        assert expect != "ok", f"{o.mode} ({m.why}) must be served whole: {errors or head!r}"
    if errors:
        assert len(errors) == 1 and isinstance(errors[0].get("message"), str), errors
        if m.timeout:
            assert errors[0].get("code") == 504, f"a silent backend must end with 504: {errors}"
    if ask.logprobs:
        objs = [event_value(g) for g in got]
        assert_nothing_fake(ask.kind, [v for v in objs if isinstance(v, dict)], stream=True)
    _check_hits(o, expect, terminated)


_DONE = b"data: [DONE]\n\n"


def _is_terminator(kind: str, ev: bytes) -> bool:
    if kind == "completion":
        v = event_value(ev)
        return isinstance(v, dict) and v.get("stop") is True
    return ev == _DONE


def _check_hits(o: ProxiedRequest, expect: str, served: bool) -> None:
    """Routing and generation counts as the backends saw them; the transport as the core's
    counter saw it."""
    c = o.combo
    # whatever the backend did once the request reached it, the request is not sent again
    # (docs/proxy.md, "When a request is sent twice")
    assert sum(o.hits.values()) <= 1, f"one request reached the backends {o.hits} times"
    if c.route == "logprobs":
        assert o.hits["spec"] == 0, f"a logprobs request reached the speculating backend: {o.hits}"
    if expect == "ok" and served:
        role = "plain" if c.route == "logprobs" else "spec"
        assert o.hits == {"plain": 0, "spec": 0, role: 1}, (
            f"the backend generated {o.hits} times for one request"
        )
    if c.transport == "aiohttp":
        assert o.core == {"served": 0, "given_back": 0}, f"the core took it: {o.core}"
    elif o.mode == "clean":
        assert o.core == {"served": 1, "given_back": 0}, f"the core did not serve it: {o.core}"


CASES = [pytest.param(mode, c, id=f"{mode}-{c.name}") for mode in MODES for c in COMBOS]


@pytest.mark.parametrize(("mode", "combo"), CASES)
def test_a_hostile_backend_never_fools_the_client(rig: Rig, mode: str, combo: Combo) -> None:
    verify(rig.outcome(mode, combo))


def test_no_backend_connection_is_reused_after_a_hostile_answer(rig: Rig) -> None:
    """A connection whose answer broke its framing (bytes past Content-Length, garbage after
    the last chunk) is never sent another request: its next bytes would be read as the
    answer to someone else's request."""
    for mode in MODES:
        rig.outcome(mode, COMBOS[0])
    assert {r: b.reused for r, b in rig.backends.items()} == {"plain": [], "spec": []}
