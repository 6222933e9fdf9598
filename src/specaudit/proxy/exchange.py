"""One request of the forwarding core, from the backend's connection to the client's last byte.

`Upstream` is one connection to a backend (llhttp reads its answers, `http1.ResponseReader`);
`Exchange` drives one request over it by callbacks; `Relay` forwards a stream event by event.

The re-send rule (docs/proxy.md, "When a request is sent twice") lives here for the core:

- the connection was refused or timed out: nothing was written, so the request goes, with
  its plan, to aiohttp's path, which marks the backend down and falls back
  (`ClientConnection.give_back`);
- the backend closed a reused kept-alive connection without a byte of answer: re-sent once on
  a fresh connection (llama-server closes idle kept-alive connections; a backend that died
  refuses the fresh one, so nothing is generated twice);
- the backend answered 503 (llama-server's "not taking requests": loading, no slot; it
  generated nothing): as a refused connection;
- anything else once the request was written (another status, a body that is not JSON, too
  large, garbage, silence, a connection closed mid-answer): answered here, never re-sent: the
  backend's own status and JSON error body, a 502/504 JSON error, or, once a stream began, an
  SSE error event (all built by the shared layer, `answers`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Protocol, cast

from specaudit.proxy import sse, wire
from specaudit.proxy.accounting import RequestRecord
from specaudit.proxy.answers import H_BACKEND, H_ROUTE, StreamState, UpstreamFailed, error_body
from specaudit.proxy.http1 import RequestHead, ResponseHead, ResponseReader
from specaudit.proxy.pool import Target
from specaudit.proxy.routing import Plan, Route
from specaudit.proxy.state import ProxyState

log = logging.getLogger("specaudit.proxy")


class ClientConnection(Protocol):
    """The client connection an exchange answers on (`forwarding.Front`)."""

    px: ProxyState

    def write(self, data: bytes) -> None: ...

    def done(self, close: bool) -> None: ...

    def give_back(self, ex: Exchange, failed: tuple[str, str]) -> None: ...


class _GiveBack(Exception):
    """The backend did not take the request (a 503): aiohttp's path serves it elsewhere."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Upstream(asyncio.Protocol):
    """One connection to a backend, carrying one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self.sink: Exchange | None = None
        self.reader = ResponseReader()
        self._told = False  # the sink has the current response's head
        self.reusable = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        sink, self.sink = self.sink, None
        if sink is not None:
            head = self.reader.head if self._told else None
            if head is not None and head.length is None and not head.chunked:
                sink.on_end()  # a body delimited by the connection's close
            else:
                sink.on_lost(exc)

    def send(self, data: bytes, sink: Exchange) -> None:
        self.sink = sink
        self.reader.reset()
        self._told = False
        self.reusable = False
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        self.sink = None
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # bytes nobody asked for: this connection cannot be trusted again
            self.close()
            return
        sink.last = sink.loop.time()
        r = self.reader
        r.feed(data)
        if r.head is not None and not self._told:
            self._told = True
            if not sink.on_head(r.head):
                return
        if r.pieces:
            # what arrived together goes on together: one pass, one write to the client
            sink.on_data(r.take())
            if self.sink is not sink:
                return
        if r.complete:
            self._finish(sink, extra=r.extra or r.error is not None)
        elif r.error is not None:
            sink.on_garbage(r.error)

    def _finish(self, sink: Exchange, extra: bool) -> None:
        head = self.reader.head
        assert head is not None
        self.sink = None
        self.reusable = not (extra or head.close or self.lost)
        sink.on_end()


class Exchange:
    """One request served by the core. Driven by callbacks (a task only to open a
    connection); `Proxy.stop` waits for its future and ends it through
    ``outcome.stop_stream``."""

    def __init__(self, front: ClientConnection, head: RequestHead, p: Plan, role: str, raw: bytes):
        self.front, self.head, self.p, self.role, self.raw = front, head, p, role, raw
        self.px = px = front.px
        self.loop = loop = asyncio.get_running_loop()
        self.t0 = time.perf_counter()
        self.last = 0.0  # loop time of the backend's last byte
        self.check = p.route is Route.LOGPROBS
        self.up: Upstream | None = None
        self.pooled = False
        self.attempt = 0
        self.written = False  # the request's bytes went to a backend (never re-sent then)
        self.resp: ResponseHead | None = None
        self.body: list[bytes] = []
        self.size = 0
        self.sent = False  # bytes of an answer have gone to the client
        self.stream: Relay | None = None
        self.finished = False
        self._timer: asyncio.TimerHandle | None = None
        self.outcome = o = RequestRecord(endpoint=head.path, route=p.route.value, backend=role)
        o.stop_stream = self.shut_down
        self.done: asyncio.Future[None] = loop.create_future()
        px.inflight[self.done] = o
        self.done.add_done_callback(px.request_done)
        px.pool.busy[role] += 1
        px.accounting.started(o)

    # sending --------------------------------------------------------------------------------

    def start(self) -> None:
        up = None if self.p.stream or self.attempt else self.px.pool.get(self.role)
        if up is None:
            self.loop.create_task(self._connect())
        else:
            self.pooled = True
            self._send(cast(Upstream, up))

    async def _connect(self) -> None:
        t = self.px.pool.targets[self.role]
        assert t is not None
        try:
            async with asyncio.timeout(self.px.config.connect_timeout):
                _, up = await self.loop.create_connection(Upstream, t.host, t.port)
        except TimeoutError:
            why = f"connect timed out after {self.px.config.connect_timeout:g}s"
            self.finish("give-back", failed=why)
            return
        except OSError as e:
            why = (
                "connection refused"
                if isinstance(e, ConnectionRefusedError)
                else (f"cannot connect ({e.strerror or type(e).__name__})")
            )
            self.finish("give-back", failed=why)  # nothing was written: it may go elsewhere
            return
        if self.finished:  # the client left (or the proxy stopped) meanwhile
            up.close()
            return
        self.pooled = False
        self._send(up)

    def _send(self, up: Upstream) -> None:
        self.up = up
        self.last = self.loop.time()
        t = self.px.pool.targets[self.role]
        assert t is not None
        self.written = True
        up.send(self._request_bytes(t), self)
        if self._timer is None:
            self._timer = self.loop.call_at(
                self.last + self.px.config.read_timeout, self._read_timeout
            )

    def _request_bytes(self, t: Target) -> bytes:
        h = self.head
        body = self.p.body
        auth = b"Authorization: " + h.authorization + b"\r\n" if h.authorization else b""
        return (
            b"POST %b%b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%b\r\n%b"
            % (
                t.prefix_b,
                h.path_b,
                t.host_header,
                len(body),
                auth,
                body,
            )
        )

    def _read_timeout(self) -> None:
        """The backend's longest silence, checked lazily (no timer per byte)."""
        left = self.last + self.px.config.read_timeout - self.loop.time()
        if left > 0:
            self._timer = self.loop.call_later(left, self._read_timeout)
            return
        self._timer = None
        if self.stream is not None:
            self.stream.end(self.stream.timeout_error())
            self.finish("end")
        else:
            self.finish("timeout")

    # the backend's side (called by `Upstream`) --------------------------------------------

    def on_head(self, head: ResponseHead) -> bool:
        self.resp = head
        if head.status == 200 and head.mime == "text/event-stream" and self.p.stream:
            self.stream = Relay(self, self.outcome)
            self.sent = True
            self.front.write(
                wire.response_head(
                    200,
                    [
                        *self._headers(),
                        ("Content-Type", head.content_type or "text/event-stream"),
                        ("Cache-Control", "no-cache"),
                        ("X-Accel-Buffering", "no"),
                    ],
                    length=None,
                    close=self.head.close,
                )
            )
        elif head.length is not None and head.length > self.px.config.max_response_bytes:
            self._too_large()
            return False
        return True

    def on_data(self, data: bytes) -> None:
        if self.stream is not None:
            self.stream.feed(data)
            return
        self.size += len(data)
        if self.size > self.px.config.max_response_bytes:
            self._too_large()
            return
        self.body.append(data)

    def _too_large(self) -> None:
        limit = self.px.config.max_response_bytes
        why = f"the {self.role} backend's response is over {limit} bytes"
        self.finish("error", UpstreamFailed(502, "upstream_too_large", why))

    def on_end(self) -> None:
        if self.stream is not None:
            self.stream.end(None)
        self.finish("end")

    def on_lost(self, exc: BaseException | None) -> None:
        if self.pooled and self.resp is None and not self.attempt and not self.finished:
            # a kept-alive connection the backend had closed: once more, on a fresh one
            self.px.metrics.retries.inc(self.role)
            self.attempt = 1
            self.start()
            return
        if self.stream is not None:
            self.stream.end(self.stream.closed_error())
            self.finish("end")
            return
        self.px.mark_down(self.role, "closed the connection")
        when = "before answering" if self.resp is None else "before the response was complete"
        why = f"the {self.role} backend closed the connection {when}; the request was not re-sent"
        self.finish("error", UpstreamFailed(502, "upstream_closed", why))

    def on_garbage(self, why: str) -> None:
        if self.stream is not None:
            self.stream.end(
                ("upstream_garbage", f"the {self.role} backend sent an invalid stream ({why})")
            )
            self.finish("end")
        else:
            # worded as aiohttp's path words the same failure
            prefix = "its answer is not valid HTTP ("
            if why.startswith(prefix):
                why = why.removeprefix(prefix).removesuffix(")")
            msg = f"the {self.role} backend's answer is not valid HTTP ({why})"
            self.finish("error", UpstreamFailed(502, "upstream_garbage", msg))

    # the client's side (called by `Front`) ------------------------------------------------

    def client_gone(self) -> None:
        self.finish("client-gone")

    def pause(self) -> None:
        """The client reads slower than the backend streams: stop reading the backend (only
        a stream's connection: a finished one may be going back to the pool)."""
        if self.stream is None or self.finished:
            return
        if self.up is not None and self.up.transport is not None and not self.up.lost:
            self.up.transport.pause_reading()

    def resume(self) -> None:
        if self.up is not None and self.up.transport is not None and not self.up.lost:
            self.up.transport.resume_reading()

    def shut_down(self) -> None:
        """`Proxy.stop` ends this request at the end of the grace period."""
        if self.stream is not None:
            self.stream.end(self.px.shutdown_error(self.role))
            self.finish("end")
        else:
            self.finish("shutdown")

    # the end --------------------------------------------------------------------------------

    def _headers(self) -> list[tuple[str, str]]:
        return [(H_BACKEND, self.role), (H_ROUTE, self.p.route.value)]

    def finish(
        self, how: str, error: UpstreamFailed | None = None, failed: str | None = None
    ) -> None:
        """The exchange is over (`how`): answer, or give the request back (`failed`: why the
        backend did not take it); then clean up."""
        if self.finished:
            return
        self.finished = True
        px, front, o = self.px, self.front, self.outcome
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        close = self.head.close
        if how != "give-back":
            try:
                close = self._answer(how, o, error) or close
            except _GiveBack as g:
                how, failed = "give-back", g.why
            except Exception as e:  # a defect here: the request is not sent again
                log.exception("the forwarding core failed on %s", self.head.path)
                px.metrics.errors.inc("internal")
                o.note = f"internal error: {type(e).__name__}"
                close = True
                if not self.sent:
                    msg = f"the proxy failed on this request ({type(e).__name__})"
                    self._write_error(500, msg, close=True)
        up = self.up
        if up is not None:
            if up.reusable and not up.lost and not self.p.stream and how == "end":
                px.pool.put(self.role, up)
            else:
                up.close()
        px.pool.busy[self.role] -= 1
        if how == "give-back" and not self.sent:
            assert failed is not None
            px.metrics.fast_path.inc("given_back")
            px.metrics.in_flight.inc(by=-1)
            self.done.set_result(None)
            front.give_back(self, (self.role, failed))
            return
        px.metrics.fast_path.inc("served")
        px.accounting.account("POST", o, self.t0)
        self.done.set_result(None)
        front.done(close)

    def _write_error(
        self, status: int, msg: str, close: bool, headers: list[tuple[str, str]] | None = None
    ) -> None:
        self.outcome.status = status
        body = error_body(status, msg)
        self.sent = True
        self.front.write(
            wire.response_head(
                status,
                [*(headers or []), ("Content-Type", "application/json; charset=utf-8")],
                length=len(body),
                close=close,
            )
            + body
        )

    def _answer(self, how: str, o: RequestRecord, error: UpstreamFailed | None) -> bool:
        """Write the response (or its end) to the client; True to close the connection."""
        px = self.px
        if self.stream is not None:
            if how == "client-gone":
                self.stream.client_gone()
            return self.stream.close_after
        if how == "client-gone":
            px.accounting.disconnected(o)
            return True
        if how == "shutdown":
            px.metrics.errors.inc("shutdown")
            o.note = "shutting down"
            self._write_error(503, px.shutdown_message(), close=True)
            return True
        if how == "timeout":
            error = UpstreamFailed(
                504,
                "upstream_timeout",
                f"the {self.role} backend sent nothing for {px.config.read_timeout:g}s"
                if self.resp is None
                else f"the {self.role} backend went silent for "
                f"{px.config.read_timeout:g}s mid-response",
            )
        if error is not None:
            px.accounting.failed(error, o)
            self._write_error(error.status, error.message, self.head.close, self._headers())
            return False
        # a whole body
        resp = self.resp
        assert resp is not None
        raw = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        if resp.status == 503:
            raise _GiveBack(f"answered HTTP 503 ({_error_message(raw)})")
        headers = dict(self._headers())
        try:
            raw = px.checks.body_answer(
                raw,
                resp.status,
                resp.content_type or "application/json",
                self.p,
                self.role,
                o,
                headers,
                check=self.check,
            )
        except UpstreamFailed as e:
            return self._answer("error", o, e)
        self.sent = True
        o.status = resp.status
        self.front.write(
            wire.response_head(
                resp.status, list(headers.items()), length=len(raw), close=self.head.close
            )
            + raw
        )
        return False


