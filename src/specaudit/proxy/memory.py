"""Giving freed heap memory back to the system after a burst of connections or requests.

Why: every client connection and request allocates, and most of it is freed when they end,
but glibc's malloc keeps freed memory in its heap for reuse: after 2,000 idle connections
closed, the proxy's Python objects were back where they started while its resident memory
stayed megabytes higher (benchmarks/bench_proxy_soak.py). ``malloc_trim(0)`` returns the
free pages of the heap, wherever they are in it. It walks the heap, holding the event loop
(milliseconds on a fragmented one; reading how much is free, ``mallinfo2``, costs as much),
so the proxy calls it once a burst is over (`BurstWatch`), never on a timer alone.
Elsewhere than glibc (musl, macOS) there is nothing to call and `trim` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

INTERVAL = 2.0  # seconds between looks at the connections and requests (no heap walk)
CONNECTIONS_GONE = 256  # this many fewer client connections than at their peak: a burst over
REQUESTS = 5000  # requests since the last trim, and none in flight now: a load over


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc() -> Any | None:
    """glibc's malloc_trim and mallinfo2 (glibc 2.33+), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim, info = libc.malloc_trim, libc.mallinfo2
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    info.argtypes, info.restype = [], _MallInfo2
    return libc


_LIBC = _glibc()


def heap_free() -> int | None:
    """Bytes free in malloc's main heap (None where it cannot be read); walks the heap."""
    if _LIBC is None:
        return None
    return int(_LIBC.mallinfo2().fordblks)


def trim() -> bool:
    """``malloc_trim(0)``: the heap's free pages back to the system; True if it ran."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


class BurstWatch:
    """Says when a burst is over, from counts the proxy keeps anyway: the client connections
    open (their peak since the last trim) and the requests answered."""

    def __init__(self, connections: int = 0, requests: float = 0.0) -> None:
        self.peak = connections
        self.requests = requests

    def over(self, connections: int, requests: float, in_flight: int) -> bool:
        """True once per burst (then counting starts again from now)."""
        self.peak = max(self.peak, connections)
        if self.peak - connections >= CONNECTIONS_GONE or (
            requests - self.requests >= REQUESTS and in_flight == 0
        ):
            self.peak, self.requests = connections, requests
            return True
        return False
