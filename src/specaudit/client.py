"""HTTP client for llama-server and other OpenAI-compatible servers.

Returns the server's JSON untouched (normalising token data is `specaudit.logprobs`' job) and
turns every transport or protocol failure into a one-line `ClientError`, so the commands above
it can say "no decision" clearly instead of crashing.

Streams: llama-server closes a streamed connection although it advertised keep-alive, so each
stream is read to its end and the connection is never reused after one.

Transports: where the bytes go is an `httpx` transport, never decided here. This module is
protocol (URLs, JSON, SSE, one-line errors) and knows nothing of policy; the commands above it
(check, ab, dist, rescore) are policy and know nothing of sockets. So `Client` and
`AsyncClient` take a `transport` (None: real sockets), and `default_transport` is the one used
when none is given: the tests set it to an `httpx.MockTransport` answering from canned
handlers (tests/fakes.py), which runs a whole command in-process, down to the client its code
builds, with no socket and no server thread.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from specaudit.errors import SpecauditError

JSON = dict[str, Any]

ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "completion": "/completion",
}


class ClientError(SpecauditError):
    """The server could not be reached or did not answer like an LLM server."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class StreamResult:
    """All events of one SSE response, in order, plus what the server sent raw."""

    events: list[JSON] = field(default_factory=list)
    done: bool = False  # saw "data: [DONE]" (OpenAI endpoints) or a final stop event
    raw: bytes = b""


#: The transport of every `Client` and `AsyncClient` built without one; None: real sockets.
#: Only tests set it (a mock serves sync and async clients alike): specaudit itself never does.
default_transport: httpx.MockTransport | None = None


def _url(base: str, path: str) -> str:
    return base.rstrip("/") + path


def _describe(e: httpx.HTTPError, url: str) -> str:
    if isinstance(e, httpx.ConnectError):
        return f"cannot connect to {url} (connection refused or host unreachable)"
    if isinstance(e, httpx.TimeoutException):
        return f"timed out talking to {url}"
    return f"{type(e).__name__} talking to {url}: {e}"


def _decode(r: httpx.Response, url: str) -> JSON:
    if r.status_code >= 400:
        msg = r.text.strip().replace("\n", " ")[:200]
        try:
            body = r.json()
            err = body.get("error") if isinstance(body, dict) else None
            if isinstance(err, dict) and "message" in err:
                msg = str(err["message"])
            elif isinstance(err, str):
                msg = err
        except ValueError:
            pass
        raise ClientError(f"{url} answered HTTP {r.status_code}: {msg}", r.status_code)
    try:
        body = r.json()
    except ValueError:
        ctype = r.headers.get("content-type", "?")
        raise ClientError(f"{url} answered non-JSON ({ctype})", r.status_code) from None
    if not isinstance(body, dict | list):
        raise ClientError(f"{url} answered JSON that is not an object", r.status_code)
    return body if isinstance(body, dict) else {"_list": body}


def _decode_text(r: httpx.Response, url: str) -> str:
    """A text answer (Prometheus ``/metrics``); an HTTP error as `_decode` raises it."""
    if r.status_code >= 400:
        msg = r.text.strip().replace("\n", " ")[:200]
        raise ClientError(f"{url} answered HTTP {r.status_code}: {msg}", r.status_code)
    return r.text


def parse_sse(raw: bytes) -> StreamResult:
    """Parse a whole SSE body (``data: ...`` lines) into JSON events."""
    out = StreamResult(raw=raw)
    for line in raw.decode("utf-8", errors="replace").splitlines():
        _sse_line(line, out)
    return out


def _sse_line(line: str, out: StreamResult) -> None:
    line = line.strip()
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if data == "[DONE]":
        out.done = True
        return
    try:
        ev = json.loads(data)
    except ValueError:
        raise ClientError(f"stream carried a non-JSON event: {data[:80]!r}") from None
    if isinstance(ev, dict):
        if ev.get("stop") is True:
            out.done = True
        out.events.append(ev)


class Client:
    """Synchronous client for one server base URL.

    `transport`: where requests go (closed with the client); None: `default_transport`, or
    real sockets when that is None too.
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = 120.0,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport if transport is not None else default_transport
        self._http = httpx.Client(timeout=timeout, headers=headers, transport=self._transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, path: str) -> tuple[httpx.Response, str]:
        url = _url(self.base_url, path)
        try:
            return self._http.get(url), url
        except httpx.HTTPError as e:
            raise ClientError(_describe(e, url)) from None

    def get(self, path: str) -> JSON:
        return _decode(*self._get(path))

    def get_text(self, path: str) -> str:
        """A text answer (Prometheus ``/metrics``)."""
        return _decode_text(*self._get(path))

    def post(self, path: str, body: JSON) -> JSON:
        url = _url(self.base_url, path)
        try:
            r = self._http.post(url, json=body)
        except httpx.HTTPError as e:
            raise ClientError(_describe(e, url)) from None
        return _decode(r, url)

    def _stream_client(self) -> contextlib.AbstractContextManager[httpx.Client]:
        """A fresh connection pool for one stream on real sockets; a given transport owns its
        connections, so its streams go through it."""
        if self._transport is not None:
            return contextlib.nullcontext(self._http)
        return httpx.Client(timeout=self._http.timeout, headers=self._http.headers)

    def stream(self, path: str, body: JSON) -> StreamResult:
        """POST with ``stream: true`` and collect every SSE event (fresh connection)."""
        url = _url(self.base_url, path)
        body = {**body, "stream": True}
        out = StreamResult()
        chunks: list[bytes] = []
        try:
            with self._stream_client() as h, h.stream("POST", url, json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    _decode(r, url)
                buf = b""
                for chunk in r.iter_bytes():
                    chunks.append(chunk)
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for ln in lines:
                        _sse_line(ln.decode("utf-8", errors="replace"), out)
                if buf:
                    _sse_line(buf.decode("utf-8", errors="replace"), out)
        except httpx.HTTPError as e:
            raise ClientError(_describe(e, url)) from None
        out.raw = b"".join(chunks)
        return out


class AsyncClient:
    """Asynchronous twin of `Client` for concurrent sampling (ab, dist).

    `transport` as for `Client`; `max_connections` bounds the real-socket pool only (a given
    transport has its own).
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = 120.0,
        max_connections: int = 64,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            timeout=timeout,
            headers=headers,
            limits=httpx.Limits(max_connections=max_connections),
            transport=transport if transport is not None else default_transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _get(self, path: str) -> tuple[httpx.Response, str]:
        url = _url(self.base_url, path)
        try:
            return await self._http.get(url), url
        except httpx.HTTPError as e:
            raise ClientError(_describe(e, url)) from None

    async def get(self, path: str) -> JSON:
        return _decode(*await self._get(path))

    async def get_text(self, path: str) -> str:
        """A text answer (Prometheus ``/metrics``)."""
        return _decode_text(*await self._get(path))

    async def post(self, path: str, body: JSON) -> JSON:
        url = _url(self.base_url, path)
        try:
            r = await self._http.post(url, json=body)
        except httpx.HTTPError as e:
            raise ClientError(_describe(e, url)) from None
        return _decode(r, url)
