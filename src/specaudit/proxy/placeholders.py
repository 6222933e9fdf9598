"""Find placeholder tokens in backend responses and turn them into explicit missing values.

Why: a speculating llama-server reports ``logprob: 0.0`` with no candidates (non-streamed) or
no probability entry at all (streamed) for every token of its speculative loop. The proxy
must never hand such a value to a client as real, whichever backend sent it. A token is a
placeholder when candidates were requested and none came back (`specaudit.logprobs.classify`);
the proxy rewrites its value to ``null`` (``logprob``, and ``prob`` in the post-sampling form)
and, in streams, adds the entry the server left out, with ``logprob: null``.

Everything here mutates the parsed JSON in place and says how many tokens it looked at and
how many it rewrote, so the caller can forward the original bytes when nothing changed.

One walker for the proxy and the LiteLLM callback (`specaudit.integrations.litellm_checks`):
a node is a parsed-JSON dict or an object with attributes (LiteLLM's pydantic responses), so
the same rule finds the same placeholders in both. This module imports neither aiohttp nor
LiteLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specaudit.logprobs import TokenClass, classify
from specaudit.proxy.routing import Kind


@dataclass
class PlaceholderTally:
    """Tokens seen and placeholders rewritten, accumulated over one response."""

    tokens: int = 0
    placeholders: int = 0

    def add(self, other: PlaceholderTally) -> None:
        self.tokens += other.tokens
        self.placeholders += other.placeholders


def is_node(o: Any) -> bool:
    """A dict (parsed JSON) or an object with attributes (a pydantic response)."""
    return isinstance(o, dict) or hasattr(o, "__dict__")


def get(o: Any, k: str) -> Any:
    return o.get(k) if isinstance(o, dict) else getattr(o, k, None)


def put(o: Any, k: str, v: Any) -> None:
    if isinstance(o, dict):
        o[k] = v
    else:
        setattr(o, k, v)


def _has(o: Any, k: str) -> bool:
    """A dict's key (even null), an object's attribute that is set."""
    return k in o if isinstance(o, dict) else getattr(o, k, None) is not None


def _candidates(entry: Any) -> int:
    c = get(entry, "top_probs") if _has(entry, "top_probs") else get(entry, "top_logprobs")
    return len(c) if isinstance(c, list | dict) else 0


def check_entries(entries: list[Any], requested: int) -> PlaceholderTally:
    """Token entries ``{token, logprob|prob, top_logprobs|top_probs}``; placeholders -> null."""
    t = PlaceholderTally()
    for e in entries:
        if not is_node(e):
            continue
        t.tokens += 1
        if classify(requested, _candidates(e)) is TokenClass.PLACEHOLDER:
            if _has(e, "prob") or _has(e, "top_probs"):
                put(e, "prob", None)
                if _has(e, "logprob"):
                    put(e, "logprob", None)
            else:
                put(e, "logprob", None)
            t.placeholders += 1
    return t


def _check_legacy(lp: Any, requested: int) -> PlaceholderTally:
    """OpenAI legacy completions form: ``tokens``, ``token_logprobs``, ``top_logprobs``."""
    t = PlaceholderTally()
    tokens = get(lp, "tokens")
    values = get(lp, "token_logprobs")
    tops = get(lp, "top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        return t
    for i in range(len(tokens)):
        t.tokens += 1
        top = tops[i] if isinstance(tops, list) and i < len(tops) else None
        n = len(top) if isinstance(top, dict | list) else 0
        if classify(requested, n) is TokenClass.PLACEHOLDER and i < len(values):
            values[i] = None
            t.placeholders += 1
    return t


def check_choice_logprobs(lp: Any, requested: int) -> PlaceholderTally | None:
    """A choice's ``logprobs`` (chat ``content`` entries, or the legacy completions form);
    None when it carries no token entries at all."""
    if not is_node(lp):
        return None
    content = get(lp, "content")
    if isinstance(content, list):
        return check_entries(content, requested) if content else None
    if _has(lp, "tokens"):
        return _check_legacy(lp, requested)
    return None


def check_body(kind: Kind, body: Any, requested: int) -> PlaceholderTally:
    """A whole (non-streamed) response body."""
    t = PlaceholderTally()
    if requested <= 0:
        return t
    if kind is Kind.COMPLETION:
        items = body if isinstance(body, list) else [body]
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("completion_probabilities"), list):
                t.add(check_entries(item["completion_probabilities"], requested))
        return t
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        return t
    for ch in body["choices"]:
        if isinstance(ch, dict):
            sub = check_choice_logprobs(ch.get("logprobs"), requested)
            if sub is not None:
                t.add(sub)
    return t


def _missing_entry(token: str, post_sampling: bool, token_id: int | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {}
    if token_id is not None:
        e["id"] = token_id
    e["token"] = token
    # a lone surrogate (a backend may send "\ud800", valid JSON) has no UTF-8 form; its
    # surrogate-pass bytes keep the entry lossless instead of failing the whole response
    e["bytes"] = list(token.encode("utf-8", "surrogatepass"))
    if post_sampling:
        e["prob"] = None
        e["top_probs"] = []
    else:
        e["logprob"] = None
        e["top_logprobs"] = []
    return e


def check_event(
    kind: Kind, event: Any, requested: int, post_sampling: bool = False
) -> PlaceholderTally:
    """One streamed event (parsed ``data:`` JSON).

    A token streamed with no probability entry is a placeholder: the entry is added with
    ``logprob: null`` so a client that asked for logprobs sees the gap instead of nothing.
    """
    if requested <= 0 or not isinstance(event, dict):
        return PlaceholderTally()
    if kind is Kind.COMPLETION:
        return _check_native_event(event, requested, post_sampling)
    t = PlaceholderTally()
    choices = event.get("choices")
    if not isinstance(choices, list):
        return t
    for ch in choices:
        if isinstance(ch, dict):
            t.add(_check_streamed_choice(kind, ch, requested, post_sampling))
    return t


def _check_native_event(
    event: dict[str, Any], requested: int, post_sampling: bool
) -> PlaceholderTally:
    """A native ``/completion`` event: its ``completion_probabilities``, or the entries it
    left out (one per token id it names, else one for its text)."""
    probs = event.get("completion_probabilities")
    if isinstance(probs, list) and probs:
        return check_entries(probs, requested)
    content = event.get("content")
    ids = (
        [i for i in event.get("tokens") or [] if isinstance(i, int) and not isinstance(i, bool)]
        if isinstance(event.get("tokens"), list)
        else []
    )
    text = content if isinstance(content, str) else ""
    if ids:
        event["completion_probabilities"] = [
            _missing_entry(text if j == 0 else "", post_sampling, tid) for j, tid in enumerate(ids)
        ]
        return PlaceholderTally(len(ids), len(ids))
    if text:
        event["completion_probabilities"] = [_missing_entry(text, post_sampling)]
        return PlaceholderTally(1, 1)
    return PlaceholderTally()


def _check_streamed_choice(
    kind: Kind, ch: dict[str, Any], requested: int, post_sampling: bool
) -> PlaceholderTally:
    """One choice of an OpenAI-style event: its ``logprobs`` checked, or the entry it left
    out for the text it carries."""
    sub = check_choice_logprobs(ch.get("logprobs"), requested)
    if sub is not None:
        return sub
    text = _streamed_text(kind, ch)
    if text:
        ch["logprobs"] = {"content": [_missing_entry(text, post_sampling)]}
        return PlaceholderTally(1, 1)
    return PlaceholderTally()


def _streamed_text(kind: Kind, ch: dict[str, Any]) -> str:
    """The text a streamed choice carries: a chat delta's content (or reasoning), a
    completion's text."""
    if kind is not Kind.CHAT:
        v = ch.get("text")
        return v if isinstance(v, str) else ""
    delta = ch.get("delta")
    if isinstance(delta, dict):
        for key in ("content", "reasoning_content"):
            v = delta.get(key)
            if isinstance(v, str) and v:
                return v
    return ""
