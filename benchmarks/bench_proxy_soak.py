"""Soak: `specaudit proxy` under mixed load, a client that pipelines and never reads, and
thousands of idle connections. Does every request reach the right backend, does no placeholder
pass as real, and does the proxy give its memory back?

    .venv/bin/python benchmarks/bench_proxy_soak.py [--seconds 60] [--clients 200]
        [--idle 2000] [--fake-backends [--stall-checks]] [--rounds 1] [--proxy-src DIR]
        [--json]

It takes about 80 s per round plus the servers' start. `--proxy-src DIR` runs another
checkout's proxy (for a before/after pair: ``git archive REV src | tar -x -C DIR``, then
``--proxy-src DIR/src``); `--rounds N` repeats the load, so memory a leak holds (growing round
by round) can be told from memory the allocator keeps for reuse (flat after the first round).

The proxy runs as its own process (`specaudit proxy`, as a user runs it, started by
benchmarks/bench_proxy.py's `proxy_process`), so the resident memory read from
/proc/PID/status (VmRSS) is the proxy's alone. Behind it:
- by default, a plain and a speculating fixture llama-server (bench_proxy's `fixture_servers`:
  the tiny fixture, the speculating one with the fixture's draft, so a logprobs request that
  reached it would get real placeholders);
- with `--fake-backends`, two fake llama-servers (this script with `--serve-fake`, each its own
  process) that answer at once, to load the proxy rather than the model. The fake plain one
  puts a placeholder (logprob 0.0 and no candidates; streamed, no entry at all) at the first
  token of every 4th logprobs answer, so the proxy's check has something to catch. With
  `--stall-checks`, the fake spec backend's ``/health`` hangs from a quarter to half of each
  round's load (its generation endpoints still answer at once): a role check begun then
  times out, as checks do on a machine too loaded to answer them in time, and spec counts as
  down until the next check; the core hands the requests meant for spec to aiohttp's path
  meanwhile, and ``/metrics`` says how many requests the core served after all and how many
  connections came back to it.

Load, for `--seconds`:
- `--clients` concurrent clients, each sending one random request after another: chat,
  completions or native /completion; streamed or not; logprobs (2 candidates) or not;
  max_tokens 8. Even-numbered clients keep their connection alive, odd ones open a new
  connection per request;
- one pipeliner: `--pipeline-conns` (4) connections, each sent `--pipeline-depth` (150)
  pipelined ``POST /completion`` requests in one write, `--pipeline-batches` (1) times, and
  never read. Each asks for 128 tokens with 20 candidates (`--pipeline-tokens`,
  `--pipeline-probs`): about 100 KB of answer for 200 bytes of request, so a proxy that keeps
  answering a client that reads nothing shows it in its memory;
- `--idle` connections, opened before the load and held until it ends. Each first sends one
  request and reads its answer, half ``GET /health`` (answered by aiohttp's path, which gives
  the connection back to the forwarding core afterwards; a proxy before that kept them on
  aiohttp's path), half a one-token ``POST /completion`` (the core's): a connection that has sent
  nothing counts as a request being sent, which the proxy ends after --client-timeout (30 s)
  or pushes out beyond --max-incomplete-requests (256), so idle here means kept alive between
  requests.

How each answer is judged:
- **which backend answered**: the ``model`` field of the answer (of any event of a stream).
  The llama-servers are started with ``--alias soak-plain`` / ``--alias soak-spec`` and
  llama-server echoes its alias there in every answer; the fakes do the same. A **wrong route**
  is a logprobs request answered by soak-spec, or a default one answered by soak-plain, unless
  the proxy said it fell back (``X-Specaudit-Fallback``). An answer without a known ``model``
  is **unidentified** (it counts against the same goal: the route could not be checked);
- **placeholder presented as real**, in the answer to a logprobs request: a token whose
  logprob is a number while it has no candidates (llama-server's placeholder is 0.0 with empty
  top_logprobs); a null token beyond the count in ``X-Specaudit-Placeholders`` (non-streamed);
  a streamed token with no probability entry at all. A null token counted as such is
  **caught**;
- **errors by kind**: a status other than 200, a transport error (timeout, disconnected,
  ...), a stream that ends without ``[DONE]`` (native: without its ``stop`` event) or carries an
  error event, a body that is not JSON.

Goals (exit 1 and one line per missed goal; 0 when all are met): wrong routes and
unidentified answers 0; placeholders presented as real 0; proxy RSS after the load (every
client closed, nothing in flight, then `--settle` seconds) within `--rss-slack` MB (20) of its
idle RSS (after one request of each kind, before any load or idle connection); the proxy
still running at the end; and every one of the 12 request kinds answered at least once
(otherwise the other goals prove nothing for it). Errors, latency percentiles (from sending
the request to the last byte of the answer, measured in this process, so a busy load
generator adds to them) and peak RSS (sampled every 0.5 s) are reported, not goals.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import resource
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_proxy import (  # noqa: E402
    MAX_TOKENS,
    PROMPT,
    _interrupt,
    _serving,
    fixture_servers,
    pct,
    proxy_process,
)
from bench_proxy import body as openai_body  # noqa: E402
from specaudit import logprobs  # noqa: E402
from specaudit.client import ClientError, parse_sse  # noqa: E402
from specaudit.llama import free_port  # noqa: E402
from specaudit.logprobs import TokenClass  # noqa: E402
from specaudit.proxy.backends import describe_error  # noqa: E402
from specaudit.proxy.runner import new_loop  # noqa: E402

ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "completion": "/completion",
}
TOP = 2  # candidates a logprobs request asks for (bench_proxy's `body` asks for 2 too)
ALIAS = {"plain": "soak-plain", "spec": "soak-spec"}
ROLE_OF = {v: k for k, v in ALIAS.items()}
Kind = tuple[str, bool, bool]  # endpoint, streamed, logprobs
KINDS: list[Kind] = [(e, s, lp) for e in ENDPOINTS for s in (False, True) for lp in (False, True)]
JSON_HEADERS = {"Content-Type": "application/json"}


def request_body(endpoint: str, stream: bool, lp: bool) -> bytes:
    """bench_proxy's request body on the OpenAI endpoints; the native fields on /completion."""
    if endpoint != "completion":
        return openai_body(ENDPOINTS[endpoint], stream, lp)
    b: dict[str, Any] = {"prompt": PROMPT, "n_predict": MAX_TOKENS, "temperature": 1.0}
    b["stream"] = stream
    if lp:
        b["n_probs"] = TOP
    return json.dumps(b).encode()


