"""`specaudit proxy`: an OpenAI-compatible router that never serves a placeholder as real.

The report's workaround — send requests that need logprobs to a llama-server started without
speculation, everything else to the fast one — done once, in front of every client:

- routing: ``logprobs: true``, ``top_logprobs > 0`` or ``n_probs > 0`` -> the plain backend;
  anything else -> the speculating backend (`routing`);
- role verification through ``/slots`` at start and periodically (`backends`);
- SSE forwarded event by event, byte-identical; every response to a logprobs request checked
  token by token, placeholders rewritten to ``logprob: null`` (`placeholders`);
- ``/health``, Prometheus ``/metrics``, body limit, timeouts, cancel on client disconnect,
  a deadline for clients sending their request, a graceful stop (`Proxy.stop`).

Library use: ``with serve_in_thread(ProxyConfig(plain_url, spec_url, port=0)) as p: p.url``,
or ``run(config)`` to serve in the foreground. See docs/proxy.md.

The names below are loaded on first use, so that ``specaudit.proxy.routing`` and
``specaudit.proxy.placeholders`` (what the LiteLLM callback shares with the proxy) import
without aiohttp, the forwarding core or the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specaudit.proxy.accounting import ProxyStats
    from specaudit.proxy.answers import (
        H_ANNOTATED,
        H_BACKEND,
        H_FALLBACK,
        H_PLACEHOLDERS,
        H_ROUTE,
    )
    from specaudit.proxy.backends import BackendStatus, State
    from specaudit.proxy.config import OnPlainDown, ProxyConfig, ProxyError, parse_listen
    from specaudit.proxy.lifecycle import Proxy
    from specaudit.proxy.routing import Kind, Plan, RequestError, Route
    from specaudit.proxy.runner import RunningProxy, run, serve_in_thread

_HOMES = {
    "BackendStatus": "backends",
    "State": "backends",
    "OnPlainDown": "config",
    "ProxyConfig": "config",
    "ProxyError": "config",
    "parse_listen": "config",
    "H_ANNOTATED": "answers",
    "H_BACKEND": "answers",
    "H_FALLBACK": "answers",
    "H_PLACEHOLDERS": "answers",
    "H_ROUTE": "answers",
    "ProxyStats": "accounting",
    "Kind": "routing",
    "Plan": "routing",
    "RequestError": "routing",
    "Route": "routing",
    "RunningProxy": "runner",
    "run": "runner",
    "serve_in_thread": "runner",
    "Proxy": "lifecycle",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = [
    "BackendStatus",
    "H_ANNOTATED",
    "H_BACKEND",
    "H_FALLBACK",
    "H_PLACEHOLDERS",
    "H_ROUTE",
    "Kind",
    "OnPlainDown",
    "Plan",
    "Proxy",
    "ProxyConfig",
    "ProxyError",
    "ProxyStats",
    "RequestError",
    "Route",
    "RunningProxy",
    "State",
    "parse_listen",
    "run",
    "serve_in_thread",
]
