"""The LiteLLM methods the callback wraps because LiteLLM gives them no hook.

Why apart from the callback (`specaudit.integrations.litellm`): this is the part that patches
LiteLLM's classes (``Router.__init__``, its sync selection and sync calls, and
``CustomStreamWrapper``'s iteration), installed once, by the first callback made; which hook
is missing and why is told in the callback's module doc and docs/litellm.md. Every wrapper
asks `install`'s `active` for the registered callback and does nothing without one.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from typing import Any, Protocol

from specaudit.integrations.litellm_checks import HIDDEN_KEY, check_chunk, hidden_params, requested


class Handler(Protocol):
    """What the wrappers call on the registered callback (`SpecauditRouting`)."""

    stats: Any

    def watch(self, deployments: Any) -> list[Any]: ...

    def wait(self, futs: list[Any]) -> None: ...

    def excluded_sync(
        self,
        router: Any,
        model: str,
        messages: Any,
        request_kwargs: Any,
        request: dict[str, Any],
    ) -> list[str]: ...

    def check_result(self, request: Any, response: Any) -> None: ...


def _none() -> Handler | None:
    return None


_ACTIVE: Callable[[], Handler | None] = _none


def loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# Set while a synchronous Router.completion / text_completion runs. LiteLLM runs those through
# its async retry machinery on a private event loop of their own (`run_async_function`), so a
# running loop alone does not say whether waiting is allowed: inside a sync call it is (the
# caller waits anyway), on any other loop (the proxy's, an acompletion's) never.
SYNC_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "specaudit_sync_call", default=False
)


def may_block() -> bool:
    """Whether the callback may wait for a role check here (see `SYNC_CALL`)."""
    return SYNC_CALL.get() or not loop_running()


# the request of a running sync Router.text_completion, for its deployment selection
SYNC_TEXT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "specaudit_sync_text", default=None
)

_INSTALLED = False


def install(active: Callable[[], Handler | None]) -> None:
    """Wrap, once, the few LiteLLM methods that have no hook (see `specaudit.integrations.litellm`);
    `active`: the registered callback, if any (each wrapper does nothing without one)."""
    global _INSTALLED, _ACTIVE
    _ACTIVE = active
    if _INSTALLED:
        return
    from litellm import Router
    from litellm.litellm_core_utils.streaming_handler import CustomStreamWrapper

    Router.__init__ = _wrap_init(Router.__init__)  # type: ignore[method-assign]
    Router.get_available_deployment = _wrap_select(  # type: ignore[method-assign]
        Router.get_available_deployment
    )
    Router.completion = _wrap_completion(Router.completion)  # type: ignore[method-assign]
    Router.text_completion = _wrap_text_completion(  # type: ignore[method-assign]
        Router.text_completion
    )
    anext_, next_ = CustomStreamWrapper.__anext__, CustomStreamWrapper.__next__

    async def __anext__(self: Any) -> Any:
        return check_streamed(self, await anext_(self))

    def __next__(self: Any) -> Any:
        return check_streamed(self, next_(self))

    CustomStreamWrapper.__anext__ = __anext__  # type: ignore[method-assign]
    CustomStreamWrapper.__next__ = __next__  # type: ignore[method-assign]
    _INSTALLED = True


def _wrap_init(init: Any) -> Any:
    """``Router.__init__``, then every deployment's role read at once, in the background."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        h = _ACTIVE()
        if h is not None:  # start: every deployment's /slots, now, in the background
            h.watch(getattr(self, "model_list", None) or [])

    return __init__


def _wrap_select(select: Any) -> Any:
    """``Router.get_available_deployment`` (the sync selection) without the deployments the
    callback excludes for this request."""

    @functools.wraps(select)
    def get_available_deployment(
        self: Any,
        model: str,
        messages: list | None = None,
        input: Any = None,
        specific_deployment: bool | None = False,
        request_kwargs: dict | None = None,
    ) -> Any:
        h = _ACTIVE()
        if h is not None and not specific_deployment and input is None:
            request_kwargs = _exclude(h, self, model, messages, request_kwargs)
        return select(self, model, messages, input, specific_deployment, request_kwargs)

    return get_available_deployment


def _exclude(
    h: Handler, router: Any, model: str, messages: list | None, request_kwargs: dict | None
) -> dict | None:
    """`request_kwargs` with the deployments `h` excludes added to LiteLLM's own list."""
    request = SYNC_TEXT.get()
    if request is None:
        request = dict(request_kwargs or {})
        if messages is not None:
            request.setdefault("messages", messages)
    excluded = h.excluded_sync(router, model, messages, request_kwargs, request)
    if excluded:
        request_kwargs = request_kwargs if request_kwargs is not None else {}
        before = list(request_kwargs.get("_excluded_deployment_ids") or [])
        request_kwargs["_excluded_deployment_ids"] = before + excluded
    return request_kwargs


def _sync_call(router: Any, call: Any, request: dict[str, Any], text: bool) -> Any:
    """A sync ``Router`` call, its roles read first and its result checked."""
    h = _ACTIVE()
    if h is None:
        return call()
    # a role not read yet (a Router built before the handler was registered, or its
    # start-up check still running) is read first: this call waits anyway
    h.wait(h.watch(getattr(router, "model_list", None) or []))
    sync = SYNC_CALL.set(True)
    # LiteLLM hands the sync text selection the messages it made of the prompt, not the
    # request: the selection reads the request from here
    req = SYNC_TEXT.set(request) if text else None
    try:
        response = call()
    finally:
        if req is not None:
            SYNC_TEXT.reset(req)
        SYNC_CALL.reset(sync)
    h.check_result(request, response)
    return response


def _wrap_completion(completion: Any) -> Any:
    @functools.wraps(completion)
    def sync_completion(self: Any, model: str, messages: list, **kwargs: Any) -> Any:
        return _sync_call(
            self,
            lambda: completion(self, model, messages, **kwargs),
            {**kwargs, "messages": messages},
            text=False,
        )

    return sync_completion


def _wrap_text_completion(text_completion: Any) -> Any:
    @functools.wraps(text_completion)
    def sync_text_completion(self: Any, model: str, prompt: Any, *args: Any, **kwargs: Any) -> Any:
        return _sync_call(
            self,
            lambda: text_completion(self, model, prompt, *args, **kwargs),
            {**kwargs, "prompt": prompt},
            text=True,
        )

    return sync_text_completion


def check_streamed(stream: Any, chunk: Any) -> Any:
    """Check one chunk of a logprobs stream (sync or async) as the caller receives it."""
    handler = _ACTIVE()
    if handler is None:
        return chunk
    state = getattr(stream, "_specaudit", None)
    if state is None:
        details = getattr(stream.logging_obj, "model_call_details", None) or {}
        request = {**(details.get("optional_params") or {}), **details}
        # LiteLLM drops every logprob from text-completion streams before this point:
        # nothing reaches the caller to check (or to mistake for real)
        text = "text_completion" in str(getattr(stream.logging_obj, "call_type", ""))
        n = 0 if text else requested(request)
        state = stream._specaudit = {"n": n, "tokens": 0, "ph": 0}
    if state["n"]:
        tokens, ph = check_chunk(chunk, state["n"])
        state["tokens"] += tokens
        state["ph"] += ph
        handler.stats.tokens_checked += tokens
        handler.stats.placeholders += ph
        hidden = hidden_params(chunk)
        if hidden is not None:
            hidden[HIDDEN_KEY] = state["ph"]
    return chunk