PAYLOADS = {k: request_body(*k) for k in KINDS}


# ------------------------------------------------------------------------ judging an answer


@dataclass
class Judged:
    """What one answer shows (see the module docstring for the rules)."""

    error: str | None = None
    backend: str | None = None  # "plain" or "spec" from the answer's `model`; None: unknown
    wrong_route: bool = False
    fallback: bool = False
    as_real: int = 0  # placeholders presented as real
    caught: int = 0  # placeholders that arrived null (and counted, when not streamed)
    tokens: int = 0  # tokens of a logprobs answer


def _entries(endpoint: str, events: list[dict[str, Any]]) -> int:
    """Probability entries the events of a stream carry (a token without one is unmarked)."""
    n = 0
    for ev in events:
        if endpoint == "completion":
            probs = ev.get("completion_probabilities")
            n += len(probs) if isinstance(probs, list) else 0
            continue
        for ch in ev.get("choices") or []:
            lp = ch.get("logprobs") if isinstance(ch, dict) else None
            if isinstance(lp, dict):
                seq = lp.get("content") if isinstance(lp.get("content"), list) else lp.get("tokens")
                n += len(seq) if isinstance(seq, list) else 0
    return n


def judge(
    endpoint: str, stream: bool, lp: bool, status: int, headers: Mapping[str, str], raw: bytes
) -> Judged:
    """Which backend answered, whether that was the right one, and what the answer shows of
    the placeholders in it."""
    if status != 200:
        return Judged(error=f"HTTP {status}")
    error = None
    if stream:  # a stream that failed is still judged on the events that reached the client
        try:
            sr = parse_sse(raw)
        except ClientError:
            return Judged(error="non-JSON event")
        bodies = [e for e in sr.events if "error" not in e]
        err = next((e["error"] for e in sr.events if "error" in e), None)
        if err is not None:
            error = f"error event {err.get('code') if isinstance(err, dict) else err}"
        elif not sr.done:
            error = "stream without its end"
    else:
        try:
            obj = json.loads(raw)
        except ValueError:
            return Judged(error="body not JSON")
        if not isinstance(obj, dict):
            return Judged(error="body not a JSON object")
        bodies = [obj]
    models = {b["model"] for b in bodies if isinstance(b.get("model"), str)}
    j = Judged(error, ROLE_OF.get(models.pop()) if len(models) == 1 else None)
    j.fallback = "X-Specaudit-Fallback" in headers
    if j.backend is not None and j.backend != ("plain" if lp else "spec") and not j.fallback:
        j.wrong_route = True
    if not lp:
        return j
    records = (
        logprobs.from_stream(endpoint, bodies, TOP)
        if stream
        else logprobs.from_response(endpoint, bodies[0], TOP)
    )
    ph = [r for r in records if r.klass is TokenClass.PLACEHOLDER]
    shown = sum(r.reported_logprob is not None for r in ph)
    nulled = len(ph) - shown  # includes streamed tokens with no entry at all
    if stream:
        counted = nulled - (len(records) - _entries(endpoint, bodies))
    else:
        try:
            header = int(headers.get("X-Specaudit-Placeholders", "0"))
        except ValueError:
            header = 0
        counted = min(nulled, header)
    j.tokens, j.caught, j.as_real = len(records), counted, shown + nulled - counted
    return j


@dataclass
class KindStats:
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # seconds, answers judged ok
    wrong: int = 0
    unidentified: int = 0
    fallbacks: int = 0
    as_real: int = 0
    caught: int = 0
    tokens: int = 0

    def add(self, latency: float, j: Judged) -> None:
        """Count one answer; a failed one too for what reached the client of it."""
        self.wrong += j.wrong_route
        self.fallbacks += j.fallback
        self.as_real += j.as_real
        self.caught += j.caught
        self.tokens += j.tokens
        if j.error:
            self.errors[j.error] += 1
            return
        self.ok += 1
        self.latencies.append(latency)
        self.unidentified += j.backend is None


