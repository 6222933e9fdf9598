"""Role verification: does each backend do what its role promises?

Why /slots: llama-server's ``/props`` says ``speculative.types: none`` even when it speculates;
``/slots`` reports ``"speculative": true`` per slot (read by `specaudit.speculation`, the one
place that parses it). A "plain" backend that speculates would return placeholders for every
logprobs request, so it must not serve them. A "spec" backend that does not speculate only
costs speed, so that is a warning.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp

from specaudit import speculation

PLAIN, SPEC = "plain", "spec"  # the two backends' roles: the non-speculating one, the fast one


class State(StrEnum):
    UNKNOWN = "unknown"  # not checked yet
    UP = "up"  # reachable and fit for its role
    DOWN = "down"  # unreachable, loading, or answering errors
    UNUSABLE = "unusable"  # reachable but unfit for its role (a plain backend that speculates)


@dataclass
class BackendStatus:
    role: str  # "plain" or "spec"
    url: str
    state: State = State.UNKNOWN
    speculating: bool | None = None  # from /slots; None when it cannot be read
    slots: int | None = None
    slots_speculative: int | None = None
    detail: str = "not checked yet"
    warning: str | None = None
    checked_at: float | None = None  # time.time() of the last check
    checked_mono: float = 0.0  # time.monotonic() of the last check

    @property
    def usable(self) -> bool:
        return self.state is State.UP

    def public(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": self.state.value,
            "speculating": self.speculating,
            "slots": self.slots,
            "slots_speculative": self.slots_speculative,
            "detail": self.detail,
            "warning": self.warning,
            "checked_at": self.checked_at,
        }


@dataclass
class Probe:
    reachable: bool
    health_status: int | None = None
    slots: list[Any] | None = None
    slots_status: int | None = None
    error: str = ""


def describe_error(e: BaseException) -> str:
    """One line naming what went wrong, never headers or bodies (they may hold secrets)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        err = e.os_error
        if isinstance(err, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect ({os.strerror(err.errno) if err.errno else type(err).__name__})"
    if isinstance(e, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timed out"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "closed the connection"
    if isinstance(e, aiohttp.ClientPayloadError):
        return "closed the connection mid-response"
    if isinstance(e, aiohttp.ClientOSError):
        return f"connection error ({e.strerror or 'OS error'})"
    return type(e).__name__


async def probe(
    session: aiohttp.ClientSession, url: str, api_key: str | None, timeout: float
) -> Probe:
    """GET /health and /slots on a fresh connection."""
    t = aiohttp.ClientTimeout(total=timeout)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(url + "/health", timeout=t) as r:
            await r.read()
            health = r.status
        async with session.get(url + "/slots", timeout=t, headers=headers) as r:
            raw = await r.read()
            slots_status = r.status
        slots = None
        if slots_status == 200:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            slots = body if isinstance(body, list) else None
        return Probe(True, health, slots, slots_status)
    except (TimeoutError, aiohttp.ClientError) as e:
        return Probe(False, error=describe_error(e))


def assess(status: BackendStatus, p: Probe) -> None:
    """Update `status` from a probe: the role rules live here."""
    status.checked_at = time.time()
    status.checked_mono = time.monotonic()
    status.warning = None
    if not p.reachable:
        status.state = State.DOWN
        status.detail = p.error
        return
    if p.health_status != 200:
        status.state = State.DOWN
        status.detail = f"/health answered HTTP {p.health_status} (loading or failing)"
        return
    reading = speculation.parse_slots(p.slots) if p.slots is not None else None
    if reading is None or reading.total is None:
        status.speculating = None
        status.slots = status.slots_speculative = None
        status.state = State.UP
        status.detail = "reachable"
        why = (
            f"/slots answered HTTP {p.slots_status}" if reading is None else reading.note or ""
        ) + (
            " (set SPECAUDIT_" + status.role.upper() + "_API_KEY)"
            if p.slots_status in (401, 403)
            else " (start llama-server without --no-slots)"
            if p.slots_status in (404, 501)
            else ""
        )
        status.warning = (
            f"cannot verify the {status.role} role: {why}; responses are still checked "
            "token by token"
        )
        return
    n, k = reading.total, reading.speculative or 0
    status.slots, status.slots_speculative = n, k
    status.speculating = k > 0
    if status.role == "plain":
        if k:
            status.state = State.UNUSABLE
            status.detail = (
                f"speculates (/slots: {k}/{n} slots speculative): its logprobs would be "
                "placeholders; start it without -md/--spec-type"
            )
        else:
            status.state = State.UP
            status.detail = f"does not speculate (/slots: 0/{n})"
        return
    status.state = State.UP
    if k:
        status.detail = f"speculates (/slots: {k}/{n})"
    else:
        status.detail = f"does not speculate (/slots: 0/{n})"
        status.warning = (
            "the spec backend does not speculate: requests without logprobs get no speed-up"
        )
