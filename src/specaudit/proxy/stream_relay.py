"""aiohttp's path's SSE relay: a backend's stream forwarded event by event as it arrives.

Why its own module: the relay is where a stream can fail halfway (a backend that closes,
goes silent, breaks its framing or sends an event that cannot be checked; the proxy
stopping), after the client already has the headers and some events. Each failure ends the
stream with one SSE error event (`answers.AnswerChecks.stream_error`), the same event the forwarding
core sends; nothing is re-sent to a backend.
"""

from __future__ import annotations

import contextlib
import logging

import aiohttp
from aiohttp import web

from specaudit.proxy import sse
from specaudit.proxy.accounting import RequestRecord
from specaudit.proxy.aio_client import BrokenFraming, unread
from specaudit.proxy.answers import StreamState, Withheld, withheld
from specaudit.proxy.backends import describe_error
from specaudit.proxy.routing import Plan
from specaudit.proxy.state import ProxyState, ShuttingDown

log = logging.getLogger("specaudit.proxy")


async def relay_stream(
    state: ProxyState,
    request: web.BaseRequest,
    resp: aiohttp.ClientResponse,
    p: Plan,
    role: str,
    o: RequestRecord,
    headers: dict[str, str],
    check: bool,
    annotated: bool,
) -> web.StreamResponse:
    """Relay `resp`'s events to the client as they arrive; `check`: a logprobs request's
    (placeholders nulled); `annotated`: served by the speculating backend in its place (the
    count goes in an SSE comment)."""
    out = web.StreamResponse(
        status=200,
        headers={
            **headers,
            "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )
    # `stop` ends the relay through its upstream body (`ShuttingDown`)
    o.stop_stream = lambda: resp.content.set_exception(ShuttingDown())
    if o.shutdown:
        resp.content.set_exception(ShuttingDown())
    await out.prepare(request)
    relay = _SseRelay(state, out, p, role, o, check=check, annotated=annotated)
    try:
        if not await relay.run(resp):
            relay.count()  # the client went away: nothing more to write
            return out
        error = relay.unfinished()
    except Exception as e:
        error = relay.failure(e)
    await relay.end(error)
    return out


class _SseRelay:
    """One stream's relay: the events forwarded so far, and how the stream ends."""

    def __init__(
        self,
        state: ProxyState,
        out: web.StreamResponse,
        p: Plan,
        role: str,
        o: RequestRecord,
        *,
        check: bool,
        annotated: bool,
    ) -> None:
        self.state, self.out, self.p, self.role, self.o = state, out, p, role, o
        self.check, self.annotated = check, annotated
        self.st = StreamState()
        # linear in the bytes received, however long an event grows (one 64 MiB event used
        # to cost seconds of CPU here and stall every other request)
        self.splitter = sse.EventSplitter()
        self.limit = state.config.max_response_bytes

    async def run(self, resp: aiohttp.ClientResponse) -> bool:
        """Forward events until the stream's last one or the backend's end; False when the
        client has gone. Raises what broke the stream (`failure` says what it means)."""
        try:
            async for chunk in resp.content.iter_any():
                if not await self.feed(chunk):
                    return False
                if self.st.finished:
                    break  # the stream's last event: end it now, whatever follows
        except aiohttp.ClientPayloadError:
            # broken framing: the complete events that came with it still go first
            # (aiohttp raises before handing out what it had buffered)
            if not await self.feed(unread(resp.content)):
                return False
            if not self.st.finished:
                raise
        return True

    async def feed(self, chunk: bytes) -> bool:
        """Forward the events `chunk` completes; False when the client has gone."""
        events = self.splitter.feed(chunk)
        if events:
            pieces, bad = self.state.checks.events(
                events, self.p, self.st, self.role, check=self.check, annotated=self.annotated
            )
            if pieces and not await _send(self.state, self.out, b"".join(pieces), self.o):
                return False
            if bad is not None:
                if bad[0] == "internal":
                    raise Withheld(bad[1])
                raise sse.BadEvent(bad[1])
        if self.splitter.pending > self.limit and not self.st.finished:
            raise sse.BadEvent(f"an event is over {self.limit} bytes")
        return True

    def unfinished(self) -> tuple[str, str] | None:
        """Why a stream the backend ended cleanly is incomplete, if it is."""
        if self.st.finished:
            return None
        return self.state.checks.unfinished(self.splitter, self.st, self.role)

    def failure(self, e: Exception) -> tuple[str, str]:
        """What broke the stream, as ``(metric kind, message)`` for its error event."""
        role = self.role
        if isinstance(e, Withheld):
            return ("internal", str(e))
        if isinstance(e, BrokenFraming):
            return (
                "upstream_garbage",
                f"the {role} backend sent an invalid stream (its answer is not valid HTTP ({e}))",
            )
        if isinstance(e, sse.BadEvent):
            return ("upstream_garbage", f"the {role} backend sent an invalid stream ({e})")
        if isinstance(e, ShuttingDown):
            return self.state.shutdown_error(role)
        if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
            return (
                "upstream_timeout",
                f"the {role} backend went silent for {self.state.config.read_timeout:g}s",
            )
        if isinstance(
            e, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError | aiohttp.ClientOSError
        ):
            self.state.mark_down(role, describe_error(e))
            return (
                "upstream_closed",
                f"the {role} backend {describe_error(e)} mid-stream; the response is incomplete",
            )
        # a defect in the proxy mid-stream: end the stream with an error event (headers
        # are gone, so no status can say it) instead of tearing the connection
        log.exception("relaying the %s backend's stream failed", role)
        return ("internal", withheld(role, e))

    def count(self) -> None:
        if self.check:
            self.state.accounting.count(self.role, self.st.tally, self.o)

    async def end(self, error: tuple[str, str] | None) -> None:
        """The stream's end: counted, its error event if any, then the last chunk."""
        self.count()
        if error is not None:
            tail = self.state.checks.stream_error(error, self.st, self.o, self.annotated)
            if not await _send(self.state, self.out, tail, self.o):
                return
        with contextlib.suppress(ConnectionResetError):
            await self.out.write_eof()


async def _send(state: ProxyState, out: web.StreamResponse, data: bytes, o: RequestRecord) -> bool:
    """Write to the client; False when it has gone (the caller then drops upstream)."""
    try:
        await out.write(data)
        return True
    except ConnectionResetError:
        state.metrics.errors.inc("client_disconnect")
        o.status, o.note = 499, "client disconnected"
        return False
