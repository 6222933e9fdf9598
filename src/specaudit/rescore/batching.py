"""Were the run's requests served together? The engine's `/slots`, read before, during and
after sampling.

Why: a speculating llama-server verifies the drafts of every busy slot in one batch, and the
bugs that live there (one slot's draft rows read by another, a KV cell reused across slots)
stay silent when requests arrive one at a time. A PRESERVED says nothing about batching
unless the run was batched, so the run watches the engine while it samples and the report
says whether it was, and whether the engine speculated before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import httpx

from specaudit.client import AsyncClient, ClientError
from specaudit.speculation import SlotsReading, aread_slots

POLL_INTERVAL = 0.2  # seconds between /slots reads while the run samples


@dataclass(frozen=True)
class Batching:
    """What `/slots` said while the run sampled: how many slots the engine has, the most that
    were processing a request at once over `reads` reads, and how many slots speculated
    before and after. `note` says why `/slots` could not be read."""

    concurrency: int  # requests the run kept in flight
    slots: int | None = None
    reads: int = 0
    max_busy: int | None = None
    speculative_before: int | None = None
    speculative_after: int | None = None
    note: str | None = None

    @property
    def batched(self) -> bool | None:
        """Two slots or more seen busy at once; None when `/slots` never said."""
        if self.max_busy is None:
            return None
        return self.max_busy >= 2

    def summary(self) -> str:
        """One line: whether the requests were batched, and the engine's speculation."""
        return f"{self._batched_words()}; {self._speculation_words()}"

    def _batched_words(self) -> str:
        if self.slots is None:
            return f"unknown ({self.note or '/slots unreadable'})"
        if self.slots == 1:
            return "no: the engine has 1 slot, so requests ran one at a time (-np N batches them)"
        if self.concurrency == 1:
            return "no: --concurrency 1 sends one request at a time"
        if self.max_busy is None:
            return "unknown (/slots does not say which slots are busy)"
        seen = f"{self.reads} /slots reads, {self.concurrency} requests in flight"
        if self.batched:
            return f"yes: up to {self.max_busy} of {self.slots} slots busy at once ({seen})"
        return f"not seen: at most {self.max_busy} of {self.slots} slots busy at once ({seen})"

    def _speculation_words(self) -> str:
        before, after = self.speculative_before, self.speculative_after
        if before is None or self.slots is None:
            return "speculation unknown"
        words = f"{before}/{self.slots} slots speculate before, "
        words += f"{after}/{self.slots} after" if after is not None else "unread after"
        if before == 0 and not after:
            words += ": the engine did not speculate, so no speculative path was tested"
        return words


class SlotsWatch:
    """``async with SlotsWatch(url, concurrency):`` around sampling; `result` afterwards."""

    def __init__(
        self,
        url: str,
        concurrency: int,
        *,
        timeout: float = 10.0,
        interval: float = POLL_INTERVAL,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url
        self.transport = transport
        self.concurrency = concurrency
        self.timeout = timeout
        self.interval = interval
        self._client: AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._before = SlotsReading()
        self._after = SlotsReading()
        self._reads = 0
        self._max_busy: int | None = None

    async def _read(self) -> SlotsReading:
        assert self._client is not None
        try:
            return await aread_slots(self._client)
        except ClientError as e:  # unreachable: sampling will say so in its own words
            return SlotsReading(note=f"/slots unreadable: {e}")

    def _count(self, r: SlotsReading) -> None:
        if r.busy is not None:
            self._reads += 1
            self._max_busy = max(self._max_busy or 0, r.busy)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self._count(await self._read())

    async def __aenter__(self) -> Self:
        self._client = AsyncClient(self.url, timeout=self.timeout, transport=self.transport)
        self._before = await self._read()
        if self._before.total is not None:
            self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            if exc_type is None and self._before.total is not None:
                self._after = await self._read()
        finally:
            assert self._client is not None
            await self._client.aclose()

    def result(self) -> Batching:
        b = self._before
        return Batching(
            concurrency=self.concurrency,
            slots=b.total,
            reads=self._reads,
            max_busy=self._max_busy,
            speculative_before=b.speculative,
            speculative_after=self._after.speculative,
            note=b.note,
        )
