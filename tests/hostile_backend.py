"""Hostile proxy backends: llama-server look-alikes that break HTTP on the wire, one way each.

Why raw sockets: an HTTP server library frames its responses correctly by design, so most of
what a broken or hostile backend can do to the proxy (a bad chunk size, two Content-Lengths, a
1xx before the 200, a bare CR in a header value, a reset mid-stream) can only be written as
bytes. `Backend` is a `fakes.serve_tcp` handler that answers ``/health`` and ``/slots`` like
llama-server, and every generation request in the mode the request names: its prompt (or
first message) is ``hostile <mode> <tag>``, so one backend serves every mode and records which
tags reached it (`Backend.hits`). `MODES` says, per mode, what the backend writes and what a
client of the proxy may see.

`planned` builds what the backend sends for a request (the events or body a llama-server would
give, placeholders where the mode puts them, and the bytes on the wire); `exchange` is a raw
client that records the proxy's answer byte for byte, and `parse_reply` parses it strictly
(its own chunked and SSE decoding, not the proxy's), so a test can compare the two.

Importable as ``import hostile_backend`` from any test, like tests/fakes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from proxy_helpers import PATHS, TOP, request_body

Form = Literal["real", "zero", "notop", "null", "none"]
Expect = Literal["ok", "error", "either"]
End = Literal["keep", "close", "hold", "reset"]

DRIP = 0.001  # seconds between the one-byte writes of the `drip` mode
PAUSE = 0.02  # seconds between the writes of a broken answer
HOLD = 8.0  # longest a backend keeps a connection open after a hostile answer
IDLE = 10.0  # longest a backend waits for the next request on a kept-alive connection
BIG = 5 * 1024 * 1024  # the 5 MB event (and body)
DONE = b"data: [DONE]\n\n"


# ------------------------------------------------------------------------------ the modes


@dataclass(frozen=True)
class Mode:
    """One way of answering: the endpoint it is tried on, the tokens' probability entries, and
    what a client of the proxy may see for a non-streamed (`json`) and a streamed request.

    ``ok``: the whole response, every placeholder marked; ``error``: an error status or a
    stream ended by an error event (or cut); ``either``: one of the two (the backend's answer
    is ambiguous, e.g. complete data in broken framing), never a truncated body as complete.
    """

    kind: str  # chat | completions | completion
    json: Expect
    stream: Expect
    forms: tuple[Form, ...] = ("real", "real", "real")
    post: bool = False  # post-sampling probabilities (native /completion only)
    big: int = 0  # bytes of text added to the first token (the 5 MB event)
    timeout: bool = False  # the error must be the read timeout's 504
    why: str = ""


PLACEHOLDERS: tuple[Form, ...] = ("real", "zero", "zero")

MODES: dict[str, Mode] = {
    "clean": Mode("completions", "ok", "ok", why="well-formed: the control"),
    "chunk-size-nonhex": Mode("chat", "error", "error", why="a chunk size 'zz'"),
    "chunk-size-negative": Mode("completions", "error", "error", why="a chunk size '-NN'"),
    "chunk-size-overflow": Mode("completion", "error", "error", why="a 25-digit chunk size"),
    "chunk-short-close": Mode(
        "chat", "error", "error", why="a chunk with half the data its size says, then close"
    ),
    "no-final-chunk": Mode(
        "completions", "either", "either", why="every chunk but the last one, then close"
    ),
    "cl-short": Mode(
        "chat", "error", "error", why="Content-Length 7 bytes short of the body, kept open"
    ),
    "cl-long-close": Mode(
        "completions", "either", "either", why="Content-Length 100 bytes over the body, close"
    ),
    "cl-and-te": Mode("completion", "either", "either", why="Content-Length: 7 and a chunked body"),
    "two-cls": Mode("chat", "error", "error", why="two different Content-Lengths"),
    "continue-100": Mode("completions", "ok", "ok", why="100 Continue, then the 200"),
    "early-hints-103": Mode("chat", "ok", "ok", why="103 Early Hints in the same write as the 200"),
    "garbage-status": Mode("completions", "error", "error", why="no status line, SSH banner"),
    "bad-version": Mode("chat", "error", "error", why="status line 'HTTP/1.x 200 OK'"),
    "event-5mb": Mode("completions", "ok", "ok", big=BIG, why="a 5 MB event (and body)"),
    "drip": Mode("chat", "ok", "ok", why="one byte per write, 1 ms apart"),
    "until-close": Mode(
        "completion", "ok", "ok", why="no Content-Length or Transfer-Encoding: body until close"
    ),
    "silent-accept": Mode(
        "completions", "error", "error", timeout=True, why="reads the request, answers nothing"
    ),
    "silent-head": Mode("chat", "error", "error", timeout=True, why="the head, then nothing"),
    "http10": Mode("completions", "ok", "ok", why="an HTTP/1.0 response"),
    "inject-lf": Mode(
        "chat",
        "either",
        "either",
        forms=PLACEHOLDERS,
        why="Content-Type with LF-separated Set-Cookie and X-Specaudit-Placeholders: 0",
    ),
    "inject-cr": Mode(
        "completions",
        "either",
        "either",
        forms=PLACEHOLDERS,
        why="Content-Type with CR-separated Set-Cookie and X-Specaudit-Placeholders: 0",
    ),
    "nul-header": Mode(
        "completion", "either", "either", forms=PLACEHOLDERS, why="a NUL in Content-Type"
    ),
    "not-json": Mode(
        "completions", "error", "error", why="200 with an HTML body (text/html for streams)"
    ),
    "truncated-json": Mode(
        "chat", "error", "error", why="half a JSON body; a stream event with half its JSON"
    ),
    "ph-zero-empty": Mode(
        "chat", "ok", "ok", forms=PLACEHOLDERS, why="logprob 0.0 with empty top_logprobs"
    ),
    "ph-no-top": Mode(
        "completions",
        "ok",
        "ok",
        forms=("real", "notop", "notop"),
        why="logprob 0.0, top_logprobs missing",
    ),
    "ph-null-top": Mode(
        "chat", "ok", "ok", forms=("real", "null", "null"), why="logprob 0.0, top_logprobs null"
    ),
    "ph-native-logprobs": Mode(
        "completion",
        "ok",
        "ok",
        forms=("real", "zero", "none", "zero"),
        why="completion_probabilities with empty top_logprobs (streamed: one without any)",
    ),
    "ph-native-probs": Mode(
        "completion",
        "ok",
        "ok",
        forms=PLACEHOLDERS,
        post=True,
        why="post-sampling completion_probabilities: prob 1.0 with empty top_probs",
    ),
    "ph-mixed": Mode(
        "chat",
        "ok",
        "ok",
        forms=("zero", "real", "none", "real", "null", "notop", "real"),
        why="real and placeholder tokens mixed (streamed: one token chunk without an entry)",
    ),
    "done-then-garbage": Mode(
        "chat",
        "either",
        "ok",
        why="[DONE] and broken chunk framing in one write, kept open (JSON: bytes after body)",
    ),
    "reset-mid-stream": Mode(
        "completions", "error", "error", why="half the response, then a TCP reset"
    ),
}


# --------------------------------------------------------------------- what a backend sends


@dataclass(frozen=True)
class Ask:
    """What a client asks for: endpoint kind, streamed or not, logprobs or not."""

    kind: str
    stream: bool
    logprobs: bool
    post: bool = False


def client_body(mode: str, tag: str, ask: Ask) -> bytes:
    """The request a client sends through the proxy for `mode` (the fixture's request shape)."""
    b = request_body(ask.kind, stream=ask.stream, logprobs=ask.logprobs, n=3)
    prompt = f"hostile {mode} {tag}"
    if ask.kind == "chat":
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    if ask.post:
        b["post_sampling_probs"] = True
    return json.dumps(b).encode()


def _entry(i: int, token: str, form: Form, post: bool) -> dict[str, Any] | None:
    """One token's probability entry: real (TOP candidates) or a placeholder form."""
    if form == "none":
        return None
    tb = list(token.encode())
    value, key, cand = ("prob", "top_probs", 0.5) if post else ("logprob", "top_logprobs", -0.5)
    e: dict[str, Any] = {"id": i, "token": token, "bytes": tb}
    if form == "real":
        e[value] = cand
        e[key] = [
            {"id": i, "token": token, "bytes": tb, value: cand},
            {"id": 25, "token": "z", "bytes": [122], value: 0.25 if post else -1.5},
        ][:TOP]
        return e
    e[value] = 1.0 if post else 0.0  # what a speculating server reports
    if form == "zero":
        e[key] = []
    elif form == "null":
        e[key] = None
    return e  # notop: no candidates key at all


def _enc(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _event(obj: Any) -> bytes:
    return b"data: " + _enc(obj) + b"\n\n"


def _tokens(m: Mode) -> list[tuple[str, str]]:
    """(token, text) per token: the first token's text carries the mode's padding."""
    toks = [chr(ord("a") + i % 8) for i in range(len(m.forms))]
    return [(t, t + "x" * m.big if i == 0 else t) for i, t in enumerate(toks)]


def _stream_events(m: Mode, ask: Ask) -> list[bytes]:
    """The events a llama-server would send: one per token, the final one, [DONE]."""
    out = []
    for i, ((tok, text), form) in enumerate(zip(_tokens(m), m.forms, strict=True)):
        e = _entry(i, tok, form, ask.post) if ask.logprobs else None
        if ask.kind == "completion":
            ev: dict[str, Any] = {"index": 0, "content": text, "tokens": [i], "stop": False}
            if e is not None:
                ev["completion_probabilities"] = [e]
        else:
            ch: dict[str, Any] = {"finish_reason": None, "index": 0}
            if ask.kind == "chat":
                ch["delta"] = {"content": text}
            else:
                ch["text"] = text
            ch["logprobs"] = {"content": [e]} if e is not None else None
            obj = "chat.completion.chunk" if ask.kind == "chat" else "text_completion"
            ev = {"choices": [ch], "created": 1, "id": "hostile", "object": obj}
        out.append(_event(ev))
    if ask.kind == "completion":
        out.append(_event({"index": 0, "content": "", "tokens": [], "stop": True}))
        return out
    last: dict[str, Any] = {"finish_reason": "length", "index": 0}
    if ask.kind == "chat":
        last["delta"] = {}
    else:
        last["text"] = ""
    obj = "chat.completion.chunk" if ask.kind == "chat" else "text_completion"
    out.append(_event({"choices": [last], "created": 1, "id": "hostile", "object": obj}))
    out.append(DONE)
    return out


def _json_body(m: Mode, ask: Ask) -> bytes:
    """The body a llama-server would send (a token without an entry has a `zero` one)."""
    toks = _tokens(m)
    forms: list[Form] = ["zero" if f == "none" else f for f in m.forms]
    entries = [
        _entry(i, t, f, ask.post) for i, ((t, _), f) in enumerate(zip(toks, forms, strict=True))
    ]
    text = "".join(x for _, x in toks)
    if ask.kind == "completion":
        b: dict[str, Any] = {"index": 0, "content": text, "tokens": list(range(len(toks)))}
        b["stop"] = True
        if ask.logprobs:
            b["completion_probabilities"] = entries
        return _enc(b)
    ch: dict[str, Any] = {"finish_reason": "length", "index": 0}
    if ask.kind == "chat":
        ch["message"] = {"role": "assistant", "content": text}
    else:
        ch["text"] = text
    ch["logprobs"] = {"content": entries} if ask.logprobs else None
    obj = "chat.completion" if ask.kind == "chat" else "text_completion"
    return _enc({"choices": [ch], "created": 1, "id": "hostile", "object": obj})


@dataclass
class Plan:
    """What the backend does for one request: the writes (bytes, or a pause in seconds), how
    the connection ends, and what it meant to send (`events` for a stream, `body` otherwise:
    the complete events or body that actually went out, in order)."""

    steps: list[bytes | float]
    end: End
    events: list[bytes] = field(default_factory=list)
    body: bytes = b""
    drip: bool = False


def _head(ctype: bytes, *extra: bytes, version: bytes = b"HTTP/1.1") -> bytes:
    return b"\r\n".join([version + b" 200 OK", b"Content-Type: " + ctype, *extra]) + b"\r\n\r\n"


def _cl(n: int) -> bytes:
    return b"Content-Length: %d" % n


TE = b"Transfer-Encoding: chunked"
LAST = b"0\r\n\r\n"


def _chunk(b: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(b), b)


def planned(mode: str, ask: Ask) -> Plan:
    """What the backend writes for `mode` (see `MODES`)."""
    m = MODES[mode]
    stream = ask.stream
    events = _stream_events(m, ask) if stream else []
    body = b"" if stream else _json_body(m, ask)
    pieces = events if stream else [body[: len(body) // 2], body[len(body) // 2 :]]
    payload = b"".join(pieces)
    n = len(payload)
    ctype = b"text/event-stream" if stream else b"application/json; charset=utf-8"
    half = max(len(pieces) // 2, 1)
    first, rest = b"".join(_chunk(p) for p in pieces[:half]), b"".join(pieces[half:])

    def normal(ct: bytes = ctype, *, pre: bytes = b"") -> Plan:
        if stream:  # llama-server: chunked, one chunk per event, then it closes
            steps: list[bytes | float] = [pre + _head(ct, TE)]
            steps += [_chunk(p) for p in pieces]
            steps.append(LAST)
            return Plan(steps, "close", events, body)
        return Plan([pre + _head(ct, _cl(n)) + payload], "keep", events, body)

    def broken(
        steps: Sequence[bytes | float],
        end: End = "close",
        sent: tuple[list[bytes], bytes] | None = None,
    ) -> Plan:
        """`steps` with a pause between writes, so that what comes before the breakage is
        read first (a parser that fails only when both arrive together would otherwise pass
        by luck); `sent`: the events and body that went out, when not the planned ones."""
        spaced: list[bytes | float] = []
        for s in steps:
            spaced += [PAUSE, s] if spaced and not isinstance(s, float) else [s]
        evs, b = sent if sent is not None else (events, body)
        return Plan(spaced, end, evs, b)

    if mode in ("clean", "event-5mb") or mode.startswith("ph-"):
        return normal()
    if mode == "drip":
        p = normal()
        p.drip = True
        return p
    if mode == "chunk-size-nonhex":
        return broken([_head(ctype, TE) + first, b"zz\r\n" + rest + b"\r\n" + LAST])
    if mode == "chunk-size-negative":
        return broken([_head(ctype, TE) + first, b"-%x\r\n" % len(rest) + rest + b"\r\n" + LAST])
    if mode == "chunk-size-overflow":
        return broken([_head(ctype, TE) + first, b"1" + b"0" * 24 + b"\r\n" + rest + b"\r\n"])
    if mode == "chunk-short-close":
        # the chunk promises the rest of the response and carries half of it
        return broken([_head(ctype, TE) + first, b"%x\r\n" % len(rest) + rest[: len(rest) // 2]])
    if mode == "no-final-chunk":
        return broken([_head(ctype, TE)] + [_chunk(p) for p in pieces])
    if mode == "cl-short":
        return broken([_head(ctype, _cl(n - 7)) + payload], "hold")
    if mode == "cl-long-close":
        return broken([_head(ctype, _cl(n + 100)) + payload])
    if mode == "cl-and-te":
        return broken([_head(ctype, _cl(7), TE) + b"".join(_chunk(p) for p in pieces) + LAST])
    if mode == "two-cls":
        return broken([_head(ctype, _cl(n), _cl(n + 5)) + payload])
    if mode == "continue-100":
        p = normal()
        p.steps[:0] = [b"HTTP/1.1 100 Continue\r\n\r\n", 0.02]  # alone, then the 200
        return p
    if mode == "early-hints-103":
        return normal(pre=b"HTTP/1.1 103 Early Hints\r\nLink: </hint.css>; rel=preload\r\n\r\n")
    if mode == "garbage-status":
        return broken([b"SSH-2.0-OpenSSH_9.6 not http\r\n" + _cl(n) + b"\r\n\r\n" + payload])
    if mode == "bad-version":
        return broken([_head(ctype, _cl(n), version=b"HTTP/1.x") + payload])
    if mode == "until-close":
        return broken([_head(ctype)] + list(pieces))
    if mode == "silent-accept":
        return broken([], "hold")
    if mode == "silent-head":
        return broken([_head(ctype, TE if stream else _cl(n))], "hold")
    if mode == "http10":
        extra = () if stream else (_cl(n),)
        return broken([_head(ctype, *extra, version=b"HTTP/1.0")] + list(pieces))
    if mode in ("inject-lf", "inject-cr"):
        sep = b"\n" if mode == "inject-lf" else b"\r"
        return normal(
            ctype + sep + b"Set-Cookie: injected=1" + sep + b"X-Specaudit-Placeholders: 0"
        )
    if mode == "nul-header":
        return normal(ctype.split(b";")[0] + b"; charset=utf-8\x00")
    if mode == "not-json":
        html = b"<html>502 oops</html>"
        ct = b"text/html" if stream else b"application/json"
        return broken([_head(ct, _cl(len(html))) + html], sent=([], html))
    if mode == "truncated-json":
        if stream:
            bad = events[1][: len(events[1]) // 2].rstrip(b"\n") + b"\n\n"
            evs = [events[0], bad, *events[2:]]
            return broken([_head(ctype, TE)] + [_chunk(e) for e in evs] + [LAST], sent=(evs, b""))
        cut = body[: len(body) // 2]
        return broken([_head(ctype, _cl(len(cut))) + cut], sent=([], cut))
    if mode == "done-then-garbage":
        if stream:
            tail = _chunk(events[-1]) + b"zz\r\nnot a chunk\r\n"
            return broken([_head(ctype, TE)] + [_chunk(e) for e in events[:-1]] + [tail], "hold")
        return broken([_head(ctype, _cl(n)) + payload + b"\x00\x01garbage\r\n"], "hold")
    if mode == "reset-mid-stream":
        return broken(
            [_head(ctype, TE if stream else _cl(n)) + (first if stream else pieces[0]), 0.05],
            "reset",
        )
    raise AssertionError(mode)


# ------------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class Hit:
    mode: str
    tag: str


def _asked(path: str, body: dict[str, Any]) -> Ask:
    kind = next(k for k, p in PATHS.items() if p == path)
    if kind == "chat":
        lp = body.get("logprobs") is True
    elif kind == "completions":
        lp = bool(body.get("logprobs"))
    else:
        lp = bool(body.get("n_probs"))
    return Ask(kind, body.get("stream") is True, lp, body.get("post_sampling_probs") is True)


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][0]["content"])
    return str(body.get("prompt", ""))


@dataclass
class Backend:
    """`fakes.serve_tcp(Backend(...))`: a llama-server look-alike answering in hostile modes.

    ``/health`` and ``/slots`` answer as llama-server does (`speculative` says which role it
    plays); a generation request is answered as its prompt's mode says, and recorded in `hits`.
    A connection kept open after a hostile answer that then carries another request is
    recorded in `reused` (a proxy must never reuse a connection whose framing it distrusted).
    """

    speculative: bool
    hits: list[Hit] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection is done."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE)
        except asyncio.IncompleteReadError:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        raw = await reader.readexactly(length) if length else b""
        if method == "GET" and path in ("/health", "/slots"):
            obj: Any = (
                {"status": "ok"}
                if path == "/health"
                else [{"id": 0, "speculative": self.speculative}]
            )
            data = _enc(obj)
            writer.write(_head(b"application/json", _cl(len(data)), b"Connection: close") + data)
            await writer.drain()
            return False
        body = json.loads(raw)
        _, mode, tag = _prompt(body).split(" ")
        self.hits.append(Hit(mode, tag))
        plan = planned(mode, _asked(path, body))
        for step in plan.steps:
            if isinstance(step, float):
                await asyncio.sleep(step)
            elif plan.drip:
                for i in range(len(step)):
                    writer.write(step[i : i + 1])
                    await writer.drain()
                    await asyncio.sleep(DRIP)
            else:
                writer.write(step)
                await writer.drain()
        if plan.end == "keep":
            return True
        if plan.end == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return False
        if plan.end == "hold":
            try:
                more = await asyncio.wait_for(reader.read(65536), HOLD)
            except TimeoutError:
                return False
            if more:
                self.reused.append(mode)
        return False


# ------------------------------------------------------------------------------- the client


@dataclass
class Reply:
    """The proxy's answer as read off the socket, parsed strictly.

    ``status`` 0: no complete response head arrived. ``bad_lines``: header lines holding a
    CR, LF or NUL, or not ``name: value``. ``complete``: the body's framing ended (length
    reached, last chunk read, or the close of a body delimited by it). ``extra``: bytes after
    the end of the message. ``framing_error``: the proxy's own chunked framing was broken.
    """

    raw: bytes
    eof: bool  # the proxy closed the connection before the client's deadline
    reset: bool = False
    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)
    bad_lines: list[bytes] = field(default_factory=list)
    chunked: bool = False
    body: bytes = b""
    complete: bool = False
    extra: bytes = b""
    framing_error: str = ""
    seconds: float = 0.0

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name.lower()]


def exchange(url: str, path: str, body: bytes, bound: float) -> Reply:
    """POST `body` with ``Connection: close`` and read until the proxy closes (or `bound`)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    req = (
        b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%b"
        % (path.encode(), url.removeprefix("http://").encode(), len(body), body)
    )
    t0 = time.monotonic()
    deadline = t0 + bound
    data = bytearray()
    eof = reset = False
    with socket.create_connection((host, int(port)), timeout=bound) as s:
        s.sendall(req)
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                got = s.recv(1 << 20)
            except TimeoutError:
                break
            except ConnectionResetError:
                eof = reset = True
                break
            if not got:
                eof = True
                break
            data += got
    r = parse_reply(bytes(data), eof)
    r.reset, r.seconds = reset, time.monotonic() - t0
    return r


_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEX = re.compile(rb"[0-9A-Fa-f]+")


def parse_reply(raw: bytes, eof: bool) -> Reply:
    r = Reply(raw, eof)
    end = raw.find(b"\r\n\r\n")
    if end < 0:
        return r
    lines = raw[:end].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or parts[0] != b"HTTP/1.1" or not parts[1].isdigit():
        r.bad_lines.append(lines[0])
        return r
    r.status = int(parts[1])
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.fullmatch(name) or any(c in line for c in b"\r\n\x00"):
            r.bad_lines.append(line)
            continue
        r.headers.append((name.decode().lower(), value.strip(b" \t").decode("latin-1")))
    rest = raw[end + 4 :]
    te = r.header("transfer-encoding")
    cl = r.header("content-length")
    if te:
        r.chunked = True
        _dechunk(r, rest)
    elif cl:
        n = int(cl[0])
        r.body, r.extra, r.complete = rest[:n], rest[n:], len(rest) >= n
    else:
        r.body, r.complete = rest, eof
    return r


def _dechunk(r: Reply, data: bytes) -> None:
    out = bytearray()
    i = 0
    while True:
        j = data.find(b"\r\n", i)
        if j < 0:
            break  # cut before a chunk's size line ended
        size_s = data[i:j].split(b";", 1)[0]
        if not _HEX.fullmatch(size_s):
            r.framing_error = f"bad chunk size line {data[i:j][:40]!r}"
            break
        size = int(size_s, 16)
        i = j + 2
        if size == 0:
            while (j := data.find(b"\r\n", i)) >= 0:
                if j == i:
                    r.complete, r.extra = True, data[j + 2 :]
                    break
                i = j + 2
            break
        if len(data) < i + size + 2:
            break  # cut mid-chunk: its data is not counted
        if data[i + size : i + size + 2] != b"\r\n":
            r.framing_error = "chunk data not followed by CRLF"
            break
        out += data[i : i + size]
        i += size + 2
    r.body = bytes(out)


def split_events(body: bytes) -> tuple[list[bytes], bytes]:
    """LF LF-terminated SSE events (what llama-server and the proxy write) and the rest."""
    out = []
    while (i := body.find(b"\n\n")) >= 0:
        out.append(body[: i + 2])
        body = body[i + 2 :]
    return out, body


def event_value(ev: bytes) -> Any:
    """None for a comment, "[DONE]", or the JSON of the data; ValueError otherwise."""
    lines = [ln for ln in ev.split(b"\n") if ln]
    if all(ln.startswith(b":") for ln in lines):
        return None
    if len(lines) != 1 or not lines[0].startswith(b"data: "):
        raise ValueError(f"not one data line: {ev[:80]!r}")
    data = lines[0][6:]
    if data == b"[DONE]":
        return "[DONE]"
    return json.loads(data)
