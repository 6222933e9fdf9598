"""aiohttp's client towards the backends, as aiohttp's path uses it.

Why its own module: aiohttp's client needs a protocol subclass (`BodyFailing`) and a look into
its buffer (`unread`) to report broken framing, and the re-send rule (docs/proxy.md, "When a
request is sent twice") decides what each connection error means here:

- a refused connection or a connect timeout: nothing was written, `Unreachable` (the caller
  marks the backend down and may fall back);
- a dropped connection before any answer byte, on a reused kept-alive connection: re-sent once
  on a fresh connection (the backend closed the idle connection as the request was written;
  aiohttp's trace signals say which connection a request got, `_trace`);
- any other drop, timeout or garbage after the request was written: `UpstreamFailed`, which
  the caller answers itself (502/504); the request goes nowhere else.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, cast

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError

from specaudit.proxy.answers import UpstreamFailed
from specaudit.proxy.backends import PLAIN, SPEC, describe_error
from specaudit.proxy.state import ProxyState, Unreachable

log = logging.getLogger("specaudit.proxy")


class BackendClient:
    """One pooled session per backend for non-streamed requests, one that closes each
    connection after use for streams (llama-server closes a streamed connection although it
    advertised keep-alive), one for role checks."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        config = state.config
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self.stream_sessions: dict[str, aiohttp.ClientSession] = {}
        self.probe_session: aiohttp.ClientSession | None = None
        self.timeout = aiohttp.ClientTimeout(
            total=config.total_timeout,
            connect=None,
            sock_connect=config.connect_timeout,
            sock_read=config.read_timeout,
        )

    def open_sessions(self) -> None:
        limit = self.state.config.max_connections
        for role in (PLAIN, SPEC):
            self.sessions[role] = new_session(limit)
            # streams get a fresh connection each, closed afterwards: llama-server closes it
            # anyway, and a pooled one it already closed would fail the request
            self.stream_sessions[role] = new_session(limit, force_close=True)
        # role checks use their own short-lived connections, never the request pool
        self.probe_session = new_session(4, force_close=True)

    async def close(self) -> None:
        for s in (
            list(self.sessions.values())
            + list(self.stream_sessions.values())
            + ([self.probe_session] if self.probe_session else [])
        ):
            await s.close()
        self.sessions.clear()
        self.stream_sessions.clear()
        self.probe_session = None

    async def open(
        self,
        role: str,
        path: str,
        method: str,
        body: bytes | None,
        headers: dict[str, str],
        stream: bool,
    ) -> aiohttp.ClientResponse:
        """The backend's response, its head read. `Unreachable`: nothing was written;
        `UpstreamFailed`: it was, and the answer is unusable (never re-sent)."""
        state = self.state
        session = (self.stream_sessions if stream else self.sessions)[role]
        url = state.backends[role].url + path
        for attempt in range(2):
            conn = _Conn()
            try:
                return await session.request(
                    method,
                    url,
                    data=body,
                    headers=headers,
                    timeout=self.timeout,
                    allow_redirects=False,
                    trace_request_ctx=conn,
                )
            except aiohttp.ClientConnectorError as e:
                raise Unreachable(describe_error(e)) from None
            except aiohttp.ConnectionTimeoutError:
                raise Unreachable(
                    f"connect timed out after {state.config.connect_timeout:g}s"
                ) from None
            except (TimeoutError, aiohttp.ServerTimeoutError):
                raise UpstreamFailed(
                    504,
                    "upstream_timeout",
                    f"the {role} backend sent nothing for {state.config.read_timeout:g}s",
                ) from None
            except (
                aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError,
                aiohttp.ClientPayloadError,
            ) as e:
                why = describe_error(e)
                if attempt == 0 and conn.reused:
                    state.metrics.retries.inc(role)
                    log.debug("%s backend dropped a connection (%s); re-sending once", role, why)
                    continue
                state.mark_down(role, why)
                raise UpstreamFailed(
                    502,
                    "upstream_closed",
                    f"the {role} backend {why} before answering; the request was not re-sent",
                ) from None
            except aiohttp.ClientError as e:  # e.g. an answer that is not HTTP at all
                raise UpstreamFailed(
                    502,
                    "upstream_garbage",
                    f"the {role} backend's answer is not valid HTTP ({type(e).__name__})",
                ) from None
        raise AssertionError("unreachable")

    async def read_limited(self, resp: aiohttp.ClientResponse, role: str, limit: int) -> bytes:
        """A whole response body, at most `limit` bytes."""
        if resp.content_length is not None and resp.content_length > limit:
            raise UpstreamFailed(
                502, "upstream_too_large", f"the {role} backend's response is over {limit} bytes"
            )
        chunks: list[bytes] = []
        n = 0
        try:
            async for chunk in resp.content.iter_any():
                n += len(chunk)
                if n > limit:
                    raise UpstreamFailed(
                        502,
                        "upstream_too_large",
                        f"the {role} backend's response is over {limit} bytes",
                    )
                chunks.append(chunk)
        except (TimeoutError, aiohttp.ServerTimeoutError):
            raise UpstreamFailed(
                504,
                "upstream_timeout",
                f"the {role} backend went silent for {self.state.config.read_timeout:g}s "
                "mid-response",
            ) from None
        except BrokenFraming as e:
            raise UpstreamFailed(
                502, "upstream_garbage", f"the {role} backend's answer is not valid HTTP ({e})"
            ) from None
        except (
            aiohttp.ClientPayloadError,
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
        ) as e:
            why = describe_error(e)
            self.state.mark_down(role, why)
            raise UpstreamFailed(
                502, "upstream_closed", f"the {role} backend {why} before the response was complete"
            ) from None
        return b"".join(chunks)


