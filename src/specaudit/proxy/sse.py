"""Server-sent events, cut at event boundaries without re-encoding a byte.

Why events and not raw chunks: the proxy forwards each event as soon as its blank line
arrives, byte-identical, but never half an event. If a backend dies or sends garbage mid-event,
the client gets the complete events before it and then one clean error event, instead of a
torn JSON line its parser would choke on.
"""

from __future__ import annotations

import json
from typing import Any

_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")


class BadEvent(ValueError):
    """A stream that is not SSE, or an event whose data is not what llama-server sends."""


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete events (each with its terminating blank line) and the unfinished rest."""
    events: list[bytes] = []
    start = 0
    n = len(buf)
    while start < n:
        i = buf.find(b"\n\n", start)
        j = buf.find(b"\r\n\r\n", start)
        if i < 0 and j < 0:
            break
        # the earlier of a LF LF and a CR LF CR LF boundary ends the event
        end = j + 4 if j >= 0 and (i < 0 or j < i) else i + 2
        events.append(buf[start:end])
        start = end
    return events, buf[start:]


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


def encode_event(obj: Any) -> bytes:
    """A ``data:`` event in llama-server's own layout (compact JSON, LF LF)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def comment(text: str) -> bytes:
    """An SSE comment event: ignored by SSE parsers, visible to people and to tools that look."""
    return b": " + text.encode() + b"\n\n"
