"""specaudit as a LiteLLM callback: logprobs requests only to deployments that do not speculate,
and no placeholder ever passed off as real (docs/litellm.md).

Why a callback: people who serve many llama-server instances already run LiteLLM (the SDK
`Router`, or its proxy, which scales out across replicas with shared state) and will not put a
second router in front of it. LiteLLM loads callbacks from its own ``config.yaml``
(``litellm_settings.callbacks``); this one

- learns each deployment's role from ``/slots`` (`specaudit.speculation`, the one reader) on
  first use and every `check_interval` seconds, and at once after a failed call;
- narrows the deployments LiteLLM may pick (``async_filter_deployments``, run by the Router
  before every attempt, retries included): a request that asks for logprobs goes only to a
  deployment seen up and not speculating; any other request prefers speculating ones;
- when no such deployment is up: ``on_plain_down="error"`` raises a 503
  `ServiceUnavailableError` naming the reason, ``"annotate"`` lets any deployment serve it;
- checks every logprobs response, non-streamed (``async_post_call_success_deployment_hook``)
  and streamed (each chunk, as the caller receives it): a token without the candidates that
  were asked for is a placeholder; its ``logprob`` becomes ``None``, a streamed token that came
  without any entry gets one with ``logprob: None``, and the count goes into the response's
  ``_hidden_params["specaudit_placeholders"]``, the proxy's ``x-specaudit-placeholders``
  header and `SpecauditRouting.stats`.

LiteLLM (1.100) has no per-chunk hook for SDK streams (its streaming deployment hook sees the
last chunk only), so the stream check wraps ``CustomStreamWrapper.__anext__`` once, and acts
only on streams whose request asked for logprobs while a `SpecauditRouting` is registered.
Only the async paths route (``Router.acompletion``/``atext_completion`` and the proxy): the
synchronous ``Router.completion`` does not run ``async_filter_deployments``. LiteLLM drops
every logprob from streamed text completions (``/v1/completions`` with ``stream: true``), so
those streams carry neither real values nor placeholders; they are routed, not checked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

try:
    from litellm.integrations.custom_logger import CustomLogger
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "specaudit.integrations.litellm needs LiteLLM: pip install 'specaudit[litellm]'"
    ) from e

from specaudit import speculation
from specaudit.client import AsyncClient, ClientError
from specaudit.logprobs import TokenClass, classify
from specaudit.proxy.routing import Kind, requested_candidates, wants_logprobs

log = logging.getLogger("specaudit.litellm")

ON_PLAIN_DOWN = ("error", "annotate")
HIDDEN_KEY = "specaudit_placeholders"
HEADER = "x-specaudit-placeholders"


@dataclass
class Role:
    """What `/slots` last said about one deployment's server."""

    url: str  # server root
    state: str = "unknown"  # "up", "down", "unknown" (never checked)
    speculates: bool | None = None  # None: /slots unreadable (or never read)
    detail: str = ""
    checked_at: float = 0.0

    @property
    def plain(self) -> bool:
        return self.state == "up" and self.speculates is False

    @property
    def speculating(self) -> bool:
        return self.state == "up" and self.speculates is True


@dataclass
class Stats:
    """What the callback did, for tests and operators."""

    logprobs_requests: int = 0
    default_requests: int = 0
    refused: int = 0  # logprobs requests with no plain deployment up (on_plain_down=error)
    annotated: int = 0  # ... served anyway (on_plain_down=annotate)
    responses_checked: int = 0
    tokens_checked: int = 0
    placeholders: int = 0
    role_checks: int = 0
    served_by: dict[str, int] = field(default_factory=dict)  # server root -> logprobs requests


def server_root(api_base: str) -> str:
    """llama-server's root from an OpenAI ``api_base`` (drops a trailing ``/v1``)."""
    base = api_base.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _get(o: Any, k: str) -> Any:
    return o.get(k) if isinstance(o, dict) else getattr(o, k, None)


