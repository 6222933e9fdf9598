"""specaudit as a LiteLLM callback: logprobs requests only to deployments that do not speculate,
and no placeholder ever passed off as real (docs/litellm.md).

Why a callback: people who serve many llama-server instances already run LiteLLM (the SDK
`Router`, or its proxy, which scales out across replicas with shared state) and will not put a
second router in front of it. LiteLLM loads callbacks from its own ``config.yaml``
(``litellm_settings.callbacks``); this one

- reads each deployment's role from ``/slots`` (`specaudit.speculation`, the one reader) when
  a ``Router`` is built, then every `check_interval` seconds, at once after a failed call, and
  before first use for a deployment added later;
- narrows the deployments LiteLLM may pick: a request that asks for logprobs goes only to a
  deployment seen up and not speculating; any other request prefers speculating ones;
- when no such deployment is up: ``on_plain_down="error"`` raises a 503
  `ServiceUnavailableError` naming the reason, ``"annotate"`` lets any deployment serve it;
- checks every logprobs response, non-streamed and streamed (each chunk, as the caller
  receives it): a token without the candidates that were asked for is a placeholder; its
  ``logprob`` becomes ``None``, a streamed token that came without any entry gets one with
  ``logprob: None``, and the count goes into the response's
  ``_hidden_params["specaudit_placeholders"]``, the proxy's ``x-specaudit-placeholders``
  header and `SpecauditRouting.stats`.

The same on the async paths (``Router.acompletion``/``atext_completion``, the proxy) and the
synchronous ones (``Router.completion``/``text_completion``). LiteLLM 1.100.5's hooks:

- routing: ``async_filter_deployments``, which the Router runs before every async attempt
  (retries included). The sync selection (``Router.get_available_deployment``, which the
  sync calls use, and async calls under a strategy without an async selector, e.g. the legacy
  ``usage-based-routing``) runs no filter hook (its only hook, ``pre_call_check``, sees the
  chosen deployment but not the request), so it is wrapped: before each attempt the wrapper
  adds the ids of the deployments this request must not go to to LiteLLM's own exclusion list
  (``_excluded_deployment_ids``, its weighted-failover mechanism), or raises the 503;
- checks: ``async_post_call_success_deployment_hook`` (async calls only); the sync calls have
  no post-call hook, so ``Router.completion``/``text_completion`` are wrapped; LiteLLM has no
  per-chunk hook for SDK streams (its streaming deployment hook sees the last chunk only), so
  ``CustomStreamWrapper.__anext__``/``__next__`` are wrapped, and act only on streams whose
  request asked for logprobs while a `SpecauditRouting` is registered;
- roles at start: LiteLLM has no start-up hook for callbacks (the proxy's worker start-up hooks
  run before the config, and with it the Router, is loaded), so ``Router.__init__`` is
  wrapped: once it returns (the SDK: in the constructor; the proxy: while it loads
  ``config.yaml``, after the callbacks, before it serves), every deployment's ``/slots`` read
  starts, in the background. A Router built before the handler was registered is read on
  first use instead;
- re-check after a failure: ``async_post_call_failure_deployment_hook`` (async) and
  ``log_failure_event``, which LiteLLM runs, unthreaded, before its retry picks again (sync).

Every ``/slots`` read of the start-up and periodic checks runs on the handler's checker: one
daemon thread with its own event loop, never LiteLLM's (an async filter that needs a role not
read yet awaits that read without blocking its loop; a synchronous call, which its caller
waits for anyway, waits for it). The checker stops on `SpecauditRouting.close`, at
interpreter exit, and by itself once the handler is no longer in ``litellm.callbacks``; the
next need starts it again. Wrapping happens once, when the first handler is made, and every
wrapper does nothing while no `SpecauditRouting` is in ``litellm.callbacks``
(`litellm_wrappers`). The request rule and the response checks are the proxy's own
(`litellm_checks`, over `specaudit.proxy.routing` and `specaudit.proxy.placeholders`).

LiteLLM drops every logprob from streamed text completions (``/v1/completions`` with
``stream: true``), so those streams carry neither real values nor placeholders; they are
routed, not checked.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import weakref
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
from specaudit.integrations.litellm_checks import (
    HIDDEN_KEY,
    check_chunk,
    check_entries,
    check_response,
    hidden_params,
    requested,
    server_root,
    wants,
)
from specaudit.integrations.litellm_wrappers import install, may_block

log = logging.getLogger("specaudit.litellm")

ON_PLAIN_DOWN = ("error", "annotate")
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


# ---------------------------------------------------------------------------------------------
# the callback


def _model_id(deployment: dict[str, Any]) -> str | None:
    mid = (deployment.get("model_info") or {}).get("id")
    return mid if isinstance(mid, str) and mid else None


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
        # the checker: one daemon thread with its own event loop, where every /slots read of
        # the start-up and periodic checks runs (never on LiteLLM's loop, never blocking it)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, concurrent.futures.Future[Role]] = {}
        install(_active)
        _HANDLERS.add(self)

    # --- roles ---------------------------------------------------------------------------

    async def check(self, url: str) -> Role:
        """Read one server's /slots now (`specaudit.speculation.aread`)."""
        self.roles.setdefault(url, Role(url))
        self.stats.role_checks += 1
        role = Role(url)
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
        self.roles[url] = role  # one assignment: no reader sees half a role
        return role

    async def refresh(self, urls: Iterable[str] | None = None) -> None:
        """Re-check `urls` (default: every known deployment) concurrently."""
        todo = list(dict.fromkeys(list(self.roles) if urls is None else urls))
        if todo:
            await asyncio.gather(*(self.check(u) for u in todo))

    @property
    def checking(self) -> bool:
        """Is the background checker running?"""
        t = self._thread
        return t is not None and t.is_alive()

    def _checker(self) -> asyncio.AbstractEventLoop:
        """The checker's loop, started on first need (call with the lock held)."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            return self._loop
        loop = asyncio.new_event_loop()
        t = threading.Thread(
            target=self._run, args=(loop,), name="specaudit-litellm-roles", daemon=True
        )
        self._loop, self._thread = loop, t
        t.start()
        return loop

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.create_task(self._periodic(loop))
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for t in tasks:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _periodic(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            if not _registered(self):  # taken out of litellm.callbacks: stop checking
                with self._lock:
                    if self._loop is loop:
                        self._loop = self._thread = None
                loop.stop()
                return
            try:
                await self.refresh()
            except Exception:  # a failed round must not end the checks
                log.exception("specaudit: role check failed")

    def close(self) -> None:
        """Stop the background checks (also at interpreter exit); the next need restarts them."""
        with self._lock:
            loop, t = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and t is not None and t.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            if t is not threading.current_thread():
                t.join(timeout=5 * self.check_timeout)

    def _schedule(
        self, urls: Iterable[str], force: bool = False
    ) -> list[concurrent.futures.Future[Role]]:
        """Check `urls` in the checker (one check per server in flight; `force`: a new one
        even if one is); starts the checker, and with it the periodic checks."""
        with self._lock:
            loop = self._checker()
            futs = []
            for u in dict.fromkeys(urls):
                self.roles.setdefault(u, Role(u))
                f = self._pending.get(u)
                if force or f is None or f.done():
                    f = asyncio.run_coroutine_threadsafe(self.check(u), loop)
                    self._pending[u] = f
                futs.append(f)
            return futs

    def _wait_timeout(self) -> float:
        return 2 * self.check_timeout + 1.0  # /slots and, on old builds, /props

    def wait(self, futs: list[concurrent.futures.Future[Role]]) -> None:
        """Block this (non-event-loop) thread until the checks are done."""
        if futs:
            concurrent.futures.wait(futs, timeout=self._wait_timeout())

    async def _await(self, futs: list[concurrent.futures.Future[Role]]) -> None:
        """Wait for the checks without blocking the running loop."""
        if futs:
            await asyncio.wait([asyncio.wrap_future(f) for f in futs], timeout=self._wait_timeout())

    def watch(self, deployments: Iterable[Any]) -> list[concurrent.futures.Future[Role]]:
        """Start checking these deployments' servers now, in the background, and every
        `check_interval` after (what the ``Router`` constructor calls, see
        `litellm_wrappers.install`)."""
        urls = [u for d in deployments if isinstance(d, dict) and (u := self._url(d))]
        return self._schedule([u for u in urls if self._role(u).state == "unknown"])

    def _role(self, url: str) -> Role:
        return self.roles.get(url) or Role(url)

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
        """Each deployment's role; a never-checked one is checked first (awaited, off the
        loop)."""
        urls = [self._url(d) for d in deployments]
        new = [u for u in urls if u is not None and self._role(u).state == "unknown"]
        await self._await(self._schedule(new))
        return [self._role(u) if u is not None else None for u in urls]

    def roles_now(self, deployments: list[dict[str, Any]]) -> list[Role | None]:
        """`roles_of` for the synchronous selection: waits for a never-checked server's check
        inside a sync call or off any event loop; on an event loop (LiteLLM's legacy sync
        selectors under ``acompletion``) it does not wait: the server counts as not checked
        yet, so no logprobs request goes to it."""
        urls = [self._url(d) for d in deployments]
        new = [u for u in urls if u is not None and self._role(u).state == "unknown"]
        futs = self._schedule(new)
        if may_block():
            self.wait(futs)
        return [self._role(u) if u is not None else None for u in urls]

    # --- the routing decision, shared by the async filter and the sync selection ----------

    def choose(
        self,
        model: str,
        deployments: list[dict[str, Any]],
        roles: list[Role | None],
        request: dict[str, Any],
    ) -> list[dict[str, Any]]:
        """The deployments this request may go to; raises the 503 when it asks for logprobs,
        none of them is up and plain, and ``on_plain_down="error"``."""
        pairs = list(zip(deployments, roles, strict=True))
        if wants(request):
            self.stats.logprobs_requests += 1
            plain = [d for d, r in pairs if r is not None and r.plain]
            if plain:
                return plain
            why = "; ".join(_why(r) for _, r in pairs if r is not None)
            why = why or "no deployment has an api_base to check"
            if self.on_plain_down == "annotate":
                self.stats.annotated += 1
                return [d for d, r in pairs if r is None or r.state != "down"] or deployments
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
        return spec or up or deployments

    def excluded_sync(
        self,
        router: Any,
        model: str,
        messages: list | None,
        request_kwargs: dict | None,
        request: dict[str, Any],
    ) -> list[str]:
        """The synchronous selection's filter: ids of the group's deployments (not in
        cooldown) this request must not go to, for LiteLLM's own exclusion list
        (``_excluded_deployment_ids``). [] when there is nothing to choose."""
        try:
            _, deps = router._common_checks_available_deployment(
                model=model, messages=messages, request_kwargs=request_kwargs
            )
        except Exception:  # LiteLLM's own selection raises the same again, its way
            return []
        if not isinstance(deps, list) or not deps:
            return []
        try:
            from litellm.router_utils.cooldown_handlers import _get_cooldown_deployments

            cooling = set(_get_cooldown_deployments(router, parent_otel_span=None))
        except Exception:
            cooling = set()
        healthy = [d for d in deps if isinstance(d, dict) and _model_id(d) not in cooling]
        if not healthy:
            return []
        keep = {id(d) for d in self.choose(model, healthy, self.roles_now(healthy), request)}
        return [m for d in healthy if id(d) not in keep and (m := _model_id(d)) is not None]

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
        return self.choose(model, healthy_deployments, roles, request)

    async def async_post_call_success_deployment_hook(
        self, request_data: dict, response: Any, call_type: Any
    ) -> Any:
        self.check_result(request_data, response)
        return None

    def check_result(self, request: Mapping[str, Any], response: Any) -> None:
        """The non-streamed check (the async hook and the sync calls; LiteLLM runs that hook
        in async calls only, so no response meets both): placeholders to None, the count into
        ``_hidden_params`` and `stats`."""
        n = requested(dict(request))
        if not n or not hasattr(response, "choices") or isinstance(response, _stream_type()):
            return
        hidden = hidden_params(response)
        tokens, ph = check_response(response, n)
        base = request.get("api_base") or (hidden.get("api_base") if hidden is not None else None)
        self._count({"api_base": base}, tokens, ph)
        if hidden is not None:
            hidden[HIDDEN_KEY] = ph

    async def async_post_call_failure_deployment_hook(
        self, request_data: Any, exception: Exception, call_type: Any, fallback_depth: Any = None
    ) -> None:
        # LiteLLM hands a read-only mapping (MappingProxyType), not a dict
        base = request_data.get("api_base") if isinstance(request_data, Mapping) else None
        if isinstance(base, str) and server_root(base) in self.roles:
            await self._await(self._schedule([server_root(base)], force=True))

    def log_failure_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        """The sync failure hook: LiteLLM runs it before its retry picks again (not threaded),
        so in a synchronous call a dead deployment is re-checked before the next attempt. In
        an async call it does nothing: the async failure hook above re-checks there without
        blocking the loop."""
        if not may_block() or not isinstance(kwargs, Mapping):
            return
        params = kwargs.get("litellm_params")
        base = params.get("api_base") if isinstance(params, Mapping) else None
        base = base or kwargs.get("api_base")
        if isinstance(base, str) and server_root(base) in self.roles:
            self.wait(self._schedule([server_root(base)], force=True))

    async def async_post_call_response_headers_hook(
        self,
        data: dict,
        user_api_key_dict: Any,
        response: Any,
        request_headers: dict[str, str] | None = None,
        litellm_call_info: dict[str, Any] | None = None,
    ) -> dict[str, str] | None:
        hidden = hidden_params(response)
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
                self.roles[url] = dataclasses.replace(role, state="unknown")


def _why(r: Role) -> str:
    if r.state == "down":
        return f"{r.url}: down ({r.detail})"
    if r.state == "unknown":
        return f"{r.url}: not checked yet"
    return f"{r.url}: " + ("speculates" if r.speculates else "/slots unreadable")


def _active() -> SpecauditRouting | None:
    import litellm

    for cb in litellm.callbacks:
        if isinstance(cb, SpecauditRouting):
            return cb
    return None


def _registered(h: SpecauditRouting) -> bool:
    import litellm

    return any(cb is h for cb in litellm.callbacks)


def _stream_type() -> type:
    from litellm.litellm_core_utils.streaming_handler import CustomStreamWrapper

    return CustomStreamWrapper


_HANDLERS: weakref.WeakSet[SpecauditRouting] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for h in list(_HANDLERS):
        h.close()


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
