"""Whether a re-scored run's requests were batched in the engine: `/slots` read before, while
and after it samples (canned `/slots` bodies through the client's transport seam; the real
llama-server is in tests/integration/test_rescore_servers.py)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import httpx
import pytest

from specaudit.rescore.batching import Batching, SlotsWatch
from specaudit.speculation import parse_slots


def _slots(busy: int, total: int = 4, speculative: bool = True) -> list[dict[str, Any]]:
    return [{"id": i, "is_processing": i < busy, "speculative": speculative} for i in range(total)]


def test_slots_count_the_busy_ones_and_say_nothing_when_the_field_is_absent() -> None:
    assert parse_slots(_slots(3)).busy == 3
    assert parse_slots([{"id": 0, "speculative": True}]).busy is None


def _watch(bodies: Any, *, concurrency: int = 4, status: int = 200) -> Batching:
    """Run a watch over 0.2 s of 'sampling' against a transport answering `bodies` in turn."""
    it = iter(bodies)

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/slots"
        if status != 200:
            return httpx.Response(status, text="nope")
        return httpx.Response(200, json=next(it))

    async def main() -> Batching:
        watch = SlotsWatch(
            "http://127.0.0.1:9", concurrency, interval=0.01, transport=httpx.MockTransport(answer)
        )
        async with watch:
            await asyncio.sleep(0.2)
        return watch.result()

    return asyncio.run(main())


def test_a_run_whose_slots_were_busy_together_is_batched() -> None:
    busy = itertools.chain([_slots(0)], itertools.cycle([_slots(1), _slots(3), _slots(2)]))
    b = _watch(busy)
    assert b.batched is True and b.max_busy == 3 and b.slots == 4 and b.reads >= 3
    assert b.summary().startswith("yes: up to 3 of 4 slots busy at once")
    assert "4/4 slots speculate before, 4/4 after" in b.summary()


def test_one_busy_slot_at_a_time_is_not_called_batched() -> None:
    b = _watch(itertools.chain([_slots(0)], itertools.repeat(_slots(1))))
    assert b.batched is False
    assert b.summary().startswith("not seen: at most 1 of 4 slots busy at once")


def test_a_single_slot_engine_or_one_request_in_flight_cannot_batch() -> None:
    one = _watch(itertools.repeat(_slots(1, total=1)))
    assert one.summary().startswith("no: the engine has 1 slot")
    serial = _watch(itertools.repeat(_slots(1)), concurrency=1)
    assert serial.summary().startswith("no: --concurrency 1")


def test_an_engine_that_does_not_speculate_is_named() -> None:
    b = _watch(itertools.repeat(_slots(2, speculative=False)))
    assert "the engine did not speculate, so no speculative path was tested" in b.summary()


@pytest.mark.parametrize(("status", "words"), [(404, "no /slots endpoint"), (403, "API key")])
def test_an_unreadable_slots_endpoint_is_unknown_not_an_error(status: int, words: str) -> None:
    b = _watch([], status=status)
    assert b.batched is None and b.reads == 0
    assert b.summary().startswith("unknown (") and words in b.summary()
