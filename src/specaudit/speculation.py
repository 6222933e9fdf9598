"""Does a server speculate? The one place that reads `/slots`, `/props`, a response's own
``generation_settings`` and vLLM's ``/metrics`` for that.

Why one module: llama-server's ``/props`` says ``speculative.types: none`` even when it
speculates, while ``/slots`` reports ``"speculative": true`` per slot. Every capability (check,
ab, dist, the audit, the proxy) needs the same answer, and five hand-rolled readings had
already drifted apart (truthiness vs ``is True``, a list-valued ``speculative.types`` rendered
two ways). The parsing here is pure (bodies in, a typed record out), so it is unit-tested on
recorded real responses; `read` and `aread` are thin sync and async callers.

vLLM has neither `/slots` nor `/props`. Its Prometheus ``/metrics`` registers the
``vllm:spec_decode_*`` counters only when the server was started with a speculative config, so
their presence among its ``vllm:`` metrics says that it speculates, their absence that it does
not (`parse_metrics`); `read` asks ``/metrics`` when `/slots` cannot be read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specaudit.client import AsyncClient, Client

JSON = dict[str, Any]


@dataclass(frozen=True)
class SlotsReading:
    """What a `/slots` body says; `note` explains why nothing could be read."""

    total: int | None = None
    speculative: int | None = None
    note: str | None = None
    busy: int | None = None  # slots processing a request right now (``is_processing``)


# vLLM's speculative-decoding counters (vllm/v1/metrics/loggers.py, SpecDecodingProm)
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


@dataclass(frozen=True)
class MetricsReading:
    """What a Prometheus ``/metrics`` text says about speculation; `engine` is "vLLM" when it
    has vLLM's own metrics (None: not vLLM, or `note` says why nothing was read)."""

    engine: str | None = None
    drafted: int | None = None  # draft tokens proposed since the server started
    accepted: int | None = None
    note: str | None = None

    @property
    def speculates(self) -> bool | None:
        if self.engine is None:
            return None
        return self.drafted is not None

    def describe(self) -> str:
        if self.speculates:
            return (
                f"vLLM's /metrics has speculative-decoding counters ({self.drafted} draft "
                f"tokens, {self.accepted} accepted since it started)"
            )
        if self.engine is not None:
            return "vLLM's /metrics has no speculative-decoding counters"
        return self.note or "/metrics has no vLLM metrics"


@dataclass(frozen=True)
class SpeculationInfo:
    """Whether a server speculates, in the words of each source."""

    slots: SlotsReading
    props_types: str | None = None  # /props default_generation_settings speculative.types
    total_slots: int | None = None  # /props total_slots
    metrics: MetricsReading | None = None  # /metrics, read when /slots could not be

    @property
    def slots_total(self) -> int | None:
        return self.slots.total

    @property
    def slots_speculative(self) -> int | None:
        return self.slots.speculative

    @property
    def slots_note(self) -> str | None:
        return self.slots.note

    @property
    def speculates(self) -> bool | None:
        """The truth from /slots, else from vLLM's /metrics; None when neither says."""
        if self.slots.speculative is None:
            return self.metrics.speculates if self.metrics is not None else None
        return self.slots.speculative > 0

    @property
    def hidden(self) -> bool:
        """Speculates while /props claims it does not (vLLM, without /props, says it openly
        in /metrics)."""
        if self.slots.speculative is None:
            return False
        return bool(self.speculates) and claims_none(self.props_types)

    @property
    def parallel(self) -> int:
        """Concurrent requests the server serves: /slots, else /props total_slots, else 1."""
        if self.slots.total:
            return self.slots.total
        if self.total_slots:
            return self.total_slots
        return 1

    def describe(self) -> str:
        """One line for tables: 'hidden: /props says none, /slots says 4/4 speculate'."""
        if self.slots.total is None:
            if self.metrics is not None and self.metrics.speculates is not None:
                lead = "speculates" if self.metrics.speculates else "does not speculate"
                return f"{lead}: {self.metrics.describe()}"
            return f"unknown: {self.slots.note or 'no /slots'}"
        n, k = self.slots.total, self.slots.speculative or 0
        if k and claims_none(self.props_types):
            return f"hidden: /props says {self.props_types}, /slots says {k}/{n} speculate"
        if k:
            return "speculates (both agree)"
        return "does not speculate"


# ---------------------------------------------------------------------------------------------
# pure parsing


def slot_list(body: Any) -> list[Any] | None:
    """The slot list of a `/slots` answer: llama-server sends a JSON array (which the
    project's clients wrap as ``{"_list": [...]}``)."""
    if isinstance(body, dict):
        body = body.get("_list")
    return body if isinstance(body, list) else None


def parse_slots(body: Any) -> SlotsReading:
    """Count the slots that speculate. A slot speculates when its ``speculative`` is ``true``
    (the JSON boolean; anything else is not a claim to speculate)."""
    slots = slot_list(body)
    if slots is None:
        return SlotsReading(note="/slots did not answer a list")
    dicts = [s for s in slots if isinstance(s, dict)]
    if not any("speculative" in s for s in dicts):
        return SlotsReading(note="/slots has no per-slot speculative field")
    busy = (
        sum(1 for s in dicts if s.get("is_processing") is True)
        if any("is_processing" in s for s in dicts)
        else None
    )
    return SlotsReading(
        len(slots), sum(1 for s in dicts if s.get("speculative") is True), busy=busy
    )