class _Conn:
    """Which connection a request got (set by `_trace`): a reused kept-alive one, or not."""

    reused = False


async def _reused(session: Any, ctx: Any, params: Any) -> None:
    if isinstance(ctx.trace_request_ctx, _Conn):
        ctx.trace_request_ctx.reused = True


def _trace() -> aiohttp.TraceConfig:
    t = aiohttp.TraceConfig()
    t.on_connection_reuseconn.append(_reused)
    return t


def new_session(limit: int, force_close: bool = False) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=limit,
        # below llama-server's 5 s keep-alive, so an idle pooled connection is dropped by us
        # before the server drops it under us
        keepalive_timeout=4.0 if not force_close else None,
        force_close=force_close,
        use_dns_cache=True,
    )
    if hasattr(connector, "_factory"):  # aiohttp's protocol factory (private): see BodyFailing
        loop = asyncio.get_running_loop()
        cast(Any, connector)._factory = functools.partial(BodyFailing, loop=loop)
    return aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,  # bytes pass through as the backend sent them
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,  # never route through an HTTP(S)_PROXY from the environment
        skip_auto_headers=("User-Agent",),
        trace_configs=[_trace()],
    )


class BodyFailing(ResponseHandler):
    """aiohttp's client protocol, telling a response body's reader when its framing breaks.

    When a body's framing breaks mid-body (a bad chunk size after good chunks), aiohttp 3.14
    closes the connection but never tells the body's reader: a relay reading it waited
    forever, past ``sock_read`` too (the error drops that timer). Here the error reaches the
    reader as `aiohttp.ClientPayloadError`, like a connection closed mid-body.
    """

    def set_exception(self, exc: BaseException, exc_cause: BaseException | None = None) -> None:
        payload = getattr(self, "_payload", None)
        if exc_cause is None:
            super().set_exception(exc)
        else:
            super().set_exception(exc, exc_cause)
        if (
            isinstance(exc, HttpProcessingError)  # the parser's (not a timeout, not a close)
            and isinstance(payload, aiohttp.StreamReader)
            and not payload.is_eof()
            and payload.exception() is None
        ):
            why = str(getattr(exc, "message", "") or "").strip().split("\n", 1)[0]
            payload.set_exception(BrokenFraming(why.rstrip(":")[:120] or "broken framing"))


class BrokenFraming(aiohttp.ClientPayloadError):
    """A backend's response body whose framing broke mid-body (`BodyFailing`); its message is
    the parser's reason."""


def unread(content: Any) -> bytes:
    """What aiohttp had received of a body but not handed out when the body failed.

    Its StreamReader raises a framing error (a bad chunk) before returning what it had
    buffered, which may hold complete events that came in the same read. The buffer is
    private (``_buffer``, ``_buffer_offset``); if it ever changes, nothing is recovered.
    """
    buf = getattr(content, "_buffer", None)
    if not buf:
        return b""
    data = b"".join(buf)
    return data[getattr(content, "_buffer_offset", 0) :]
