"""The proxy gives freed heap memory back to the system (glibc's malloc_trim) once a burst
of connections or requests is over."""

from __future__ import annotations

from pathlib import Path

import pytest

from specaudit.proxy import memory


def rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(memory.heap_free() is None, reason="needs glibc 2.33+")
def test_freed_memory_in_the_middle_of_the_heap_goes_back_to_the_system() -> None:
    # 2 KB objects come from malloc's heap (not mmap); the one kept at the end holds the heap's
    # top, so malloc cannot give the freed space back by itself
    blocks = [bytes(2000) for _ in range(20_000)]
    keep = bytes(2000)
    del blocks
    free = memory.heap_free()
    assert free is not None and free >= 30_000_000
    before = rss_kb()
    assert memory.trim()
    assert before - rss_kb() >= 20_000  # at least 20 of the ~40 MB freed
    assert keep


def test_a_burst_of_connections_is_over_once_many_of_them_have_closed() -> None:
    w = memory.BurstWatch(connections=10)
    assert not w.over(2000, requests=0, in_flight=0)  # the burst
    assert not w.over(2000 - memory.CONNECTIONS_GONE + 1, requests=0, in_flight=0)
    assert w.over(2000 - memory.CONNECTIONS_GONE, requests=0, in_flight=0)
    assert w.over(10, requests=0, in_flight=0)  # counting from the last trim: 1,734 more gone
    assert not w.over(10, requests=0, in_flight=0)  # once: nothing more has closed since


def test_a_load_of_requests_is_over_when_nothing_is_in_flight() -> None:
    w = memory.BurstWatch()
    assert not w.over(5, requests=memory.REQUESTS, in_flight=3)  # still going
    assert w.over(5, requests=memory.REQUESTS, in_flight=0)
    assert not w.over(5, requests=memory.REQUESTS + 1, in_flight=0)
