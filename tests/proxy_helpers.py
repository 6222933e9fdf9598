"""Requests and response checks shared by the proxy tests (unit and integration).

Importable as ``import proxy_helpers`` from any test, like tests/fakes.py (which has the fake
backends and says why).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import httpx

from specaudit.llama import free_port

if TYPE_CHECKING:
    from specaudit.proxy import RunningProxy

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "completion": "/completion",
}
TOP = 2


def request_body(
    kind: str, *, stream: bool, logprobs: bool, n: int = 8, seed: int = 1, prompt: str = "abcab"
) -> dict[str, object]:
    """A generation request the fixture (letters a-h) can serve on each endpoint."""
    b: dict[str, object] = {"temperature": 1.0, "seed": seed, "stream": stream}
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    b["n_predict" if kind == "completion" else "max_tokens"] = n
    if logprobs:
        if kind == "chat":
            b.update(logprobs=True, top_logprobs=TOP)
        elif kind == "completions":
            b["logprobs"] = TOP
        else:
            b["n_probs"] = TOP
    return b


def sse_objects(raw: bytes) -> list[dict[str, Any]]:
    """Every JSON event of an SSE body (comments and [DONE] left out); fails on torn events.

    Decoded JSON is typed ``Any`` below the top level: tests index into the shape they expect,
    and a different shape fails the test right there."""
    from specaudit.proxy import sse

    evs, rest = sse.split_events(raw)
    assert rest.strip() == b"", f"stream ended mid-event: {rest[:80]!r}"
    out = []
    for ev in evs:
        obj = sse.parse_event(ev)
        if isinstance(obj, dict):
            out.append(obj)
    return out


def token_entries(kind: str, obj: dict) -> list[dict]:
    if kind == "completion":
        return list(obj.get("completion_probabilities") or [])
    out: list[dict] = []
    for ch in obj.get("choices") or []:
        lp = ch.get("logprobs")
        if isinstance(lp, dict):
            out += lp.get("content") or []
    return out


def has_text(kind: str, ev: dict) -> bool:
    if kind == "completion":
        return bool(ev.get("content")) and ev.get("stop") is not True
    ch = (ev.get("choices") or [{}])[0]
    delta = ch.get("delta") if kind == "chat" else None
    return bool((delta or {}).get("content") if kind == "chat" else ch.get("text"))


def assert_nothing_fake(kind: str, objs: list[dict], stream: bool) -> tuple[int, int]:
    """No token value a client could take as real unless it is: every token entry has
    candidates or an explicit null; in streams every token chunk carries an entry.
    Returns (tokens, explicit nulls)."""
    tokens = nulls = 0
    for obj in objs:
        entries = token_entries(kind, obj)
        if stream and has_text(kind, obj):
            assert entries, f"streamed token without a probability entry: {obj}"
        for e in entries:
            tokens += 1
            cands = e.get("top_probs", e.get("top_logprobs"))
            value = e.get("prob", e.get("logprob"))
            if not cands:
                assert value is None, f"placeholder passed as real: {e}"
                nulls += 1
    return tokens, nulls


def dead_url() -> str:
    """A URL nothing listens on (a backend that is down)."""
    return f"http://127.0.0.1:{free_port()}"


def error_of(r: httpx.Response) -> dict:
    """The OpenAI-style error object of a proxy's answer, checked for its shape."""
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == r.status_code and isinstance(err["type"], str)
    return err


def metric(p: RunningProxy, name: str) -> dict[str, float]:
    """``{labels: value}`` of one family on /metrics."""
    out = {}
    for line in httpx.get(p.url + "/metrics").text.splitlines():
        m = re.fullmatch(rf"specaudit_proxy_{name}(\{{.*\}})? (\S+)", line)
        if m:
            out[m[1] or ""] = float(m[2])
    return out