# ------------------------------------------------------------------------------- the load


async def one_request(s: aiohttp.ClientSession, url: str, kind: Kind) -> tuple[float, Judged]:
    endpoint, stream, lp = kind
    t0 = time.perf_counter()
    try:
        async with s.post(
            url + ENDPOINTS[endpoint], data=PAYLOADS[kind], headers=JSON_HEADERS
        ) as r:
            raw = await r.read()
            status, headers = r.status, r.headers
    except (aiohttp.ClientError, TimeoutError) as e:
        return time.perf_counter() - t0, Judged(error=describe_error(e))
    return time.perf_counter() - t0, judge(endpoint, stream, lp, status, headers, raw)


async def client(
    i: int, url: str, until: float, stats: dict[Kind, KindStats], timeout: float, seed: int
) -> None:
    """One client: random request kinds until `until`; even `i` keeps its connection alive."""
    rng = random.Random(seed * 100_003 + i)
    connector = aiohttp.TCPConnector(limit=1, force_close=i % 2 == 1)
    to = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=to) as s:
        while time.monotonic() < until:
            kind = rng.choice(KINDS)
            latency, j = await one_request(s, url, kind)
            stats[kind].add(latency, j)
            if j.error:
                await asyncio.sleep(0.05)  # a proxy that is gone must not make this spin


@dataclass
class Held:
    """Idle connections and the pipeliner's, and what became of them."""

    idle_opened: int = 0
    idle_failed: int = 0  # could not connect or got no /health answer
    idle_closed_by_proxy: int = 0  # closed by the proxy while held
    idle_closed_after: float | None = None  # the shortest time one was held before that (s)
    pipelined_sent: int = 0  # requests written to the pipeliner's sockets
    pipelined_bytes: int = 0
    pipeline_closed_by_proxy: int = 0  # pipeliner connections the proxy closed or reset


def _raw_request(path: str, payload: bytes | None) -> bytes:
    """An HTTP/1.1 request as bytes: GET without `payload`, else a JSON POST."""
    if payload is None:
        return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


# what idle connections send before they go idle: a /health check (answered by aiohttp's
# path, which gives the connection back to the core) or a one-token generation (the core's)
IDLE_REQUESTS = [
    _raw_request("/health", None),
    _raw_request("/completion", json.dumps({"prompt": PROMPT, "n_predict": 1}).encode()),
]


async def _exchange(loop: asyncio.AbstractEventLoop, s: socket.socket, req: bytes) -> None:
    """Send `req` and read its whole answer (Content-Length or chunked)."""
    await loop.sock_sendall(s, req)
    got = b""
    while True:
        head, sep, rest = got.partition(b"\r\n\r\n")
        if sep:
            fields = {
                k.strip().lower(): v.strip()
                for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n")[1:])
            }
            if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
                if rest.endswith(b"0\r\n\r\n"):
                    return
            elif len(rest) >= int(fields.get(b"content-length", b"0")):
                return
        data = await loop.sock_recv(s, 65536)
        if not data:
            raise ConnectionError("closed before the answer was complete")
        got += data


