"""The proxy's accounting: what each request did, in its counters and its access log line.

Why apart from the rest of the shared state: both transports answer requests and each answer
is counted the same way (requests by endpoint, route, backend and status; errors by kind;
tokens checked and placeholders caught per backend). Keeping the counting in one place, over
one `RequestRecord` per request, is what keeps ``/metrics`` and the log the same whichever
transport served a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specaudit.proxy.backends import PLAIN
from specaudit.proxy.placeholders import PlaceholderTally

if TYPE_CHECKING:
    from specaudit.proxy.answers import UpstreamFailed
    from specaudit.proxy.metrics import Metrics

log = logging.getLogger("specaudit.proxy")
# the proxy's own endpoints: answered by the proxy itself, neither counted among the requests
# served nor in flight (a scrape of /metrics must not read itself as a request being served)
OWN_ENDPOINTS = frozenset({"/health", "/metrics"})


@dataclass
class RequestRecord:
    """What the access log line and the request counter say about one request."""

    endpoint: str = "-"
    route: str = "-"
    backend: str = "none"
    status: int = 0
    placeholders: int | None = None
    note: str = ""
    shutdown: bool = False  # ended by the proxy stopping (`Proxy.stop`)
    # how `stop` ends the request after the grace period (a stream relayed by aiohttp's path,
    # any request of the forwarding core); None: its task is cancelled and answers 503
    stop_stream: Callable[[], None] | None = None


@dataclass
class ProxyStats:
    """A snapshot of what the proxy has done (returned by `run`, shown by /health)."""

    url: str
    uptime_s: float
    on_plain_down: str
    requests: int
    requests_by_route: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    placeholders_caught: dict[str, int] = field(default_factory=dict)
    backends: dict[str, dict[str, Any]] = field(default_factory=dict)


class Accounting:
    """Counts requests, errors and checked tokens into `metrics`, and writes the access log.

    `recheck_roles` is called when the plain backend sent a placeholder: it must never, so
    its role is checked again at once."""

    def __init__(self, metrics: Metrics, recheck_roles: Callable[[], None]) -> None:
        self.metrics = metrics
        self.recheck_roles = recheck_roles

    def bad_http(self, status: int) -> None:
        self.metrics.errors.inc("bad_request")
        self.metrics.requests.inc("other", "-", "none", str(status))

    def client_timed_out(self, peer: str) -> None:
        """A client sent part of a request's headers but not all in time: it got a 408."""
        self.metrics.errors.inc("client_timeout")
        self.metrics.requests.inc("other", "-", "none", "408")
        log.info("client %s: status=408 (request headers not complete in time)", peer)

    def started(self, o: RequestRecord) -> None:
        """A request begins (by either transport): in flight, unless it only reads the proxy."""
        if o.endpoint not in OWN_ENDPOINTS:
            self.metrics.in_flight.inc()

    def account(self, method: str, o: RequestRecord, t0: float) -> None:
        """One request answered (by either transport): its counters and its access log line."""
        if o.endpoint not in OWN_ENDPOINTS:
            self.metrics.in_flight.inc(by=-1)
        dt = time.perf_counter() - t0
        self.metrics.duration_sum.inc(by=dt)
        self.metrics.duration_count.inc()
        if o.endpoint not in OWN_ENDPOINTS:
            self.metrics.requests.inc(o.endpoint, o.route, o.backend, str(o.status))
        if log.isEnabledFor(logging.INFO):
            log.info(
                "%s %s route=%s backend=%s status=%s%s %.1fms%s",
                method,
                o.endpoint,
                o.route,
                o.backend,
                o.status,
                "" if o.placeholders is None else f" placeholders={o.placeholders}",
                dt * 1000,
                f" ({o.note})" if o.note else "",
            )

    def disconnected(self, o: RequestRecord) -> None:
        # the client went away; leaving the handler closes the upstream request
        self.metrics.errors.inc("client_disconnect")
        o.status = o.status or 499
        o.note = "client disconnected"

    def failed(self, e: UpstreamFailed, o: RequestRecord) -> None:
        """A backend's unusable answer, counted (the transport answers `e.status`)."""
        self.metrics.errors.inc(e.kind)
        o.note = e.kind

    def count(self, role: str, t: PlaceholderTally, o: RequestRecord) -> None:
        o.placeholders = (o.placeholders or 0) + t.placeholders
        if t.tokens:
            self.metrics.tokens_checked.inc(role, by=t.tokens)
        if t.placeholders:
            self.metrics.placeholders.inc(role, by=t.placeholders)
            if role == PLAIN:
                # the plain backend must never send placeholders: re-check its role now
                log.warning(
                    "plain backend sent %d placeholder token(s); re-checking /slots", t.placeholders
                )
                self.recheck_roles()
