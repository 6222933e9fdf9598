"""What the proxy answers: a backend's answer checked before a client sees it, and the proxy's
own error answers.

Why one home for both transports: a placeholder must never reach a client as real, whichever
transport relays the answer, so the checks of a whole body (`AnswerChecks.body_answer`), of
stream events (`AnswerChecks.events`) and of a stream's end (`AnswerChecks.unfinished`,
`AnswerChecks.stream_error`) are written once, over bytes, and each transport only moves
them. An answer that cannot be checked is withheld (`Withheld`, `UpstreamFailed`), never
passed on unchecked. The error bodies (`error_body`, SSE error events) are OpenAI's shape.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from specaudit.proxy import sse
from specaudit.proxy.accounting import Accounting, RequestRecord
from specaudit.proxy.placeholders import PlaceholderTally, check_body, check_event
from specaudit.proxy.routing import Kind, Plan

log = logging.getLogger("specaudit.proxy")

# the headers the proxy adds to an answer: who served it, on which route, how many
# placeholders it rewrote, and whether it was served in place of the plain backend
H_BACKEND = "X-Specaudit-Backend"
H_ROUTE = "X-Specaudit-Route"
H_PLACEHOLDERS = "X-Specaudit-Placeholders"
H_ANNOTATED = "X-Specaudit-Annotated"
H_FALLBACK = "X-Specaudit-Fallback"

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    502: "upstream_error",
    503: "unavailable_error",
    504: "timeout_error",
}


def error_body(
    status: int, message: str, type_: str | None = None, param: str | None = None
) -> bytes:
    """OpenAI's error shape (llama-server uses the same)."""
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": type_ or ERROR_TYPES.get(status, "error"),
                "param": param,
                "code": status,
            }
        }
    ).encode()


class UpstreamFailed(Exception):
    """The backend answered unusably (timeout, garbage); nothing sent to the client yet."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class Withheld(Exception):
    """An answer could not be checked (its message says why): withheld with a 500."""


def withheld(role: str, e: Exception) -> str:
    return (
        f"the proxy could not check the {role} backend's response ({type(e).__name__}); "
        "it is withheld so that no placeholder passes as real"
    )


def count_comment(t: PlaceholderTally) -> bytes:
    """Where an annotated stream says how many placeholders it rewrote (headers went first)."""
    return sse.comment(f"specaudit-placeholders {t.placeholders}")


@dataclass
class StreamState:
    tally: PlaceholderTally = field(default_factory=PlaceholderTally)
    finished: bool = False  # saw [DONE], a final stop event, or an error event


class AnswerChecks:
    """The checks of a backend's answer, counted in `accounting`."""

    def __init__(self, accounting: Accounting) -> None:
        self.accounting = accounting
        self.metrics = accounting.metrics

    # a whole body ---------------------------------------------------------------------------

    def body_answer(
        self,
        raw: bytes,
        status: int,
        content_type: str,
        p: Plan | None,
        role: str,
        o: RequestRecord,
        headers: dict[str, str],
        *,
        check: bool,
    ) -> bytes:
        """A backend's whole non-streamed answer made ready for the client: the bytes to send
        (a logprobs answer checked, placeholders nulled), its headers added to `headers`.
        Raises `UpstreamFailed` for an answer the proxy does not vouch for."""
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            kind = "upstream_error" if status >= 400 else "upstream_garbage"
            raise UpstreamFailed(
                502, kind, f"the {role} backend answered HTTP {status} with a body that is not JSON"
            ) from None
        if status < 400 and not isinstance(obj, dict | list):
            raise UpstreamFailed(
                502, "upstream_garbage", f"the {role} backend answered JSON that is not an object"
            )
        if status >= 400:
            self.metrics.errors.inc(f"upstream_{status // 100}xx")
        elif check and p is not None:
            try:
                raw, n = self.checked_body(p, raw, obj, role, o)
            except Exception as e:
                # the body cannot be vouched for: withhold it rather than pass it unchecked
                log.exception("checking the %s backend's response failed", role)
                raise UpstreamFailed(500, "internal", withheld(role, e)) from None
            headers[H_PLACEHOLDERS] = str(n)
        headers["Content-Type"] = content_type
        return raw

    def checked_body(
        self, p: Plan, raw: bytes, obj: Any, role: str, o: RequestRecord
    ) -> tuple[bytes, int]:
        """A logprobs response body checked: the bytes to send (re-encoded only when a
        placeholder was rewritten to null) and how many were."""
        t = check_body(p.kind, obj, p.requested)
        if t.placeholders:
            raw = sse.encode_json(obj)  # lone surrogates stay escaped
        self.accounting.count(role, t, o)
        return raw, t.placeholders

    # a stream -------------------------------------------------------------------------------

    def events(
        self,
        events: list[bytes],
        p: Plan,
        st: StreamState,
        role: str,
        *,
        check: bool,
        annotated: bool,
    ) -> tuple[list[bytes], tuple[str, str] | None]:
        """The bytes to forward for complete events, and why the stream is bad (if it is:
        ``(metric kind, message)``): events before a bad one still go out."""
        pieces: list[bytes] = []
        for ev in events:
            try:
                obj = sse.parse_event(ev)
            except sse.BadEvent as e:
                return pieces, ("upstream_garbage", str(e))
            try:
                piece = self._event(ev, obj, p, st, check=check, annotated=annotated)
            except Exception as e:
                # never forward an event that could not be checked: it may hold a placeholder
                log.exception("checking an event from the %s backend failed", role)
                return pieces, ("internal", withheld(role, e))
            if piece is None:
                return pieces, ("upstream_garbage", "event data is not a JSON object")
            pieces += piece
            if st.finished:
                break  # the last event ([DONE], "stop": true, an error): nothing after it
        return pieces, None

    def _event(
        self, ev: bytes, obj: Any, p: Plan, st: StreamState, *, check: bool, annotated: bool
    ) -> list[bytes] | None:
        """What to forward for one parsed event; None when it is not a JSON object."""
        if obj == "[DONE]":
            st.finished = True
            return [count_comment(st.tally), ev] if annotated else [ev]
        if obj is None:  # a comment (keep-alive ping)
            return [ev]
        if not isinstance(obj, dict):
            return None
        if check:
            t = check_event(p.kind, obj, p.requested, p.post_sampling)
            if t.tokens:
                st.tally.add(t)
            if t.placeholders:
                ev = sse.encode_event(obj)  # lone surrogates stay escaped
        if obj.get("stop") is True or "error" in obj:
            st.finished = True
            if annotated and p.kind is Kind.COMPLETION:
                return [ev, count_comment(st.tally)]
        return [ev]

    def unfinished(
        self, splitter: sse.EventSplitter, st: StreamState, role: str
    ) -> tuple[str, str] | None:
        """Why a stream whose backend ended it cleanly is still incomplete, if it is."""
        if splitter.rest().strip():
            return ("upstream_closed", f"the {role} backend ended the stream mid-event")
        if not st.finished:
            return (
                "upstream_closed",
                f"the {role} backend ended the stream without its final event",
            )
        return None

    def stream_error(
        self, error: tuple[str, str], st: StreamState, o: RequestRecord, annotated: bool
    ) -> bytes:
        """The end of a stream that failed: counted, then its SSE error event."""
        self.metrics.errors.inc(error[0])
        o.note = error[0]
        tail = count_comment(st.tally) if annotated else b""
        code = {"upstream_timeout": 504, "internal": 500, "shutdown": 503}.get(error[0], 502)
        return tail + sse.encode_event(
            {"error": {"message": error[1], "type": ERROR_TYPES[code], "code": code}}
        )
