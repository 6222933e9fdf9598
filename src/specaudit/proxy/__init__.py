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
"""

from specaudit.proxy.backends import BackendStatus, State
from specaudit.proxy.config import OnPlainDown, ProxyConfig, ProxyError, parse_listen
from specaudit.proxy.routing import Kind, Plan, RequestError, Route
from specaudit.proxy.runner import RunningProxy, run, serve_in_thread
from specaudit.proxy.server import (
    H_ANNOTATED,
    H_BACKEND,
    H_FALLBACK,
    H_PLACEHOLDERS,
    H_ROUTE,
    Proxy,
    ProxyStats,
)

__all__ = [
    "H_ANNOTATED",
    "H_BACKEND",
    "H_FALLBACK",
    "H_PLACEHOLDERS",
    "H_ROUTE",
    "BackendStatus",
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