async def hold_idle(
    port: int, n: int, opened: asyncio.Event, stop: asyncio.Event, held: Held
) -> None:
    """Open `n` connections (100 at a time), one exchange each (`IDLE_REQUESTS` in turn), and
    hold them until `stop`, noting the ones the proxy closes meanwhile."""
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []

    opened_at: dict[socket.socket, float] = {}

    async def open_one(req: bytes) -> None:
        s = socket.socket()
        s.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", port)), 30)
            await asyncio.wait_for(_exchange(loop, s, req), 60)
        except (OSError, TimeoutError):
            held.idle_failed += 1
            s.close()
            return
        socks.append(s)
        opened_at[s] = time.monotonic()

    async def watch(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            await loop.sock_recv(s, 1)  # returns only when the proxy closes (or sends)
        held.idle_closed_by_proxy += 1
        after = time.monotonic() - opened_at[s]
        held.idle_closed_after = min(after, held.idle_closed_after or after)

    try:
        for start in range(0, n, 100):
            reqs = (IDLE_REQUESTS[i % 2] for i in range(start, min(n, start + 100)))
            await asyncio.gather(*(open_one(req) for req in reqs))
        held.idle_opened += len(socks)
        opened.set()
        watchers = [asyncio.ensure_future(watch(s)) for s in socks]
        await stop.wait()
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
    finally:
        opened.set()
        for s in socks:
            s.close()


def pipelined_request(tokens: int, probs: int) -> bytes:
    """One native /completion request with a large answer (`probs` candidates for each of
    `tokens` tokens: about 100 KB from 128 x 20 on the fixture, from a request of 200 bytes)."""
    body = {"prompt": PROMPT, "n_predict": tokens, "n_probs": probs, "temperature": 1.0}
    return _raw_request("/completion", json.dumps(body).encode())


async def pipeliner(
    port: int, req: bytes, conns: int, depth: int, batches: int, stop: asyncio.Event, held: Held
) -> None:
    """`conns` connections, each sent `depth` pipelined copies of `req` per write, `batches`
    writes; never a byte read (raw sockets: a stream reader would read ahead)."""
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []

    async def one() -> None:
        s = socket.socket()
        s.setblocking(False)
        socks.append(s)
        try:
            await loop.sock_connect(s, ("127.0.0.1", port))
            for _ in range(batches):
                await loop.sock_sendall(s, req * depth)  # waits while the proxy reads nothing
                held.pipelined_sent += depth
                held.pipelined_bytes += len(req) * depth
        except OSError:
            held.pipeline_closed_by_proxy += 1

    tasks = [asyncio.ensure_future(one()) for _ in range(conns)]
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in socks:
            s.close()


# ------------------------------------------------------------------- the proxy's memory


def rss_mb(pid: int) -> float | None:
    """VmRSS of a process in MB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


class RssSampler:
    """Samples a process's RSS every `every` seconds in a thread of its own (a busy event loop
    in this process must not delay the samples)."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, float]] = []  # (monotonic time, MB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            mb = rss_mb(self.pid)
            if mb is not None:
                self.samples.append((time.monotonic(), mb))
            self._stop.wait(self.every)

    def peak(self, since: float, until: float) -> float:
        return max((mb for t, mb in self.samples if since <= t <= until), default=float("nan"))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def proxy_metrics(url: str) -> dict[str, float]:
    """The proxy's /metrics, series (with labels) -> value; {} if it does not answer."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def _sum(m: Mapping[str, float], prefix: str) -> dict[str, float]:
    """Series of one metric by their labels, e.g. ``{'kind="timeout"': 3.0}``."""
    return {k[len(prefix) :].strip("{}"): v for k, v in m.items() if k.startswith(prefix)}


# ------------------------------------------------------------------------------- the run


@dataclass
class SoakResult:
    backends: str
    seconds: float  # of load, all rounds
    rounds: int
    clients: int
    idle: int
    pipeline: str
    load_avg: tuple[float, float]  # at start and end
    requests: int
    ok: int
    rps: float
    errors: dict[str, int]
    wrong_routes: int
    unidentified: int
    fallbacks: int
    placeholders_as_real: int
    placeholders_caught: int
    logprob_tokens: int
    latency_ms: dict[str, float]
    kinds: list[dict[str, Any]]
    rss_idle_mb: float
    rss_with_idle_mb: float  # idle connections open, before the load
    rss_peak_mb: float
    rss_end_of_load_mb: float  # connections still held
    rss_after_mb: float  # after the last round
    rss_rounds_mb: list[dict[str, float]]  # per round: with_idle, peak, end, after
    held: Held
    warmup_errors: dict[str, int]
    proxy: dict[str, Any]  # from its /metrics after the load
    proxy_alive: bool
    missed: list[str]


def _latency(xs: list[float]) -> dict[str, float]:
    return {q: pct(xs, v) * 1e3 for q, v in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def soak(url: str, pid: int, args: argparse.Namespace, rss: RssSampler) -> dict[str, Any]:
    """Warm up, measure the idle RSS, then `--rounds` times: the load, everything closed, the
    proxy left to settle, its RSS read."""
    warm: dict[Kind, KindStats] = {k: KindStats() for k in KINDS}
    async with aiohttp.ClientSession() as s:
        for kind in KINDS:  # every path the load takes, once, before "idle" is measured
            warm[kind].add(*await one_request(s, url, kind))
    reads = []
    for _ in range(3):  # the median of three reads, 2-3 s after the warm-up
        await asyncio.sleep(1)
        reads.append(rss_mb(pid) or float("nan"))
    r: dict[str, Any] = {
        "warm": warm,
        "stats": {k: KindStats() for k in KINDS},
        "held": Held(),
        "wall": 0.0,
        "rss_idle": sorted(reads)[1],
        "rounds": [],
    }
    for n in range(args.rounds):
        if n:
            log(f"round {n + 1} of {args.rounds}")
        r["rounds"].append(await load_round(url, pid, args, rss, r))
    after = r["rounds"][-1]["after"]
    r["alive"] = rss_mb(pid) is not None
    r["rss_after"] = after
    r["rss_peak"] = max(x["peak"] for x in r["rounds"])
    r["metrics"] = await asyncio.to_thread(proxy_metrics, url)
    return r


async def load_round(
    url: str, pid: int, args: argparse.Namespace, rss: RssSampler, r: dict[str, Any]
) -> dict[str, float]:
    """One load (idle connections, pipeliner, clients), counted into `r`; the proxy's RSS with
    the idle connections open, at its peak, at the end of the load and after it settled."""
    port = int(url.rsplit(":", 1)[1])
    stats: dict[Kind, KindStats] = r["stats"]
    held: Held = r["held"]
    t_begin = time.monotonic()
    stop, opened = asyncio.Event(), asyncio.Event()
    idle_task = asyncio.ensure_future(hold_idle(port, args.idle, opened, stop, held))
    await opened.wait()
    await asyncio.sleep(1)
    with_idle = rss_mb(pid) or float("nan")
    log(
        f"{held.idle_opened} idle connections open ({held.idle_failed} failed); proxy RSS "
        f"{r['rss_idle']:.1f} MB idle, {with_idle:.1f} MB with them"
    )
    req = pipelined_request(args.pipeline_tokens, args.pipeline_probs)
    pipe_task = asyncio.ensure_future(
        pipeliner(
            port,
            req,
            args.pipeline_conns,
            args.pipeline_depth,
            args.pipeline_batches,
            stop,
            held,
        )
    )
    t0 = time.monotonic()
    until = t0 + args.seconds
    seed = args.seed + len(r["rounds"])  # each round its own request sequence
    clients = [
        asyncio.ensure_future(client(i, url, until, stats, args.request_timeout, seed))
        for i in range(args.clients)
    ]

    async def progress() -> None:
        while True:
            await asyncio.sleep(10)
            n = sum(k.ok + sum(k.errors.values()) for k in stats.values())
            errs = sum(sum(k.errors.values()) for k in stats.values())
            wrong = sum(k.wrong for k in stats.values())
            m = await asyncio.to_thread(proxy_metrics, url)
            if m:
                core = _sum(m, "specaudit_proxy_fast_path_total").get('outcome="served"', 0)
                total = sum(_sum(m, "specaudit_proxy_requests_total").values())
                spec_up = _sum(m, "specaudit_proxy_backend_up").get('backend="spec"', 0)
                seen = (
                    f"proxy: {core:.0f} of {total:.0f} served by its core, "
                    f"spec {'up' if spec_up else 'down'}"
                )
            else:  # a busy proxy's /metrics can miss the 5 s: say so, not "0 of 0, down"
                seen = "proxy: /metrics did not answer in 5 s"
            log(
                f"{time.monotonic() - t0:5.0f} s: {n} requests, {errs} errors, {wrong} wrong "
                f"routes, {seen}, "
                f"RSS {rss_mb(pid) or float('nan'):.1f} MB, "
                f"pipelined {held.pipelined_sent}"
            )

    async def stall_checks(pid: int) -> None:
        """Spec's /health hangs from a quarter to half of the load."""
        await asyncio.sleep(args.seconds / 4)
        os.kill(pid, signal.SIGUSR1)
        log(f"{time.monotonic() - t0:5.0f} s: spec's /health stalls")
        try:
            await asyncio.sleep(args.seconds / 4)
        finally:
            os.kill(pid, signal.SIGUSR1)
            log(f"{time.monotonic() - t0:5.0f} s: spec's /health answers again")

    ticker = asyncio.ensure_future(progress())
    if args.stall_pid is not None:
        stall_task: asyncio.Future[None] | None = asyncio.ensure_future(
            stall_checks(args.stall_pid)
        )
    else:
        stall_task = None
    try:
        _, pending = await asyncio.wait(clients, timeout=args.seconds + args.request_timeout + 30)
        for t in pending:
            t.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        r["wall"] += time.monotonic() - t0
        end_rss = rss_mb(pid) or float("nan")
    finally:
        ticker.cancel()
        if stall_task is not None:
            stall_task.cancel()
            await asyncio.gather(stall_task, return_exceptions=True)
        stop.set()
        await asyncio.gather(idle_task, pipe_task, return_exceptions=True)
    t_end = time.monotonic()
    # settle: nothing in flight at the proxy, then --settle seconds more
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = await asyncio.to_thread(proxy_metrics, url)
        if m.get("specaudit_proxy_in_flight", 0) <= 1:  # the /metrics request itself
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(args.settle)
    after = rss_mb(pid)
    log(f"proxy RSS after the load: {after or float('nan'):.1f} MB")
    return {
        "with_idle": with_idle,
        "peak": rss.peak(t_begin, t_end),
        "end": end_rss,
        "after": after if after is not None else float("nan"),
    }