def _error_message(raw: bytes) -> str:
    """A backend's error body's message, on one line (what a 503 says, for the log)."""
    try:
        err = json.loads(raw).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        return " ".join(str(msg).split())[:200] if msg else "no message"
    except Exception:
        return "no message"


class Relay:
    """A stream relayed event by event as it arrives (as `stream_relay` does on aiohttp's path)."""

    def __init__(self, ex: Exchange, o: RequestRecord) -> None:
        self.ex, self.o = ex, o
        self.st = StreamState()
        self.splitter = sse.EventSplitter()
        self.ended = False
        self.close_after = False

    def feed(self, data: bytes) -> None:
        if self.ended:
            return
        ex = self.ex
        px = ex.px
        events = self.splitter.feed(data)
        if events:
            pieces, bad = px.checks.events(
                events, ex.p, self.st, ex.role, check=ex.check, annotated=False
            )
            if pieces:
                ex.front.write(wire.chunk(b"".join(pieces)))
            if bad is not None:
                if bad[0] != "internal":
                    bad = (
                        "upstream_garbage",
                        f"the {ex.role} backend sent an invalid stream ({bad[1]})",
                    )
                self.end(bad)
                ex.finish("end")
                return
            if self.st.finished:  # the last event: end the stream now, whatever follows
                self.end(None)
                ex.finish("end")
                return
        limit = px.config.max_response_bytes
        if self.splitter.pending > limit:
            self.end(
                (
                    "upstream_garbage",
                    f"the {ex.role} backend sent an invalid stream "
                    f"(an event is over {limit} bytes)",
                )
            )
            ex.finish("end")

    def closed_error(self) -> tuple[str, str]:
        ex = self.ex
        why = "closed the connection"
        ex.px.mark_down(ex.role, why)
        return (
            "upstream_closed",
            f"the {ex.role} backend {why} mid-stream; the response is incomplete",
        )

    def timeout_error(self) -> tuple[str, str]:
        ex = self.ex
        return (
            "upstream_timeout",
            f"the {ex.role} backend went silent for {ex.px.config.read_timeout:g}s",
        )

    def end(self, error: tuple[str, str] | None) -> None:
        """The stream's end: its error event if any, then the last chunk."""
        if self.ended:
            return
        self.ended = True
        ex = self.ex
        px = ex.px
        if self.st.finished:
            error = None  # nothing after the last event, not even an error
        elif error is None:
            error = px.checks.unfinished(self.splitter, self.st, ex.role)
        if ex.check:
            px.accounting.count(ex.role, self.st.tally, self.o)
        self.o.status = self.o.status or 200
        tail = b""
        if error is not None:
            tail = px.checks.stream_error(error, self.st, self.o, annotated=False)
        ex.front.write((wire.chunk(tail) if tail else b"") + wire.LAST_CHUNK)
        if ex.up is not None and error is not None:
            ex.up.close()

    def client_gone(self) -> None:
        if not self.ended:
            self.ended = True
            if self.ex.check:
                self.ex.px.accounting.count(self.ex.role, self.st.tally, self.o)
            self.ex.px.metrics.errors.inc("client_disconnect")
            self.o.status, self.o.note = 499, "client disconnected"
        self.close_after = True
