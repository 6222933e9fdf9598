"""HTTP/1.1 as the forwarding core reads it, with llhttp (`httptools`).

Why llhttp and not a hand-written parser: it is the parser aiohttp's own C extension is built
on (and Node.js's, and uvicorn's), strict where it matters (CRLF line ends, no obs-fold, no
Content-Length with Transfer-Encoding, no duplicate Content-Length, token names, no control
character in values). What is here decides what the core takes:

- `RequestReader` reads a request's head (its body is the ``Content-Length`` bytes after it)
  and raises `NotPlain` for anything but the plain case, which aiohttp's path then serves;
- `ResponseReader` reads a backend's responses, chunked framing included, and says when one
  is complete, broken, or followed by bytes nobody asked for.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import httptools

from specaudit.proxy import wire

log = logging.getLogger("specaudit.proxy")

# what aiohttp's request parser refuses beyond llhttp, so the core hands such requests over:
MAX_HEADERS = 128  # more headers: a 400
_SINGLE = frozenset(  # one of each at most (aiohttp's SINGLETON_HEADERS, and Authorization)
    b"authorization content-length content-location content-range content-type etag host "
    b"max-forwards server transfer-encoding user-agent".split()
)
_REFUSED = frozenset(  # never plain: chunked bodies, 100-continue, upgrades, compressed bodies
    b"transfer-encoding expect upgrade content-encoding sec-websocket-key1".split()
)
_NOTED = _SINGLE | _REFUSED | {b"connection"}  # the headers the core looks at
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # no control character but tab in a value


# reading HTTP/1.1 with llhttp ------------------------------------------------------------------


class NotPlain(Exception):
    """A request the core does not take (`RequestReader.feed`): aiohttp's path decides."""


@dataclass(slots=True)
class RequestHead:
    """A ``POST`` the core may serve: its path, body length, where the body starts and what
    it asks of the connection."""

    path: str
    path_b: bytes
    length: int
    end: int  # bytes of the head, blank line included: the body starts here
    close: bool  # the client sent ``Connection: close``
    authorization: bytes | None


class RequestReader:
    """The head of one request, fed the connection's bytes from the request's first one.

    llhttp decides whether the bytes are HTTP/1.1 and where each header is (strict: CRLF line
    ends, no obs-fold, no CL with TE, no duplicate CL, token names, no CTL in values). The
    core then takes only the plain case: ``POST <one of paths> HTTP/1.1`` with one ``Host``
    and one ``Content-Length``, visible-ASCII values, no ``Transfer-Encoding``, ``Expect``,
    ``Content-Encoding`` or upgrade, nothing aiohttp's parser refuses beyond llhttp (a second
    ``Content-Type`` or ``User-Agent``, over `MAX_HEADERS` headers), its head (blank line
    included) at most `wire.MAX_HEAD` bytes however the bytes arrive. Anything else raises
    `NotPlain` as soon as it shows, and the connection goes to aiohttp's path, whose parser
    is llhttp too.

    The parser is fed no further than the head's blank line (the first CRLF CRLF: with CRLF
    line ends required and CR refused inside a line, nothing earlier can be one), so it never
    reads a body or the next pipelined request; the body is the ``Content-Length`` bytes after
    the head.
    """

    __slots__ = ("_p", "_fed", "_url", "_headers", "_done", "_head")

    def __init__(self) -> None:
        self._p = httptools.HttpRequestParser(self)
        self._fed = 0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._done = False
        self._head: RequestHead | None = None

    # llhttp's callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._done = True

    def feed(self, buf: bytes, paths: frozenset[bytes]) -> RequestHead | None:
        """`buf`: the bytes from the request's first one (growing between calls). The head
        once it is complete and plain; None while it is incomplete; `NotPlain` otherwise."""
        if self._head is not None:
            return self._head
        fed = self._fed
        if not fed and not b"POST ".startswith(buf[:5]):
            raise NotPlain("not a POST")  # /health, /v1/models, 404s: no need to parse
        end = buf.find(b"\r\n\r\n", max(fed - 3, 0), wire.MAX_HEAD)
        stop = wire.MAX_HEAD if end < 0 else end + 4
        if stop > fed:
            try:
                self._p.feed_data(buf[fed:stop])
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as e:
                raise NotPlain(f"llhttp: {e!r}") from None
            self._fed = min(stop, len(buf))
        if not self._done:
            if end >= 0 or len(buf) >= wire.MAX_HEAD:
                raise NotPlain("the head is longer than the core reads")
            return None
        if end < 0:
            raise NotPlain("the head does not end in CRLF CRLF")
        self._head = self._plain(end + 4, paths, buf)
        return self._head

    def message(
        self, buf: bytes, paths: frozenset[bytes], max_body: int
    ) -> tuple[RequestHead, int] | None:
        """The head and the length of the whole request (head and body) once `buf` holds all
        of it; None while it does not; `NotPlain` as `feed`, or for a body over `max_body`
        (aiohttp's path answers 413)."""
        head = self.feed(buf, paths)
        if head is None:
            return None
        if head.length > max_body:
            raise NotPlain("a body over --max-body-bytes")
        total = head.end + head.length
        return (head, total) if len(buf) >= total else None

    def _plain(self, end: int, paths: frozenset[bytes], buf: bytes) -> RequestHead:
        p = self._p
        url = self._url
        if p.get_method() != b"POST" or p.get_http_version() != "1.1" or url not in paths:
            raise NotPlain("not POST <endpoint> HTTP/1.1")
        if not buf.startswith(b"POST %b HTTP/1.1\r\n" % url):
            raise NotPlain("not the request line's plain form")  # llhttp allows more spaces
        length, close, auth = _plain_headers(self._headers)
        return RequestHead(url.decode("ascii"), url, length, end, close, auth)


