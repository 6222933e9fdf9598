"""HTTP/1.1 framing for the proxy's forwarding core (`fast`): just the messages OpenAI clients
and llama-server exchange, parsed strictly.

Why a parser of our own next to aiohttp's: per request, aiohttp's server and client cost the
proxy 0.5 ms of CPU (1.5 ms per 8-token stream), several times what the work itself needs.
These functions answer one question cheaply, "is this the plain case?"; whenever the answer
is no (`parse_request_head` returns None), the connection goes to aiohttp, which decides.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus

MAX_HEAD = 8190  # bytes of a request's head the fast path reads; longer ones go to aiohttp
MAX_RESPONSE_HEAD = 65536
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(rb"[\t\x20-\x7e]*")  # visible ASCII and tab: anything else, aiohttp decides
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")


@dataclass(slots=True)
class RequestHead:
    """A ``POST`` the fast path may serve: its path, body length and what it asks of the
    connection."""

    path: str
    path_b: bytes
    length: int
    close: bool  # the client sent ``Connection: close``
    authorization: bytes | None


def parse_request_head(head: bytes, paths: frozenset[bytes]) -> RequestHead | None:
    """The head of a request (without its blank line), or None unless it is a plain
    ``POST <one of paths> HTTP/1.1`` with one ``Content-Length`` and nothing the fast path
    does not handle (chunked bodies, ``Expect``, upgrades, obs-fold, non-ASCII values)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1" or parts[1] not in paths:
        return None
    length: int | None = None
    close = False
    auth: bytes | None = None
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):
            return None
        value = value.strip(b" \t")
        if not _VALUE.fullmatch(value):
            return None
        n = name.lower()
        if n == b"content-length":
            if length is not None or not value.isdigit() or len(value) > 15:
                return None
            length = int(value)
        elif n in (b"transfer-encoding", b"expect", b"upgrade"):
            return None
        elif n == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"upgrade" in tokens:
                return None
            close = close or b"close" in tokens
        elif n == b"authorization":
            if auth is not None:
                return None
            auth = value
    if length is None:
        return None
    return RequestHead(parts[1].decode("ascii"), parts[1], length, close, auth)


@dataclass(slots=True)
class ResponseHead:
    """What the fast path needs of a backend's response head."""

    status: int
    content_type: str  # the whole header value; "" when absent
    length: int | None  # Content-Length; None: chunked or until close
    chunked: bool
    close: bool  # the connection cannot carry another request

    @property
    def mime(self) -> str:
        return self.content_type.split(";", 1)[0].strip().lower()


def parse_response_head(head: bytes) -> ResponseHead:
    """A backend's response head (without its blank line); ValueError when it is not HTTP."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[1].isdigit():
        raise ValueError("not an HTTP/1.x status line")
    status = int(parts[1])
    if not 100 <= status <= 599:
        raise ValueError(f"status {status}")
    close = parts[0] == b"HTTP/1.0"
    ctype = ""
    length: int | None = None
    chunked = False
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name):
            raise ValueError("bad header line")
        value = value.strip(b" \t")
        n = name.lower()
        if n == b"content-length":
            if length is not None or not value.isdigit():
                raise ValueError("bad Content-Length")
            length = int(value)
        elif n == b"transfer-encoding":
            codings = [c.strip().lower() for c in value.split(b",")]
            if codings != [b"chunked"]:
                raise ValueError("unsupported Transfer-Encoding")
            chunked = True
        elif n == b"content-type":
            ctype = value.decode("latin-1")
        elif n == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"close" in tokens:
                close = True
            elif b"keep-alive" in tokens:
                close = False
    if chunked:
        length = None  # RFC 9112 6.3: Transfer-Encoding overrides Content-Length
    elif length is None:
        close = True  # the body runs until the connection closes
    return ResponseHead(status, ctype, length, chunked, close)


class Dechunker:
    """A chunked body fed as it arrives: the data of the chunks completed so far.

    ValueError when the framing is broken. ``done`` after the last chunk and its trailers;
    ``extra`` holds any bytes after that (a connection carrying them is not reused).
    """

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0  # bytes still to come in the current chunk
        self._crlf = False  # the CRLF after a chunk's data is next
        self._trailers = False
        self.done = False
        self.extra = b""

    def feed(self, data: bytes) -> list[bytes]:
        out: list[bytes] = []
        buf = self._buf + data if self._buf else data
        i, n = 0, len(buf)
        while i < n and not self.done:
            if self._left:
                take = min(self._left, n - i)
                out.append(buf[i : i + take] if take != n or i else buf)
                self._left -= take
                i += take
                self._crlf = self._left == 0
            elif self._crlf:
                if n - i < 2:
                    break
                if buf[i : i + 2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                i += 2
                self._crlf = False
            else:
                j = buf.find(b"\r\n", i)
                if j < 0:
                    if n - i > 4096:
                        raise ValueError("chunk header line too long")
                    break
                line = buf[i:j]
                i = j + 2
                if self._trailers:
                    self.done = not line  # a trailer field is skipped; a blank line ends
                    continue
                size = line.split(b";", 1)[0].strip(b" \t")
                if not _HEX.fullmatch(size):
                    raise ValueError("bad chunk size")
                self._left = int(size, 16)
                self._trailers = self._left == 0
        rest = buf[i:]
        if self.done:
            self.extra, self._buf = rest, b""
        else:
            self._buf = rest
        return out


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
    """A response head for the client: ``length`` None means a chunked body."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Unknown"
    lines = [f"HTTP/1.1 {status} {reason}\r\n"]
    lines += [f"{k}: {v}\r\n" for k, v in headers]
    if length is None:
        lines.append("Transfer-Encoding: chunked\r\n")
    else:
        lines.append(f"Content-Length: {length}\r\n")
    if close:
        lines.append("Connection: close\r\n")
    return "".join(lines).encode("latin-1") + date_header() + b"\r\n"


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (never the empty last one: that is `LAST_CHUNK`)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