def summarise(r: dict[str, Any], args: argparse.Namespace, load0: float) -> SoakResult:
    stats: dict[Kind, KindStats] = r["stats"]
    errors: Counter[str] = Counter()
    for k in stats.values():
        errors.update(k.errors)
    warm_errors: Counter[str] = Counter()
    for k in r["warm"].values():
        warm_errors.update(k.errors)
    ok = sum(k.ok for k in stats.values())
    wrong = sum(k.wrong for k in stats.values())
    unidentified = sum(k.unidentified for k in stats.values())
    as_real = sum(k.as_real for k in stats.values())
    kinds = []
    for (ep, stream, lp), k in stats.items():
        kinds.append(
            {
                "endpoint": ep,
                "stream": stream,
                "logprobs": lp,
                "ok": k.ok,
                "errors": sum(k.errors.values()),
                "wrong_routes": k.wrong,
                "unidentified": k.unidentified,
                "placeholders_as_real": k.as_real,
                "placeholders_caught": k.caught,
                **{f"{q}_ms": v for q, v in _latency(k.latencies).items()},
            }
        )
    m = r["metrics"]
    proxy = {
        "in_flight": m.get("specaudit_proxy_in_flight"),
        "requests": sum(_sum(m, "specaudit_proxy_requests_total").values()),
        "errors": _sum(m, "specaudit_proxy_errors_total"),
        "fast_path": _sum(m, "specaudit_proxy_fast_path_total"),
        "returned": m.get("specaudit_proxy_connections_returned_total", 0.0),
        "backend_up": _sum(m, "specaudit_proxy_backend_up"),
        "placeholders_caught": sum(_sum(m, "specaudit_proxy_placeholders_caught_total").values()),
    }
    missed = []
    if wrong or unidentified:
        missed.append(f"wrong routes {wrong}, unidentified answers {unidentified} (goal 0)")
    if as_real:
        missed.append(f"placeholders presented as real {as_real} (goal 0)")
    growth = r["rss_after"] - r["rss_idle"]
    if not growth <= args.rss_slack:  # NaN (proxy gone) misses too
        missed.append(
            f"proxy RSS after the load {r['rss_after']:.1f} MB, {growth:+.1f} MB from idle "
            f"{r['rss_idle']:.1f} MB (goal within {args.rss_slack:g} MB)"
        )
    if not r["alive"]:
        missed.append("the proxy exited during the soak")
    unanswered = [
        f"{ep}/{'stream' if s else 'json'}/{'logprobs' if lp else 'default'}"
        for (ep, s, lp), k in stats.items()
        if k.ok == 0
    ]
    if unanswered:
        missed.append(f"request kinds never answered: {', '.join(unanswered)}")
    all_lat = [x for k in stats.values() for x in k.latencies]
    held: Held = r["held"]
    return SoakResult(
        backends="fake" if args.fake_backends else "fixture llama-server",
        seconds=round(r["wall"], 1),
        rounds=args.rounds,
        clients=args.clients,
        idle=args.idle,
        pipeline=(
            f"{args.pipeline_conns} x {args.pipeline_batches} x {args.pipeline_depth} "
            f"(/completion, {args.pipeline_tokens} tokens x {args.pipeline_probs} candidates)"
        ),
        load_avg=(load0, os.getloadavg()[0]),
        requests=ok + sum(errors.values()),
        ok=ok,
        rps=round(ok / r["wall"], 1) if r["wall"] else 0.0,
        errors=dict(errors),
        wrong_routes=wrong,
        unidentified=unidentified,
        fallbacks=sum(k.fallbacks for k in stats.values()),
        placeholders_as_real=as_real,
        placeholders_caught=sum(k.caught for k in stats.values()),
        logprob_tokens=sum(k.tokens for k in stats.values()),
        latency_ms=_latency(all_lat),
        kinds=kinds,
        rss_idle_mb=round(r["rss_idle"], 1),
        rss_with_idle_mb=round(r["rounds"][-1]["with_idle"], 1),
        rss_peak_mb=round(r["rss_peak"], 1),
        rss_end_of_load_mb=round(r["rounds"][-1]["end"], 1),
        rss_rounds_mb=[{k: round(v, 1) for k, v in x.items()} for x in r["rounds"]],
        rss_after_mb=round(r["rss_after"], 1),
        held=held,
        warmup_errors=dict(warm_errors),
        proxy=proxy,
        proxy_alive=r["alive"],
        missed=missed,
    )