def _plain_headers(headers: list[tuple[bytes, bytes]]) -> tuple[int, bool, bytes | None]:
    """A plain request's ``Content-Length``, whether it closes the connection, and its
    ``Authorization``; `NotPlain` for headers the core does not take."""
    if len(headers) > MAX_HEADERS:
        raise NotPlain("too many headers")
    length: int | None = None
    close = False
    auth: bytes | None = None
    seen: set[bytes] = set()
    for name, value in headers:
        # llhttp refused control characters (tab aside) and DEL: ASCII is visible ASCII
        if not value.isascii():
            raise NotPlain("a header value that is not ASCII")
        n = name.lower()
        if n not in _NOTED:
            continue  # most headers (Accept, X-Stainless-*, ...): nothing to do
        _note(n, seen)
        if n == b"content-length":
            length = _content_length(value)
        elif n == b"connection":
            close = _connection_closes(value) or close
        elif n == b"authorization":
            auth = value.strip(b" \t")
    if length is None or b"host" not in seen:
        raise NotPlain("no Content-Length or no Host")
    return length, close, auth


def _note(n: bytes, seen: set[bytes]) -> None:
    """A header the core looks at (`n`: its lower-cased name), added to `seen`; `NotPlain`
    for one it refuses or one too many."""
    if n in _REFUSED:
        raise NotPlain(n.decode())
    if n in seen and n != b"connection":
        raise NotPlain(f"two {n.decode()} headers")
    seen.add(n)


def _content_length(value: bytes) -> int:
    value = value.strip(b" \t")
    if not value.isdigit() or len(value) > 15:
        raise NotPlain("Content-Length")
    return int(value)


def _connection_closes(value: bytes) -> bool:
    """Whether a ``Connection`` header asks to close; `NotPlain` for an upgrade."""
    tokens = {t.strip(b" \t").lower() for t in value.split(b",")}
    if b"upgrade" in tokens:
        raise NotPlain("Connection: upgrade")
    return b"close" in tokens


@dataclass(slots=True)
class ResponseHead:
    """What the core needs of a backend's response head."""

    status: int
    content_type: str  # the whole header value; "" when absent
    length: int | None  # Content-Length; None: chunked or until close
    chunked: bool
    close: bool  # the connection cannot carry another request

    @property
    def mime(self) -> str:
        return self.content_type.split(";", 1)[0].strip().lower()


class BadResponse(Exception):
    """A backend's answer the core does not vouch for (why, in its message)."""


class _Extra(Exception):
    """Bytes after a complete response: the connection is not reused."""


