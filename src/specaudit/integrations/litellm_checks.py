"""What the LiteLLM callback asks of a request and checks in a response, on LiteLLM's objects.

Why apart from the callback (`litellm`): these are the proxy's rules, applied to LiteLLM's
request dicts and response objects (pydantic, or plain dicts): the routing rule
(`specaudit.proxy.routing`) and the placeholder walker (`specaudit.proxy.placeholders`), the
same code the proxy runs, neither of which loads aiohttp or the proxy's transports. What is
LiteLLM's own here: reading its request keys, its ``_hidden_params``, and the entry type a
streamed token without one gets (imported from LiteLLM only when one is needed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from specaudit.proxy.placeholders import check_choice_logprobs, get, put
from specaudit.proxy.placeholders import check_entries as _walk_entries
from specaudit.proxy.routing import Kind, requested_candidates, wants_logprobs

HIDDEN_KEY = "specaudit_placeholders"  # where a response's placeholder count goes


def server_root(api_base: str) -> str:
    """llama-server's root from an OpenAI ``api_base`` (drops a trailing ``/v1``)."""
    base = api_base.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def hidden_params(obj: Any) -> Any:
    """A response's ``_hidden_params``: a dict (chat) or LiteLLM's `HiddenParams` (text
    completions), both with ``get`` and item assignment; None otherwise."""
    h = getattr(obj, "_hidden_params", None)
    return h if hasattr(h, "get") and hasattr(h, "__setitem__") else None


def _kind(request: dict[str, Any]) -> Kind:
    return Kind.CHAT if request.get("messages") is not None else Kind.COMPLETIONS


def _fields(request: dict[str, Any]) -> dict[str, Any]:
    body = {k: request.get(k) for k in ("logprobs", "top_logprobs", "n_probs")}
    return {k: v for k, v in body.items() if v is not None}


def wants(request: dict[str, Any]) -> bool:
    """The routing rule (`specaudit.proxy.routing.wants_logprobs`): does the request ask for
    logprobs at all (``logprobs: true``, ``top_logprobs > 0``, ``n_probs > 0``...)?"""
    try:
        return wants_logprobs(_kind(request), _fields(request))
    except (TypeError, ValueError):
        return True  # an odd value still asks for logprobs: never a speculating deployment


def requested(request: dict[str, Any]) -> int:
    """Candidates per token llama-server computes for the request (its n_probs); 0: none, so
    there is nothing to check."""
    try:
        return max(requested_candidates(_kind(request), _fields(request)), 0)
    except (TypeError, ValueError):
        return 0


def check_entries(entries: Iterable[Any], n: int) -> tuple[int, int]:
    """(tokens, placeholders) over ``{token, logprob, top_logprobs}`` entries; placeholders'
    ``logprob`` set to None in place."""
    t = _walk_entries(list(entries), n)
    return t.tokens, t.placeholders


def check_response(response: Any, n: int) -> tuple[int, int]:
    """(tokens, placeholders) of a non-streamed ModelResponse / TextCompletionResponse."""
    tokens = ph = 0
    for ch in get(response, "choices") or []:
        t = check_choice_logprobs(get(ch, "logprobs"), n)
        if t is not None:
            tokens, ph = tokens + t.tokens, ph + t.placeholders
    return tokens, ph


def _missing(text: str) -> Any:
    from litellm.types.utils import ChatCompletionTokenLogprob, ChoiceLogprobs

    entry = ChatCompletionTokenLogprob.model_construct(
        token=text, bytes=list(text.encode("utf-8", "surrogatepass")), logprob=None, top_logprobs=[]
    )
    return ChoiceLogprobs.model_construct(content=[entry], refusal=None)


def check_chunk(chunk: Any, n: int) -> tuple[int, int]:
    """(tokens, placeholders) of one streamed chunk. A token chunk with no entry at all (what a
    speculating llama-server streams) gets one with ``logprob: None``."""
    tokens = ph = 0
    for ch in get(chunk, "choices") or []:
        t = check_choice_logprobs(get(ch, "logprobs"), n)
        if t is not None:
            tokens, ph = tokens + t.tokens, ph + t.placeholders
            continue
        delta = get(ch, "delta")
        text = get(delta, "content") if delta is not None else get(ch, "text")
        if isinstance(text, str) and text:
            put(ch, "logprobs", _missing(text))
            tokens, ph = tokens + 1, ph + 1
    return tokens, ph
