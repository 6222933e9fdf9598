"""Server-sent events, cut at event boundaries without re-encoding a byte.

Why events and not raw chunks: the proxy forwards each event as soon as its blank line
arrives, byte-identical, but never half an event. If a backend dies or sends garbage mid-event,
the client gets the complete events before it and then one clean error event, instead of a
torn JSON line its parser would choke on.
"""

from __future__ import annotations

import json
import re
from typing import Any

_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")


class BadEvent(ValueError):
    """A stream that is not SSE, or an event whose data is not what llama-server sends."""


class EventSplitter:
    """`split_events` for a stream fed chunk by chunk, linear in the bytes received.

    Why not ``split_events(buf + chunk)`` per chunk: a backend that sends one huge event without
    its blank line would make every chunk rescan (and copy) everything before it, quadratic in
    the event's size (a 64 MiB event cost 19 s of CPU and stalled every other request). Here
    each separator search resumes where the previous one stopped, less the separator's length
    minus one (a separator split across two chunks is still found), a position found ahead is
    kept until it is reached, and consumed bytes are dropped once per chunk. ``scanned`` counts
    the bytes the searches looked at: at most about once per separator per byte received.
    """

    _SEPS = (b"\n\n", b"\r\n\r\n")

    def __init__(self) -> None:
        self._buf = bytearray()
        # per separator: the index of its next occurrence in _buf (-1: none known), and where
        # the next search starts when that is unknown or already consumed
        self._found = [-1, -1]
        self._resume = [0, 0]
        self.scanned = 0

    @property
    def pending(self) -> int:
        """Bytes of the unfinished event held back (the per-event limit applies to this)."""
        return len(self._buf)

    def rest(self) -> bytes:
        """The unfinished event (bytes after the last complete event)."""
        return bytes(self._buf)

    def _next(self, k: int, start: int) -> int:
        """The first occurrence of separator `k` at or after `start`, or -1."""
        f = self._found[k]
        if f >= start:
            return f
        sep = self._SEPS[k]
        buf = self._buf
        pos = max(start, self._resume[k])
        r = buf.find(sep, pos)
        if r >= 0:
            self.scanned += r + len(sep) - pos
            self._resume[k] = r + 1
        else:
            self.scanned += max(len(buf) - pos, 0)
            self._resume[k] = max(start, len(buf) - len(sep) + 1)
        self._found[k] = r
        return r

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events (each with its terminating blank line) that `chunk` finished."""
        buf = self._buf
        buf += chunk
        events: list[bytes] = []
        start = 0
        with memoryview(buf) as view:
            while True:
                i = self._next(0, start)
                j = self._next(1, start)
                if i < 0 and j < 0:
                    break
                # the earlier of a LF LF and a CR LF CR LF boundary ends the event
                end = j + 4 if j >= 0 and (i < 0 or j < i) else i + 2
                events.append(bytes(view[start:end]))
                start = end
        if start:
            del buf[:start]
            self._found = [f - start if f >= start else -1 for f in self._found]
            self._resume = [max(r - start, 0) for r in self._resume]
        return events


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete events (each with its terminating blank line) and the unfinished rest."""
    s = EventSplitter()
    events = s.feed(buf)
    return events, s.rest()


def event_data(ev: bytes) -> bytes | None:
    """The event's ``data`` (lines joined by newlines), or None for a comment-only event.

    Raises `BadEvent` on a line that is not an SSE field.
    """
    data: list[bytes] = []
    for line in ev.splitlines():
        if not line:
            continue
        if line.startswith(b"data:"):
            d = line[5:]
            data.append(d[1:] if d.startswith(b" ") else d)
        elif not line.startswith(_FIELDS):
            raise BadEvent(f"not an SSE line: {line[:60]!r}")
    return b"\n".join(data) if data else None


def parse_event(ev: bytes) -> Any:
    """None for comments, the string "[DONE]", or the JSON value of the data."""
    data = event_data(ev)
    if data is None:
        return None
    if data == b"[DONE]":
        return "[DONE]"
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise BadEvent(f"event data is not JSON: {data[:60]!r}") from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def encode_json(obj: Any) -> bytes:
    """Compact JSON in UTF-8, as llama-server writes it; never fails on a lone surrogate.

    A backend may send a lone surrogate escape (``"\\ud800"``): valid JSON, and `json.loads`
    turns it into a str that UTF-8 cannot encode. Such characters can only sit inside JSON
    strings, so they are written back as the escape the backend sent; everything else stays
    UTF-8 as before.
    """
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text).encode()


def encode_event(obj: Any) -> bytes:
    """A ``data:`` event in llama-server's own layout (compact JSON, LF LF)."""
    return b"data: " + encode_json(obj) + b"\n\n"


def comment(text: str) -> bytes:
    """An SSE comment event: ignored by SSE parsers, visible to people and to tools that look."""
    return b": " + text.encode() + b"\n\n"