def _set(o: Any, k: str, v: Any) -> None:
    if isinstance(o, dict):
        o[k] = v
    else:
        setattr(o, k, v)


def _hidden(obj: Any) -> Any:
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


# ---------------------------------------------------------------------------------------------
# the token check, on LiteLLM's response objects (pydantic) or plain dicts


def check_entries(entries: Iterable[Any], n: int) -> tuple[int, int]:
    """(tokens, placeholders) over ``{token, logprob, top_logprobs}`` entries; placeholders'
    ``logprob`` set to None in place."""
    tokens = ph = 0
    for e in entries:
        if e is None:
            continue
        tokens += 1
        tops = _get(e, "top_logprobs")
        k = len(tops) if isinstance(tops, list | dict) else 0
        if classify(n, k) is TokenClass.PLACEHOLDER:
            _set(e, "logprob", None)
            ph += 1
    return tokens, ph


def _check_choice(lp: Any, n: int) -> tuple[int, int] | None:
    if lp is None:
        return None
    content = _get(lp, "content")
    if isinstance(content, list) and content:
        return check_entries(content, n)
    tokens, values, tops = _get(lp, "tokens"), _get(lp, "token_logprobs"), _get(lp, "top_logprobs")
    if isinstance(tokens, list) and isinstance(values, list):  # legacy completions form
        ph = 0
        for i in range(min(len(tokens), len(values))):
            top = tops[i] if isinstance(tops, list) and i < len(tops) else None
            if (
                classify(n, len(top) if isinstance(top, dict | list) else 0)
                is TokenClass.PLACEHOLDER
            ):
                values[i] = None
                ph += 1
        return len(tokens), ph
    return None


def check_response(response: Any, n: int) -> tuple[int, int]:
    """(tokens, placeholders) of a non-streamed ModelResponse / TextCompletionResponse."""
    tokens = ph = 0
    for ch in _get(response, "choices") or []:
        got = _check_choice(_get(ch, "logprobs"), n)
        if got is not None:
            tokens, ph = tokens + got[0], ph + got[1]
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
    for ch in _get(chunk, "choices") or []:
        got = _check_choice(_get(ch, "logprobs"), n)
        if got is not None:
            tokens, ph = tokens + got[0], ph + got[1]
            continue
        delta = _get(ch, "delta")
        text = _get(delta, "content") if delta is not None else _get(ch, "text")
        if isinstance(text, str) and text:
            _set(ch, "logprobs", _missing(text))
            tokens, ph = tokens + 1, ph + 1
    return tokens, ph


# ---------------------------------------------------------------------------------------------
# the callback


