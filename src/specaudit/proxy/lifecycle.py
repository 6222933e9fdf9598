"""The proxy as one object: start, serve on both transports, check roles, stop gracefully.

`Proxy` is the shared layer (`state.ProxyState`) plus what owns the sockets and tasks: the listener
(every connection starts on the forwarding core, `forwarding.Front`), aiohttp's server for what the
core hands over (`server.AiohttpPath`), aiohttp's client sessions (`aio_client.BackendClient`) and
the role checks (`health.Checker`). It is the only module that knows both transports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from specaudit import __version__
from specaudit.proxy import forwarding, memory
from specaudit.proxy.accounting import RequestRecord
from specaudit.proxy.aio_client import BackendClient
from specaudit.proxy.backends import PLAIN, SPEC, State
from specaudit.proxy.config import ProxyConfig, ProxyError
from specaudit.proxy.health import Checker
from specaudit.proxy.redact import install_log_redaction
from specaudit.proxy.server import AiohttpPath
from specaudit.proxy.slow_clients import BODY, HANDLING, IDLE, RequestHandler, WebServer
from specaudit.proxy.state import ProxyState

log = logging.getLogger("specaudit.proxy")

ABORT_WAIT = 1.0  # seconds, on stop: for the requests ended after the grace period to finish


class Proxy(ProxyState):
    """``await Proxy(config).start()``; then ``proxy.url`` serves until ``await proxy.stop()``."""

    def __init__(self, config: ProxyConfig) -> None:
        super().__init__(config)
        self.client = BackendClient(self)
        self.checker = Checker(self, self.client)
        self.aiohttp_path = AiohttpPath(self, self.client, self.checker)
        self._check_task: asyncio.Task[None] | None = None
        self._trim_task: asyncio.Task[None] | None = None
        self._web: WebServer | None = None
        self._server: asyncio.AbstractServer | None = None
        self._hurry: asyncio.Event | None = None

    async def start(self) -> None:
        """Check both backends' roles, then listen. Refuses to start if plain speculates."""
        install_log_redaction()
        self.started = time.monotonic()
        self._hurry = asyncio.Event()
        self.draining = False
        self.checker.start()
        self.client.open_sessions()
        try:
            await self.check_backends()
            plain = self.backends[PLAIN]
            if plain.state is State.UNUSABLE:
                raise ProxyError(f"refusing to start: the plain backend {plain.url} {plain.detail}")
            for b in self.backends.values():
                if b.state is not State.UP:
                    log.warning("%s backend %s is %s: %s", b.role, b.url, b.state.value, b.detail)
                if b.warning:
                    log.warning("%s backend %s: %s", b.role, b.url, b.warning)
            self._web = web = self.aiohttp_path.web_server()
            self.adopter = web
            web.taker = self
            loop = asyncio.get_running_loop()
            try:
                self._server = await loop.create_server(
                    lambda: forwarding.Front(self),
                    self.config.host,
                    self.config.port,
                    reuse_address=True,
                    backlog=1024,
                )
            except OSError as e:
                raise ProxyError(
                    f"cannot listen on {self.config.host}:{self.config.port}: {e.strerror or e}"
                ) from None
            sock = self._server.sockets[0]
            self.port = int(sock.getsockname()[1])
            self._check_task = asyncio.create_task(self.checker.loop())
            self._trim_task = asyncio.create_task(self._trim_loop())
            if not self.config.loopback:
                log.warning(
                    "listening on %s: anyone who can reach it can use both backends",
                    self.config.host,
                )
            log.info(
                "specaudit proxy %s on %s: plain %s (%s), spec %s (%s), on plain down: %s",
                __version__,
                self.url,
                self.config.plain,
                self.backends[PLAIN].state.value,
                self.config.spec,
                self.backends[SPEC].state.value,
                self.config.on_plain_down.value,
            )
        except BaseException:
            await self.client.close()
            raise

    def takes_back(self) -> bool:
        """aiohttp's path may give a connection back to the core (not while stopping)."""
        return not self.draining and self._server is not None

    def take_back(self, transport: asyncio.Transport) -> None:
        forwarding.Front(self).take_back(transport)

    async def check_backends(self) -> None:
        """Read both backends' roles now."""
        await self.checker.check_backends()

    def hurry(self) -> None:
        """End a `stop` in progress without waiting for the rest of its grace period."""
        if self._hurry is not None:
            self._hurry.set()

    async def stop(self, grace: float | None = None) -> None:
        """Stop gracefully: stop accepting, let the requests in flight finish for up to
        `grace` seconds (default ``config.shutdown_grace``), then end the rest: a stream with
        an SSE error event, a request not yet answered with a 503. Returns within about
        ``grace + 1.5`` seconds whatever the backends and clients do."""
        grace = self.config.shutdown_grace if grace is None else grace
        await self._stop_checks()
        if self._server is not None:
            self.draining = True
            self._server.close()  # no new connections
            self._close_idle()
            if self.inflight:
                log.info(
                    "stopping: %d request(s) in flight, waiting up to %gs",
                    len(self.inflight),
                    grace,
                )
            await self._drain(grace)
            await self._end_the_rest()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), ABORT_WAIT)
            self._server = None
        await self.client.close()
        self.pool.close()

    async def _stop_checks(self) -> None:
        for task in (self._check_task, self._trim_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._check_task = self._trim_task = None

    async def _trim_loop(self) -> None:
        """Now and then: close backend connections idle too long; once a burst of connections
        or requests is over, give freed heap memory back to the system (`memory`)."""
        watch = memory.BurstWatch(self._client_connections(), self.metrics.requests.total())
        while True:
            await asyncio.sleep(memory.INTERVAL)
            self.pool.prune()
            if watch.over(
                self._client_connections(), self.metrics.requests.total(), len(self.inflight)
            ):
                memory.trim()

    def _client_connections(self) -> int:
        """Client connections open: the core's and aiohttp's path's."""
        return len(self.fronts) + (len(self._web.connections) if self._web is not None else 0)

    def _close_idle(self) -> None:
        """Close the connections with no request being answered; a request begun but not yet
        answered gets its 503 from aiohttp's path."""
        for front in list(self.fronts):
            if front.busy is None:
                if front.got_bytes and front.buf:
                    front.hand_over()  # a request begun: aiohttp's path answers it (503)
                elif front.transport is not None:
                    front.transport.close()  # idle: close now
        if self._web is not None:
            for conn in self._web.connections:
                phase = conn.phase if isinstance(conn, RequestHandler) else IDLE
                if phase == HANDLING:
                    conn.close()  # closed once its answer is out
                elif phase != BODY:  # BODY: the request's answer closes it (`AiohttpPath.handle`)
                    conn.force_close()  # idle, or a request not yet begun: close now

    async def _end_the_rest(self) -> None:
        """After the grace period: end each request still in flight, then cut whatever is
        left (a client not reading its answer)."""
        for task, o in list(self.inflight.items()):
            self._abort(task, o)
        if self.inflight:  # each ends at once: its error event or 503 is written
            await asyncio.wait(set(self.inflight), timeout=ABORT_WAIT)
        if self._web is not None:
            await self._web.shutdown(timeout=ABORT_WAIT / 2)
        for front in list(self.fronts):
            if front.transport is not None:
                front.transport.abort()

    async def _drain(self, grace: float) -> None:
        """Wait until no request is in flight, `grace` has passed, or `hurry` was called."""
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        hurry = self._hurry
        while self.inflight and not (hurry is not None and hurry.is_set()):
            left = end - loop.time()
            if left <= 0:
                return
            waiter = asyncio.ensure_future(hurry.wait()) if hurry is not None else None
            try:
                await asyncio.wait(
                    {*self.inflight, *([waiter] if waiter else [])},
                    timeout=left,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                if waiter is not None:
                    waiter.cancel()

    def _abort(self, task: asyncio.Future[Any], o: RequestRecord) -> None:
        """End one request at the end of the grace period."""
        if o.shutdown or task.done():
            return
        o.shutdown = True
        if o.stop_stream is not None:
            # a stream being relayed ends with an error event (`stream_relay`); a fast-path
            # request ends itself (`forwarding.Exchange.shut_down`: the error event, or a 503)
            o.stop_stream()
        else:
            # nothing sent yet: the handler answers 503 (`AiohttpPath.handle`)
            task.cancel()

    async def __aenter__(self) -> Proxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
