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
    st = StreamState()
    # linear in the bytes received, however long an event grows (one 64 MiB event used
    # to cost seconds of CPU here and stall every other request)
    splitter = sse.EventSplitter()
    limit = state.config.max_response_bytes
    error: tuple[str, str] | None = None  # (metric kind, message)

    async def relay(chunk: bytes) -> bool:
        """Forward the events `chunk` completes; False when the client has gone."""
        events = splitter.feed(chunk)
        if events:
            pieces, bad = state.checks.events(events, p, st, role, check=check, annotated=annotated)
            if pieces and not await _send(state, out, b"".join(pieces), o):
                return False
            if bad is not None:
                if bad[0] == "internal":
                    raise Withheld(bad[1])
                raise sse.BadEvent(bad[1])
        if splitter.pending > limit and not st.finished:
            raise sse.BadEvent(f"an event is over {limit} bytes")
        return True

    try:
        try:
            async for chunk in resp.content.iter_any():
                if not await relay(chunk):
                    if check:
                        state.accounting.count(role, st.tally, o)
                    return out
                if st.finished:
                    break  # the stream's last event: end it now, whatever follows
        except aiohttp.ClientPayloadError:
            # broken framing: the complete events that came with it still go first
            # (aiohttp raises before handing out what it had buffered)
            if not await relay(unread(resp.content)):
                if check:
                    state.accounting.count(role, st.tally, o)
                return out
            if not st.finished:
                raise
        if not st.finished:
            error = state.checks.unfinished(splitter, st, role)
    except Withheld as e:
        error = ("internal", str(e))
    except BrokenFraming as e:
        error = (
            "upstream_garbage",
            f"the {role} backend sent an invalid stream (its answer is not valid HTTP ({e}))",
        )
    except sse.BadEvent as e:
        error = ("upstream_garbage", f"the {role} backend sent an invalid stream ({e})")
    except ShuttingDown:
        error = state.shutdown_error(role)
    except (TimeoutError, aiohttp.ServerTimeoutError):
        error = (
            "upstream_timeout",
            f"the {role} backend went silent for {state.config.read_timeout:g}s",
        )
    except (
        aiohttp.ClientPayloadError,
        aiohttp.ServerDisconnectedError,
        aiohttp.ClientOSError,
    ) as e:
        error = (
            "upstream_closed",
            f"the {role} backend {describe_error(e)} mid-stream; the response is incomplete",
        )
        state.mark_down(role, describe_error(e))
    except Exception as e:
        # a defect in the proxy mid-stream: end the stream with an error event (headers
        # are gone, so no status can say it) instead of tearing the connection
        log.exception("relaying the %s backend's stream failed", role)
        error = ("internal", withheld(role, e))
    if check:
        state.accounting.count(role, st.tally, o)
    if error is not None:
        tail = state.checks.stream_error(error, st, o, annotated)
        if not await _send(state, out, tail, o):
            return out
    with contextlib.suppress(ConnectionResetError):
        await out.write_eof()
    return out


async def _send(state: ProxyState, out: web.StreamResponse, data: bytes, o: RequestRecord) -> bool:
    """Write to the client; False when it has gone (the caller then drops upstream)."""
    try:
        await out.write(data)
        return True
    except ConnectionResetError:
        state.metrics.errors.inc("client_disconnect")
        o.status, o.note = 499, "client disconnected"
        return False