class SpecauditRouting(CustomLogger):
    """Register in ``litellm.callbacks`` (SDK) or ``litellm_settings.callbacks`` (proxy)."""

    def __init__(
        self,
        on_plain_down: str = "error",
        check_interval: float = 10.0,
        check_timeout: float = 2.0,
    ) -> None:
        if on_plain_down not in ON_PLAIN_DOWN:
            raise ValueError(f"on_plain_down must be one of {ON_PLAIN_DOWN}, got {on_plain_down!r}")
        if not check_interval > 0 or not check_timeout > 0:
            raise ValueError("check_interval and check_timeout must be > 0")
        super().__init__()
        self.on_plain_down = on_plain_down
        self.check_interval = check_interval
        self.check_timeout = check_timeout
        self.roles: dict[str, Role] = {}
        self.stats = Stats()
        self._keys: dict[str, str | None] = {}
        self._task: asyncio.Task[None] | None = None
        self._task_loop: asyncio.AbstractEventLoop | None = None
        _install_stream_check()

    # --- roles ---------------------------------------------------------------------------

    async def check(self, url: str) -> Role:
        """Read one server's /slots now (`specaudit.speculation.aread`)."""
        role = self.roles.setdefault(url, Role(url))
        self.stats.role_checks += 1
        try:
            async with AsyncClient(
                url, timeout=self.check_timeout, api_key=self._keys.get(url)
            ) as c:
                info = await speculation.aread(c)
        except ClientError as e:
            role.state, role.detail = "down", str(e)
        else:
            role.state, role.speculates = "up", info.speculates
            role.detail = info.describe()
        role.checked_at = time.monotonic()
        return role

    async def refresh(self, urls: Iterable[str] | None = None) -> None:
        """Re-check `urls` (default: every known deployment) concurrently."""
        todo = list(dict.fromkeys(self.roles if urls is None else urls))
        if todo:
            await asyncio.gather(*(self.check(u) for u in todo))

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            try:
                await self.refresh()
            except Exception:  # a failed round must not end the checks
                log.exception("specaudit: role check failed")

    def _ensure_periodic(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task_loop is not loop:
            self._task = loop.create_task(self._periodic())
            self._task_loop = loop

    def _url(self, deployment: dict[str, Any]) -> str | None:
        params = deployment.get("litellm_params") or {}
        base = params.get("api_base")
        if not isinstance(base, str) or not base:
            return None
        url = server_root(base)
        key = params.get("api_key")
        self._keys.setdefault(url, key if isinstance(key, str) and key else None)
        return url

    async def roles_of(self, deployments: list[dict[str, Any]]) -> list[Role | None]:
        """Each deployment's role; the never-checked ones are checked first."""
        urls = [self._url(d) for d in deployments]
        new = [u for u in urls if u is not None and self.roles.get(u, Role(u)).state == "unknown"]
        if new:
            await self.refresh(new)
        self._ensure_periodic()
        return [self.roles[u] if u is not None else None for u in urls]

    # --- LiteLLM hooks -------------------------------------------------------------------

    async def async_filter_deployments(
        self,
        model: str,
        healthy_deployments: list,
        messages: list | None,
        request_kwargs: dict | None = None,
        parent_otel_span: Any = None,
    ) -> list[dict]:
        if not isinstance(healthy_deployments, list) or not healthy_deployments:
            return healthy_deployments  # a pinned deployment (dict) or none: nothing to choose
        request = dict(request_kwargs or {})
        if messages is not None:
            request.setdefault("messages", messages)
        roles = await self.roles_of(healthy_deployments)
        pairs = list(zip(healthy_deployments, roles, strict=True))
        if wants(request):
            self.stats.logprobs_requests += 1
            plain = [d for d, r in pairs if r is not None and r.plain]
            if plain:
                return plain
            why = "; ".join(_why(r) for _, r in pairs if r is not None)
            why = why or "no deployment has an api_base to check"
            if self.on_plain_down == "annotate":
                self.stats.annotated += 1
                return [
                    d for d, r in pairs if r is None or r.state != "down"
                ] or healthy_deployments
            self.stats.refused += 1
            from litellm.exceptions import ServiceUnavailableError

            raise ServiceUnavailableError(
                message=(
                    f"specaudit: this request asks for logprobs, which only a deployment of "
                    f"{model!r} that does not speculate can answer truthfully, and none is up "
                    f"({why})"
                ),
                llm_provider="specaudit",
                model=model,
            )
        self.stats.default_requests += 1
        spec = [d for d, r in pairs if r is not None and r.speculating]
        up = [d for d, r in pairs if r is None or r.state != "down"]
        return spec or up or healthy_deployments

    async def async_post_call_success_deployment_hook(
        self, request_data: dict, response: Any, call_type: Any
    ) -> Any:
        n = requested(request_data)
        if not n or not hasattr(response, "choices"):
            return None
        tokens, ph = check_response(response, n)
        self._count(request_data, tokens, ph)
        hidden = _hidden(response)
        if hidden is not None:
            hidden[HIDDEN_KEY] = ph
        return None

    async def async_post_call_failure_deployment_hook(
        self, request_data: Any, exception: Exception, call_type: Any, fallback_depth: Any = None
    ) -> None:
        # LiteLLM hands a read-only mapping (MappingProxyType), not a dict
        base = request_data.get("api_base") if isinstance(request_data, Mapping) else None
        if isinstance(base, str) and server_root(base) in self.roles:
            await self.check(server_root(base))

    async def async_post_call_response_headers_hook(
        self,
        data: dict,
        user_api_key_dict: Any,
        response: Any,
        request_headers: dict[str, str] | None = None,
        litellm_call_info: dict[str, Any] | None = None,
    ) -> dict[str, str] | None:
        hidden = _hidden(response)
        n = hidden.get(HIDDEN_KEY) if hidden is not None else None
        return {HEADER: str(n)} if isinstance(n, int) else None

    def _count(self, request: dict[str, Any], tokens: int, ph: int) -> None:
        self.stats.responses_checked += 1
        self.stats.tokens_checked += tokens
        self.stats.placeholders += ph
        base = request.get("api_base")
        if isinstance(base, str):
            url = server_root(base)
            self.stats.served_by[url] = self.stats.served_by.get(url, 0) + 1
            role = self.roles.get(url)
            if ph and role is not None and role.plain:
                # a "plain" server that sends placeholders speculates now: re-check it first
                role.state = "unknown"


def _why(r: Role) -> str:
    if r.state == "down":
        return f"{r.url}: down ({r.detail})"
    return f"{r.url}: " + ("speculates" if r.speculates else "/slots unreadable")


def _active() -> SpecauditRouting | None:
    import litellm

    for cb in litellm.callbacks:
        if isinstance(cb, SpecauditRouting):
            return cb
    return None


_INSTALLED = False


def _install_stream_check() -> None:
    """Check every chunk of a logprobs stream as the caller receives it (see the module doc)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from litellm.litellm_core_utils.streaming_handler import CustomStreamWrapper

    original = CustomStreamWrapper.__anext__

    async def __anext__(self: Any) -> Any:
        chunk = await original(self)
        handler = _active()
        if handler is None:
            return chunk
        state = getattr(self, "_specaudit", None)
        if state is None:
            details = getattr(self.logging_obj, "model_call_details", None) or {}
            request = {**(details.get("optional_params") or {}), **details}
            # LiteLLM drops every logprob from text-completion streams before this point:
            # nothing reaches the caller to check (or to mistake for real)
            text = "text_completion" in str(getattr(self.logging_obj, "call_type", ""))
            n = 0 if text else requested(request)
            state = self._specaudit = {"n": n, "tokens": 0, "ph": 0}
            state["request"] = request
        if state["n"]:
            tokens, ph = check_chunk(chunk, state["n"])
            state["tokens"] += tokens
            state["ph"] += ph
            handler.stats.tokens_checked += tokens
            handler.stats.placeholders += ph
            hidden = _hidden(chunk)
            if hidden is not None:
                hidden[HIDDEN_KEY] = state["ph"]
        return chunk

    CustomStreamWrapper.__anext__ = __anext__  # type: ignore[method-assign]
    _INSTALLED = True


def _from_env() -> SpecauditRouting:
    """The instance ``config.yaml`` names; SPECAUDIT_LITELLM_* variables set its options."""
    return SpecauditRouting(
        on_plain_down=os.environ.get("SPECAUDIT_LITELLM_ON_PLAIN_DOWN", "error"),
        check_interval=float(os.environ.get("SPECAUDIT_LITELLM_CHECK_INTERVAL", "10")),
    )


# ``litellm_settings: {callbacks: specaudit.integrations.litellm.handler}``
handler = _from_env()

__all__ = [
    "HEADER",
    "ON_PLAIN_DOWN",
    "Role",
    "SpecauditRouting",
    "Stats",
    "check_chunk",
    "check_entries",
    "check_response",
    "handler",
    "requested",
    "server_root",
    "wants",
]