def render(res: SoakResult) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 120)
    t = Table(title=f"proxy soak: {res.seconds:g} s, {res.backends} backends", title_justify="left")
    for col in ("endpoint", "mode", "route", "ok", "errors", "wrong", "ph real", "ph caught"):
        t.add_column(col, justify="left" if col in ("endpoint", "mode", "route") else "right")
    for col in ("p50 ms", "p99 ms", "max ms"):
        t.add_column(col, justify="right")
    for k in res.kinds:
        t.add_row(
            k["endpoint"],
            "stream" if k["stream"] else "json",
            "logprobs" if k["logprobs"] else "default",
            str(k["ok"]),
            str(k["errors"]),
            str(k["wrong_routes"] + k["unidentified"]),
            str(k["placeholders_as_real"]),
            str(k["placeholders_caught"]),
            f"{k['p50_ms']:.1f}",
            f"{k['p99_ms']:.1f}",
            f"{k['max_ms']:.1f}",
        )
    con.print(t)
    s = Table(show_header=False, title="summary", title_justify="left")
    s.add_column()
    s.add_column()
    lat = res.latency_ms
    h = res.held
    load = f"load avg {res.load_avg[0]:.2f} -> {res.load_avg[1]:.2f}"
    over = f" over {res.rounds} rounds" if res.rounds > 1 else ""
    fast = ", ".join(f"{k} {v:.0f}" for k, v in res.proxy["fast_path"].items())
    perrs = ", ".join(f"{k} {v:.0f}" for k, v in res.proxy["errors"].items()) or "0"
    rows = [
        ("requests", f"{res.requests} ({res.ok} ok, {res.rps:g}/s), {load}"),
        ("errors", ", ".join(f"{k} {v}" for k, v in sorted(res.errors.items())) or "0"),
        (
            "wrong routes (goal 0)",
            f"{res.wrong_routes} wrong, {res.unidentified} unidentified, {res.fallbacks} fallbacks",
        ),
        (
            "placeholders as real (goal 0)",
            f"{res.placeholders_as_real}; caught {res.placeholders_caught} "
            f"(of {res.logprob_tokens} logprobs tokens)",
        ),
        (
            "latency ms",
            f"p50 {lat['p50']:.1f}, p90 {lat['p90']:.1f}, p99 {lat['p99']:.1f}, "
            f"max {lat['max']:.1f}",
        ),
        (
            "proxy RSS MB",
            f"idle {res.rss_idle_mb:.1f}, with the idle connections "
            f"{res.rss_with_idle_mb:.1f}, peak {res.rss_peak_mb:.1f}, end of load "
            f"{res.rss_end_of_load_mb:.1f}, after {res.rss_after_mb:.1f} "
            f"({res.rss_after_mb - res.rss_idle_mb:+.1f} from idle)",
        ),
        (
            "idle connections",
            f"{h.idle_opened} held{over} ({h.idle_failed} failed to open), "
            f"{h.idle_closed_by_proxy} closed by the proxy"
            + (
                f" (the first {h.idle_closed_after:.0f} s after its answer)"
                if h.idle_closed_after is not None
                else ""
            ),
        ),
        (
            "pipeliner",
            f"{res.pipeline}: {h.pipelined_sent} requests ({h.pipelined_bytes} bytes) "
            f"written{over}, "
            f"{h.pipeline_closed_by_proxy} connections closed by the proxy",
        ),
        (
            "proxy /metrics",
            f"requests {res.proxy['requests']:.0f}; fast path {fast}; connections returned "
            f"to the core {res.proxy['returned']:.0f}; errors {perrs}",
        ),
    ]
    if len(res.rss_rounds_mb) > 1:
        rows.append(
            (
                "proxy RSS MB per round",
                "; ".join(
                    f"{i + 1}: peak {x['peak']:.1f}, after {x['after']:.1f}"
                    for i, x in enumerate(res.rss_rounds_mb)
                ),
            )
        )
    if res.warmup_errors:
        rows.append(("warm-up errors", str(res.warmup_errors)))
    for a, b in rows:
        s.add_row(a, b)
    con.print(s)
    if res.missed:
        for m in res.missed:
            con.print(f"[red]goal missed:[/red] {m}")
    else:
        con.print("[green]all goals met[/green]")


