"""The backends' role checks: ``/slots`` at start, every ``check_interval``, and at once when
something suggests a role changed (a backend dropped, the plain one sent a placeholder).

Why apart from the transports: both mark a backend down (`state.ProxyState.mark_down`, which wakes
the loop here); only the role check, over aiohttp's client, says it is up again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from specaudit.proxy.aio_client import BackendClient
from specaudit.proxy.backends import PLAIN, SPEC, State, assess, probe
from specaudit.proxy.state import ProxyState

log = logging.getLogger("specaudit.proxy")

MIN_RECHECK = 1.0  # seconds: a backend found down is re-probed at most this often per request


class Checker:
    """Probes the backends' roles; concurrent callers for one backend share one probe."""

    def __init__(self, state: ProxyState, client: BackendClient) -> None:
        self.state = state
        self.client = client
        self.keys = {PLAIN: state.config.plain_api_key, SPEC: state.config.spec_api_key}
        self.locks: dict[str, asyncio.Lock] = {}

    def start(self) -> None:
        self.locks = {PLAIN: asyncio.Lock(), SPEC: asyncio.Lock()}
        self.state.wake = asyncio.Event()

    async def check_backends(self) -> None:
        await asyncio.gather(self.check(PLAIN), self.check(SPEC))

    async def check(self, role: str, not_before: float | None = None) -> None:
        """Probe one backend; concurrent callers share one probe."""
        state = self.state
        b = state.backends[role]
        async with self.locks[role]:
            if not_before is not None and b.checked_mono >= not_before:
                return  # someone else probed while we waited
            session = self.client.probe_session
            assert session is not None
            before = (b.state, b.warning)
            p = await probe(
                session,
                b.url,
                self.keys[role],
                timeout=min(state.config.connect_timeout + 5.0, 30.0),
            )
            assess(b, p)
            state.gauges(b)
            if (b.state, b.warning) != before:
                level = logging.INFO if b.state is State.UP and not b.warning else logging.WARNING
                log.log(
                    level,
                    "%s backend %s: %s (%s)%s",
                    role,
                    b.url,
                    b.state.value,
                    b.detail,
                    f"; {b.warning}" if b.warning else "",
                )

    async def loop(self) -> None:
        """Every ``check_interval``, or at once when `state.wake` is set."""
        wake = self.state.wake
        assert wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=self.state.config.check_interval)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # `stop` cancelled this as `wake` was set: Python 3.11's wait_for then returns
                # instead of raising, and the loop would wait out a whole check_interval
                raise asyncio.CancelledError
            wake.clear()
            try:
                await self.check_backends()
            except Exception as e:  # a failed check must never stop future checks
                log.warning("backend check failed: %s", type(e).__name__)
            await asyncio.sleep(MIN_RECHECK / 2)

    async def usable(self, role: str) -> str | None:
        """None when `role` may take requests now, else why not (re-probing at most 1/s)."""
        b = self.state.backends[role]
        if b.state is State.UP:
            return None
        now = time.monotonic()
        if now - b.checked_mono >= MIN_RECHECK:
            await self.check(role, not_before=now)
        return None if b.state is State.UP else b.detail
