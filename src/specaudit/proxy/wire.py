"""What the proxy's forwarding core (`forwarding`) writes to clients: response heads, chunks,
Date.

Parsing is not here: requests and backend responses are read with llhttp (`httptools`, the
parser of Node.js and uvicorn; see `http1.RequestReader` and `http1.ResponseReader`). What is
left is writing, and it refuses to write a header value that could end its line: a CR, LF or
NUL in a value would let whoever chose the value add headers of their own (a backend's
``Content-Type`` once could).
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

MAX_HEAD = 8190  # bytes of a request's head the core reads (blank line included); longer: aiohttp
MAX_RESPONSE_HEAD = 65536  # bytes of a backend's response head (1xx heads before it included)


_date: tuple[int, bytes] = (0, b"")


def date_header() -> bytes:
    """``Date: ...\\r\\n``, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n")
    return _date[1]


def response_head(
    status: int,
    headers: list[tuple[str, str]],
    *,
    length: int | None,
    close: bool = False,
) -> bytes:
    """A response head for the client: ``length`` None means a chunked body.

    ValueError when a header name or value holds a CR, LF or NUL: each line the head has is
    one the proxy wrote.
    """
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    fields = "".join([f"{k}: {v}\r\n" for k, v in headers])
    # each field line adds exactly one CR and one LF: any other is inside a name or value
    if fields.count("\r") != len(headers) or fields.count("\n") != len(headers) or "\0" in fields:
        raise ValueError("a response header holds a CR, LF or NUL")
    if length is None:
        framing = "Transfer-Encoding: chunked\r\n"
    else:
        framing = f"Content-Length: {length}\r\n"
    text = f"HTTP/1.1 {status} {reason}\r\n{fields}{framing}"
    if close:
        text += "Connection: close\r\n"
    return text.encode("latin-1") + date_header() + b"\r\n"


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (never the empty last one: that is `LAST_CHUNK`)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