class ResponseReader:
    """A backend connection's responses as llhttp reads them: the head of the current one
    (a 1xx before it is skipped, as aiohttp's client skips it), its body decoded from its
    framing (``Content-Length``, chunked, or until the connection closes) and whether it is
    complete.

    `feed` sets `head`, adds the body's bytes to `pieces`, sets `complete`, and sets `error`
    when the bytes are not a valid response; body bytes that arrived before the error in the
    same read are in `pieces` all the same. A header value with a control character (CR, LF,
    NUL, ...) is an error (llhttp refuses most; this refuses them all), so no value the core
    forwards can add a header of the backend's choosing.
    """

    __slots__ = ("_p", "_headers", "_info", "_seen", "head", "pieces", "complete", "extra", "error")

    def __init__(self) -> None:
        self._p = httptools.HttpResponseParser(self)
        self.extra = False  # bytes came after a complete response
        self.error: str | None = None
        self.reset()

    def reset(self) -> None:
        """Ready for the next response on the same connection."""
        self._headers: list[tuple[bytes, bytes]] = []
        self._info = False  # in a 1xx
        self._seen = 0  # bytes fed before the head was complete
        self.head: ResponseHead | None = None
        self.pieces: list[bytes] = []
        self.complete = False

    # llhttp's callbacks
    def on_message_begin(self) -> None:
        if self.complete:
            raise _Extra

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        p = self._p
        status = p.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._headers = []  # 100 Continue, 103 Early Hints: the response follows
            self._info = True
            return
        self.head = _response_head(status, p.get_http_version(), self._headers, p)

    def on_body(self, body: bytes) -> None:
        if self._info:  # llhttp reads a body for some 1xx (199 with Content-Length); h11 never
            raise BadResponse("a 1xx response with a body")
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        if self._info:
            self._info = False
        else:
            self.complete = True

    def feed(self, data: bytes) -> None:
        if self.error is not None or self.extra:
            return  # the parser stopped; so does this connection
        if self.head is None:
            self._seen += len(data)
        try:
            self._p.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            why = e.__context__
            if isinstance(why, _Extra):
                self.extra = True
            elif isinstance(why, BadResponse):
                self.error = str(why)
            else:  # a defect in a callback: the answer is not vouched for either way
                log.error("reading a backend's answer failed: %r", why)
                self.error = f"the proxy could not read its answer ({type(why).__name__})"
        except httptools.HttpParserUpgrade:
            self.error = "it switched protocols unasked"
        except httptools.HttpParserError as e:
            if self.complete:
                self.extra = True
            else:
                self.error = f"its answer is not valid HTTP ({e})"
        if self.head is None and self.error is None and self._seen > wire.MAX_RESPONSE_HEAD:
            self.error = "its response head is too long"

    def take(self) -> bytes:
        """The body's bytes fed since the last call, in one piece."""
        pieces = self.pieces
        self.pieces = []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _response_head(
    status: int, version: str, headers: list[tuple[bytes, bytes]], p: Any
) -> ResponseHead:
    if version not in ("1.1", "1.0"):
        raise BadResponse(f"HTTP/{version}")
    if not 200 <= status <= 599:
        raise BadResponse(f"status {status}")
    ctype: str | None = None
    length: int | None = None
    chunked = False
    for name, value in headers:
        if _CTL.search(value):
            raise BadResponse("a header value holds a control character")
        n = name.lower()
        if n == b"content-length":
            length = int(value.strip(b" \t"))  # llhttp checked it: digits, only one
        elif n == b"transfer-encoding":
            chunked = _chunked(value, chunked)
        elif n == b"content-type":
            if ctype is not None:
                raise BadResponse("two Content-Type headers")  # which one? aiohttp's path says
            ctype = value.strip(b" \t").decode("latin-1")
    # llhttp knows: HTTP/1.0 without keep-alive, Connection: close, a body until close
    close = not p.should_keep_alive()
    if not chunked and length is None:
        close = True
    return ResponseHead(status, ctype or "", length, chunked, close)


def _chunked(value: bytes, chunked: bool) -> bool:
    """A ``Transfer-Encoding`` header (`chunked`: one came before): only one, only chunked."""
    codings = [c.strip(b" \t").lower() for c in value.split(b",")]
    if chunked or codings != [b"chunked"]:
        raise BadResponse("unsupported Transfer-Encoding")
    return True
