"""Counters the proxy keeps, rendered as Prometheus text exposition format (version 0.0.4).

Why hand-rolled: a handful of counters and gauges do not justify a dependency, and the
proxy's event loop is single-threaded, so plain integers need no locks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{_esc(v)}"' for n, v in zip(names, values, strict=True)) + "}"


@dataclass
class Family:
    name: str
    help: str
    kind: str  # "counter" or "gauge"
    labels: tuple[str, ...] = ()
    values: Counter[tuple[str, ...]] = field(default_factory=Counter)

    def inc(self, *label_values: str, by: float = 1) -> None:
        self.values[label_values] += by  # type: ignore[assignment]

    def set(self, *label_values: str, value: float) -> None:
        self.values[label_values] = value  # type: ignore[assignment]

    def get(self, *label_values: str) -> float:
        return float(self.values.get(label_values, 0))

    def total(self) -> float:
        return float(sum(self.values.values()))

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {self.kind}"
        for key in sorted(self.values):
            v = self.values[key]
            num = str(int(v)) if float(v).is_integer() else repr(float(v))
            yield f"{self.name}{_labels(self.labels, key)} {num}"


class Metrics:
    """Every number /metrics shows."""

    def __init__(self) -> None:
        p = "specaudit_proxy_"
        self.requests = Family(
            p + "requests_total",
            "Requests answered, by endpoint, route (logprobs/default), serving backend and status.",
            "counter",
            ("endpoint", "route", "backend", "status"),
        )
        self.errors = Family(
            p + "errors_total",
            "Requests that ended in an error, by kind.",
            "counter",
            ("kind",),
        )
        self.placeholders = Family(
            p + "placeholders_caught_total",
            "Placeholder tokens rewritten to logprob null before reaching a client, by backend.",
            "counter",
            ("backend",),
        )
        self.tokens_checked = Family(
            p + "tokens_checked_total",
            "Tokens of logprobs requests whose values were checked, by backend.",
            "counter",
            ("backend",),
        )
        self.retries = Family(
            p + "upstream_retries_total",
            "Requests re-sent on a fresh connection after a backend dropped a pooled one.",
            "counter",
            ("backend",),
        )
        self.fast_path = Family(
            p + "fast_path_total",
            "Requests the forwarding core took: served there, or given back to the full HTTP "
            "stack before any byte was answered (which then served them).",
            "counter",
            ("outcome",),
        )
        self.returned = Family(
            p + "connections_returned_total",
            "Kept-alive client connections aiohttp's path gave back to the forwarding core "
            "between requests.",
            "counter",
        )
        self.backend_up = Family(
            p + "backend_up",
            "1 when the backend answered its last check and may be used in its role.",
            "gauge",
            ("backend",),
        )
        self.backend_speculating = Family(
            p + "backend_speculating",
            "1 when the backend's /slots says it speculates, 0 when not, -1 when unknown.",
            "gauge",
            ("backend",),
        )
        self.in_flight = Family(p + "in_flight", "Requests being served now.", "gauge")
        self.duration_sum = Family(
            p + "request_duration_seconds_sum", "Total time spent serving requests.", "counter"
        )
        self.duration_count = Family(
            p + "request_duration_seconds_count", "Requests timed.", "counter"
        )

    def families(self) -> list[Family]:
        return [
            self.requests,
            self.errors,
            self.placeholders,
            self.tokens_checked,
            self.retries,
            self.fast_path,
            self.returned,
            self.backend_up,
            self.backend_speculating,
            self.in_flight,
            self.duration_sum,
            self.duration_count,
        ]

    def render(self) -> str:
        lines: list[str] = []
        for fam in self.families():
            lines.extend(fam.render())
        return "\n".join(lines) + "\n"