# ----------------------------------------------------------------------- the fake backends


def fake_answer(role: str, endpoint: str, body: dict[str, Any], nth: int) -> list[bytes] | bytes:
    """A llama-server-shaped answer from a fake: a JSON body, or the SSE events of a stream.

    ``model`` is the role's alias; spec's timings carry ``draft_n``. Placeholders (logprob 0.0,
    no candidates; streamed, no entry): spec at every other token, plain at the first token of
    every 4th logprobs answer (`nth` counts this backend's logprobs answers)."""
    stream = body.get("stream") is True
    n = int(body.get("n_predict") or body.get("max_tokens") or MAX_TOKENS)
    if endpoint == "chat":
        top = int(body.get("top_logprobs") or 0) if body.get("logprobs") is True else 0
    else:
        top = int(body.get("n_probs") or body.get("logprobs") or 0)
    toks = ["abc"[i % 3] for i in range(n)]
    if not top:
        ph: set[int] = set()
    elif role == "spec":
        ph = set(range(1, n, 2))
    else:
        ph = {0} if nth % 4 == 0 else set()

    def entry(i: int) -> dict[str, Any]:
        tok = toks[i]
        tops = [
            {"id": j, "token": "abc"[j % 3], "bytes": [97 + j % 3], "logprob": -1.1 - j}
            for j in range(0 if i in ph else top)
        ]
        e: dict[str, Any] = {"id": i % 3, "token": tok, "bytes": list(tok.encode())}
        e.update(logprob=0.0 if i in ph else -1.1, top_logprobs=tops)
        return e

    timings: dict[str, Any] = {"prompt_n": 3, "predicted_n": n}
    if role == "spec":
        timings.update(draft_n=n // 2, draft_n_accepted=n // 2)
    model = ALIAS[role]
    if not stream:
        probs = [entry(i) for i in range(n)] if top else None
        text = "".join(toks)
        if endpoint == "completion":
            out: dict[str, Any] = {"content": text, "stop": True, "model": model}
            if probs:
                out["completion_probabilities"] = probs
        else:
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if endpoint == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = {"content": probs} if probs else None
            kind = "chat.completion" if endpoint == "chat" else "text_completion"
            out = {"choices": [choice], "model": model, "object": kind}
        out["timings"] = timings
        return json.dumps(out).encode()
    events: list[dict[str, Any]] = []
    for i, tok in enumerate(toks):
        with_entry = top and i not in ph
        if endpoint == "completion":
            ev: dict[str, Any] = {"index": 0, "content": tok, "tokens": [i % 3], "stop": False}
            if with_entry:
                ev["completion_probabilities"] = [entry(i)]
        else:
            ch: dict[str, Any] = {"index": 0, "finish_reason": None}
            if endpoint == "chat":
                ch["delta"] = {"content": tok}
            else:
                ch["text"] = tok
            if with_entry:
                ch["logprobs"] = {"content": [entry(i)]}
            ev = {"choices": [ch], "model": model}
        events.append(ev)
    if endpoint == "completion":
        events.append({"index": 0, "content": "", "stop": True, "model": model, "timings": timings})
    else:
        last: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if endpoint == "chat":
            last["delta"] = {}
        else:
            last["text"] = ""
        events.append({"choices": [last], "model": model, "timings": timings})
    frames = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
    return frames + ([] if endpoint == "completion" else [b"data: [DONE]\n\n"])


def serve_fake(role: str, port: int) -> None:
    """A fake llama-server (`role` plain or spec) on 127.0.0.1:`port` until killed."""
    from aiohttp import web

    by_path = {p: e for e, p in ENDPOINTS.items()}
    nth = itertools.count()
    stalled = asyncio.Event()  # SIGUSR1 toggles it: /health hangs while it is set

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/health":
            if stalled.is_set():
                await asyncio.sleep(3600)
            return web.json_response({"status": "ok"})
        if request.path == "/slots":
            return web.json_response([{"id": i, "speculative": role == "spec"} for i in range(4)])
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": ALIAS[role]}]})
        endpoint = by_path.get(request.path)
        if request.method != "POST" or endpoint is None:
            return web.json_response({"error": {"message": "not found", "code": 404}}, status=404)
        body = json.loads(await request.read())
        asks = any(body.get(k) for k in ("logprobs", "top_logprobs", "n_probs"))
        ans = fake_answer(role, endpoint, body, next(nth) if asks else 1)
        if isinstance(ans, bytes):
            return web.Response(body=ans, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for frame in ans:
            await resp.write(frame)
        await resp.write_eof()
        return resp

    async def main() -> None:
        server = web.Server(handle, access_log=None)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(
            signal.SIGUSR1, lambda: stalled.clear() if stalled.is_set() else stalled.set()
        )
        await loop.create_server(server, "127.0.0.1", port, backlog=1024)
        await asyncio.Event().wait()

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())


@contextmanager
def fake_backend(role: str) -> Iterator[tuple[str, int]]:
    """A fake llama-server (`serve_fake`) as its own process; yields (url, pid)."""
    port = free_port()
    yield from _serving([sys.executable, __file__, "--serve-fake", role, "--port", str(port)], port)


@contextmanager
def backends(fake: bool, tmp: Path) -> Iterator[tuple[str, str, int | None]]:
    """(plain URL, spec URL, the fake spec's pid): fake llama-servers or the fixture's real
    ones (no pid)."""
    if fake:
        with fake_backend("plain") as (plain, _), fake_backend("spec") as (spec, spec_pid):
            yield plain, spec, spec_pid
        return
    aliases = (ALIAS["plain"], ALIAS["spec"])
    with fixture_servers(tmp, aliases=aliases) as (plain_srv, spec_srv):
        yield plain_srv.url, spec_srv.url, None


def raise_nofile(need: int) -> int:
    """Raise this process's open-file limit towards `need` (the proxy, started after, inherits
    it); returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the load runs")
    ap.add_argument("--clients", type=int, default=200, help="concurrent mixed clients")
    ap.add_argument("--idle", type=int, default=2000, help="idle connections held")
    ap.add_argument("--pipeline-conns", type=int, default=4)
    ap.add_argument("--pipeline-depth", type=int, default=150, help="requests per write")
    ap.add_argument("--pipeline-batches", type=int, default=1, help="writes per connection")
    ap.add_argument("--pipeline-tokens", type=int, default=128, help="n_predict, pipelined")
    ap.add_argument("--pipeline-probs", type=int, default=20, help="n_probs, pipelined")
    ap.add_argument("--fake-backends", action="store_true", help="fast fakes, not llama-server")
    ap.add_argument(
        "--stall-checks",
        action="store_true",
        help="with --fake-backends: spec's /health hangs for the second quarter of each "
        "round's load, so a role check of the proxy times out",
    )
    ap.add_argument("--request-timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds before RSS 'after'")
    ap.add_argument("--rss-slack", type=float, default=20.0, help="MB allowed above idle")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the load (after it settles): memory a leak holds grows round by round, "
        "memory the allocator keeps for reuse does not",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--proxy-src",
        metavar="DIR",
        help="run another checkout's proxy (its src/ directory, imported first), e.g. "
        "one exported with `git archive HEAD src | tar -x -C DIR`",
    )
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--serve-fake", choices=("plain", "spec"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stall_checks and not args.fake_backends:
        ap.error("--stall-checks needs --fake-backends")
    if args.serve_fake:
        serve_fake(args.serve_fake, args.port)
        return
    signal.signal(signal.SIGTERM, _interrupt)  # stop servers and proxy on SIGTERM too
    need = 2 * (args.idle + args.clients + args.pipeline_conns) + 1024
    limit = raise_nofile(need)
    if limit < need:
        log(f"open-file limit {limit} is below the {need} this soak needs; expect errors")
    load0 = os.getloadavg()[0]
    log(
        f"proxy soak: {args.seconds:g} s, {args.clients} clients, {args.idle} idle connections, "
        f"pipeliner {args.pipeline_conns} x {args.pipeline_batches} x {args.pipeline_depth}, "
        f"{'fake' if args.fake_backends else 'fixture llama-server'} backends, "
        f"{os.cpu_count()} CPUs, load avg {load0:.2f}"
        + (f", proxy from {args.proxy_src}" if args.proxy_src else "")
    )
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        plain, spec, spec_pid = stack.enter_context(backends(args.fake_backends, tmp))
        args.stall_pid = spec_pid if args.stall_checks else None
        url, pid = stack.enter_context(proxy_process(plain, spec, src=args.proxy_src))
        rss = stack.enter_context(RssSampler(pid))
        with asyncio.Runner(loop_factory=new_loop) as runner:
            raw = runner.run(soak(url, pid, args, rss))
    res = summarise(raw, args, load0)
    if args.json:
        print(json.dumps(asdict(res), indent=2))
    else:
        render(res)
    sys.exit(1 if res.missed else 0)


if __name__ == "__main__":
    main()