def format_types(t: Any) -> str | None:
    """``speculative.types`` as one string: a list becomes comma-separated."""
    if t is None:
        return None
    if isinstance(t, list | tuple):
        return ",".join(str(x) for x in t)
    if isinstance(t, str):
        return t
    return json.dumps(t)


def props_types(props: Any) -> str | None:
    """``default_generation_settings.params["speculative.types"]`` of a `/props` body."""
    if not isinstance(props, dict):
        return None
    dgs = props.get("default_generation_settings")
    params = dgs.get("params") if isinstance(dgs, dict) else None
    if not isinstance(params, dict):
        return None
    return format_types(params.get("speculative.types", params.get("speculative.type")))


def props_total_slots(props: Any) -> int | None:
    n = props.get("total_slots") if isinstance(props, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def response_types(body: Any) -> str | None:
    """``speculative.types`` a native response echoes in its own ``generation_settings``."""
    gs = body.get("generation_settings") if isinstance(body, dict) else None
    if not isinstance(gs, dict):
        return None
    return format_types(gs.get("speculative.types", gs.get("speculative.type")))


def prometheus_counters(text: str, names: Sequence[str]) -> dict[str, float]:
    """The sum over labels of each counter in `names` in Prometheus text; absent ones left
    out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            out[name] = out.get(name, 0.0) + value
    return out


def parse_metrics(text: str) -> MetricsReading:
    """vLLM's speculation from its ``/metrics`` text: its spec-decode counters, registered only
    when it speculates. Not vLLM (no ``vllm:`` metric): a reading with engine None."""
    if not any(line.startswith("vllm:") for line in text.splitlines()):
        return MetricsReading(note="/metrics has no vLLM metrics")
    c = prometheus_counters(text, (VLLM_DRAFTS, VLLM_DRAFTED, VLLM_ACCEPTED))
    if VLLM_DRAFTED not in c and VLLM_DRAFTS not in c:
        return MetricsReading("vLLM")
    return MetricsReading("vLLM", round(c.get(VLLM_DRAFTED, 0.0)), round(c.get(VLLM_ACCEPTED, 0.0)))


def claims_none(types: str | None) -> bool:
    """Whether a ``speculative.types`` string says "no speculation" (or says nothing)."""
    return types is None or all(p.strip() in ("", "none") for p in types.split(","))


def parse(
    slots: Any,
    props: Any,
    slots_note: str | None = None,
    metrics: MetricsReading | None = None,
) -> SpeculationInfo:
    """One record from a `/slots` body (None: not readable, see `slots_note`), `/props` and,
    when read, `/metrics`."""
    reading = parse_slots(slots) if slots is not None else SlotsReading(note=slots_note)
    return SpeculationInfo(reading, props_types(props), props_total_slots(props), metrics)


def _metrics_note(e: Exception, status: int | None) -> MetricsReading:
    if status in (404, 405, 501):
        return MetricsReading(note="no /metrics endpoint")
    return MetricsReading(note=f"/metrics unreadable: {e}")


# ---------------------------------------------------------------------------------------------
# callers


def _slots_note(status: int | None, error: str) -> str:
    if status in (404, 405, 501):
        return "no /slots endpoint"
    if status in (401, 403):
        return f"/slots needs an API key (HTTP {status})"
    return f"/slots unreadable: {error}"


def read(client: Client) -> SpeculationInfo:
    """Read `/slots` and `/props`. An unreachable server raises `ClientError`: nothing else
    would work either; an HTTP error on one endpoint only leaves that source unread."""
    from specaudit.client import ClientError

    slots: Any = None
    note: str | None = None
    try:
        slots = client.get("/slots")
    except ClientError as e:
        if e.status is None:
            raise
        note = _slots_note(e.status, str(e))
    props: Any = None
    try:
        props = client.get("/props")
    except ClientError as e:
        if e.status is None:
            raise
    metrics: MetricsReading | None = None
    if slots is None:
        try:
            metrics = parse_metrics(client.get_text("/metrics"))
        except ClientError as e:
            if e.status is None:
                raise
            metrics = _metrics_note(e, e.status)
    return parse(slots, props, note, metrics)


async def aread_slots(client: AsyncClient) -> SlotsReading:
    """`/slots` alone (no `/props`): the cheap read a watch repeats while requests run. An
    unreachable server raises `ClientError`; an HTTP error is a reading with a `note`."""
    from specaudit.client import ClientError

    try:
        return parse_slots(await client.get("/slots"))
    except ClientError as e:
        if e.status is None:
            raise
        return SlotsReading(note=_slots_note(e.status, str(e)))


async def aread(client: AsyncClient) -> SpeculationInfo:
    """`read` for the async client."""
    from specaudit.client import ClientError

    slots: Any = None
    note: str | None = None
    try:
        slots = await client.get("/slots")
    except ClientError as e:
        if e.status is None:
            raise
        note = _slots_note(e.status, str(e))
    props: Any = None
    try:
        props = await client.get("/props")
    except ClientError as e:
        if e.status is None:
            raise
    metrics: MetricsReading | None = None
    if slots is None:
        try:
            metrics = parse_metrics(await client.get_text("/metrics"))
        except ClientError as e:
            if e.status is None:
                raise
            metrics = _metrics_note(e, e.status)
    return parse(slots, props, note, metrics)


__all__ = [
    "SlotsReading",
    "SpeculationInfo",
    "aread",
    "aread_slots",
    "claims_none",
    "format_types",
    "parse",
    "parse_slots",
    "props_total_slots",
    "props_types",
    "read",
    "response_types",
    "slot_list",
]
