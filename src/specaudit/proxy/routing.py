"""Which backend a request goes to, decided from the request alone, before any byte is sent.

Why here and pure: routing is the proxy's one promise ("a request that asks for logprobs
gets the plain backend"), so it is a function of (path, body) that tests can drive without a
socket. It mirrors how llama-server b11434 turns a request into ``n_probs``
(``tools/server/server-common.cpp`` and ``server-schema.cpp``):

- chat: ``logprobs: true`` sets ``n_probs = top_logprobs`` (20 when absent); otherwise a body
  ``n_probs``, or a numeric ``logprobs`` (copied through as an alias of ``n_probs``), counts;
- completions and native ``/completion``: ``n_probs``, else ``logprobs`` (``true`` is 1).

A body field whose type would make that decision ambiguous is refused with a 400: guessing
could send a logprobs request to the speculating backend.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

JSON = dict[str, Any]

# llama-server's default top_logprobs when a chat request says ``logprobs: true`` alone.
CHAT_DEFAULT_TOP_LOGPROBS = 20


class Kind(StrEnum):
    """The endpoint a request is for; the value is the `specaudit.logprobs` endpoint name."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    COMPLETION = "completion"  # llama.cpp native
    MODELS = "models"


class Route(StrEnum):
    LOGPROBS = "logprobs"  # must be served by the plain backend (or annotated, or refused)
    DEFAULT = "default"  # served by the speculating backend for speed


# The only paths the proxy forwards, each to the same path on a configured backend. Matching
# is exact: nothing in a request chooses the upstream URL.
ENDPOINTS: dict[str, tuple[str, Kind]] = {
    "/v1/chat/completions": ("POST", Kind.CHAT),
    "/v1/completions": ("POST", Kind.COMPLETIONS),
    "/completion": ("POST", Kind.COMPLETION),
    "/v1/models": ("GET", Kind.MODELS),
}


class RequestError(ValueError):
    """A request the proxy refuses before contacting a backend (HTTP 4xx, one-line message)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Plan:
    """What to do with one request."""

    kind: Kind
    route: Route
    stream: bool
    requested: int  # candidates llama-server will compute per token (its n_probs)
    post_sampling: bool  # probabilities in ``prob``/``top_probs`` form
    body: bytes  # forwarded unchanged


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _bad(field: str, want: str, v: Any) -> RequestError:
    return RequestError(400, f"'{field}' must be {want}, got {_type_name(v)}", field)


# field -> (check, description); None is always allowed (llama-server treats null as absent)
_CHECKS: dict[str, tuple[Any, str]] = {
    "stream": (lambda v: isinstance(v, bool), "a boolean"),
    "logprobs": (
        lambda v: isinstance(v, bool) or (_is_int(v) and v >= 0),
        "a boolean or a non-negative integer",
    ),
    "top_logprobs": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "n_probs": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "post_sampling_probs": (lambda v: isinstance(v, bool), "a boolean"),
    "max_tokens": (_is_int, "an integer"),
    "max_completion_tokens": (_is_int, "an integer"),
    "n_predict": (_is_int, "an integer"),
    "n": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "seed": (_is_int, "an integer"),
    "top_k": (_is_int, "an integer"),
    "temperature": (_is_num, "a number"),
    "top_p": (_is_num, "a number"),
    "min_p": (_is_num, "a number"),
    "presence_penalty": (_is_num, "a number"),
    "frequency_penalty": (_is_num, "a number"),
    "repeat_penalty": (_is_num, "a number"),
    "model": (lambda v: isinstance(v, str), "a string"),
    "stop": (
        lambda v: (
            isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
        ),
        "a string or an array of strings",
    ),
}


def _check_prompt(v: Any) -> bool:
    if isinstance(v, str):
        return True
    if isinstance(v, list):
        # strings, token ids, or arrays of them (batched or tokenised prompts)
        return all(isinstance(p, str) or _is_int(p) or isinstance(p, list | dict) for p in v)
    return isinstance(v, dict)  # native multimodal prompt objects


def _check_messages(v: Any) -> None:
    if not isinstance(v, list):
        raise _bad("messages", "an array of message objects", v)
    if not v:
        raise RequestError(400, "'messages' must not be empty", "messages")
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _bad(f"messages[{i}].role", "a string", role)
        c = m.get("content")
        if c is not None and not isinstance(c, str | list):
            raise _bad(f"messages[{i}].content", "a string, an array or null", c)


def validate(kind: Kind, body: JSON) -> None:
    """Refuse bodies whose fields have types llama-server would reject or misread."""
    for name, (ok, want) in _CHECKS.items():
        v = body.get(name)
        if v is not None and not ok(v):
            raise _bad(name, want, v)
    if kind is Kind.CHAT:
        if "messages" not in body:
            raise RequestError(400, "'messages' is required", "messages")
        _check_messages(body["messages"])
    elif kind in (Kind.COMPLETIONS, Kind.COMPLETION):
        p = body.get("prompt")
        if kind is Kind.COMPLETION and p is None:
            raise RequestError(400, "'prompt' is required", "prompt")
        if p is not None and not _check_prompt(p):
            raise _bad("prompt", "a string or an array", p)


def requested_candidates(kind: Kind, body: JSON) -> int:
    """The ``n_probs`` llama-server will use for this body (0: no probabilities at all)."""
    lp = body.get("logprobs")
    n_probs = body.get("n_probs")
    if kind is Kind.CHAT and lp is True:
        top = body.get("top_logprobs")
        return int(top) if top is not None else CHAT_DEFAULT_TOP_LOGPROBS
    if n_probs is not None:
        return int(n_probs)
    if lp is None or lp is False:
        return 0
    return 1 if lp is True else int(lp)


def wants_logprobs(kind: Kind, body: JSON) -> bool:
    """The routing rule: ``logprobs: true``, ``top_logprobs > 0`` or ``n_probs > 0``."""
    lp = body.get("logprobs")
    if lp is True or (isinstance(lp, int) and not isinstance(lp, bool) and lp > 0):
        return True
    for name in ("top_logprobs", "n_probs"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return True
    return requested_candidates(kind, body) > 0


class _Ambiguous(ValueError):
    pass


def _no_constant(name: str) -> Any:
    # Python accepts NaN/Infinity; llama-server's JSON parser does not
    raise _Ambiguous(f"{name} is not a JSON value")


def _unique_keys(pairs: list[tuple[str, Any]]) -> JSON:
    # Parsers disagree on which duplicate wins; a duplicated "logprobs" could route a logprobs
    # request to the speculating backend. Refuse instead of guessing.
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Ambiguous(f"duplicate key {k[:40]!r}")
            seen.add(k)
    return out


def parse_body(raw: bytes) -> JSON:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    if not raw.strip():
        raise RequestError(400, "request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"request body is not UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except _Ambiguous as e:
        raise RequestError(400, f"request body is not valid JSON: {e}") from None
    except json.JSONDecodeError as e:
        raise RequestError(
            400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"request body must be a JSON object, got {_type_name(body)}")
    return body


def plan(kind: Kind, raw: bytes) -> Plan:
    """Validate a POST body and decide where it goes."""
    body = parse_body(raw)
    validate(kind, body)
    logprobs = wants_logprobs(kind, body)
    return Plan(
        kind=kind,
        route=Route.LOGPROBS if logprobs else Route.DEFAULT,
        stream=body.get("stream") is True,
        requested=requested_candidates(kind, body),
        post_sampling=body.get("post_sampling_probs") is True,
        body=raw,
    )
