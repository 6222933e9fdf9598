"""What `specaudit proxy` costs: added latency (p50, p99) and throughput against a direct
connection to the same fixture llama-server, at concurrency 1, 16 and 64, streamed and not;
and, in the same run, LiteLLM's proxy with the specaudit callback and LiteLLM alone.

    .venv/bin/python benchmarks/bench_proxy.py [--rounds 3] [--scale 1.0] [--threads 1]
        [--gemma] [--no-litellm] [--no-floor] [--litellm-scale 0.1]

Targets (the `target` column): ``specaudit`` = `specaudit proxy` (on uvloop, its default
when installed); ``sa/asyncio`` = the same with ``--loop asyncio``; ``relay`` = a byte relay
that parses nothing (benchmarks/relay_floor.py, uvloop), the floor under any Python proxy
here, so the table shows how much of the proxy's cost is the second hop itself; ``litellm+sa`` = the
``litellm`` proxy process with ``specaudit.integrations.litellm.handler`` in its config.yaml,
one model group holding both servers (the callback routes); ``litellm`` = the same process
without the callback, one model group per server (so it reaches the same backend as the
others). LiteLLM is far slower, so it gets `--litellm-scale` times the requests (throughput is
a rate; its latency percentiles rest on fewer samples).

The proxy runs as its own process (`specaudit proxy`, as a user would run it) in front of a
plain and a speculating fixture llama-server; the load generator is an aiohttp client in this
process. Requests without logprobs (routed to the speculating server) are compared with the
same requests sent straight to it; a second table does the same for logprobs requests
(routed to the plain server and checked token by token) against the plain server.

Direct and proxied runs alternate, `--rounds` times, so drift on a shared machine hits both
alike; latencies are pooled over rounds, throughput is the median round. CPU time of every
process on the path (client, proxy, server) is read from /proc around each run, which explains
the throughput ratio on a CPU-bound machine. Goals from the issue: p99 overhead <= 2 ms,
throughput >= 0.95x direct (LiteLLM documents a 3.25 ms median). `--gemma` adds Gemma 3 270M
rows (needs a quiet machine). Results and how to read them: docs/proxy.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from specaudit import fixtures, llama
from specaudit.llama import LlamaServer, free_port
from specaudit.llama.process import pdeathsig

PROMPT = "abcab"
MAX_TOKENS = 8
COUNTS = {1: 300, 16: 1200, 64: 1600}  # requests per run, per round (scaled by --scale)


@dataclass
class Run:
    latencies: list[float]  # seconds
    wall: float
    errors: int
    cpu: float = 0.0  # CPU seconds of every process on the path (client, proxy, server)
    proxy_cpu: float = 0.0  # the proxy's share

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall if self.wall else 0.0


def body(
    path: str,
    stream: bool,
    logprobs: bool,
    prompt: str = PROMPT,
    max_tokens: int = MAX_TOKENS,
    model: str = "fixture",
) -> bytes:
    b: dict[str, object] = {"max_tokens": max_tokens, "temperature": 1.0, "stream": stream}
    b["model"] = model  # llama-server and specaudit proxy ignore it; LiteLLM routes on it
    if path == "/v1/chat/completions":
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    if logprobs and path == "/v1/chat/completions":
        b.update(logprobs=True, top_logprobs=2)
    elif logprobs:  # the completions endpoint's own form (LiteLLM refuses logprobs: true there)
        b["logprobs"] = 2
    return json.dumps(b).encode()


async def load(url: str, path: str, payload: bytes, n: int, conc: int, stream: bool) -> Run:
    """`n` requests from `conc` workers; latency is until the whole body has been read."""
    # llama-server closes every streamed connection, so stream runs use fresh connections
    # for direct and proxied runs alike; non-streamed runs keep connections alive.
    connector = aiohttp.TCPConnector(limit=conc, force_close=stream)
    lat: list[float] = []
    errors = 0
    todo = iter(range(n))
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as s:

        async def worker() -> None:
            nonlocal errors
            for _ in todo:
                t0 = time.perf_counter()
                try:
                    async with s.post(url + path, data=payload, headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    return Run(lat, wall, errors)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def measured(
    url: str,
    path: str,
    payload: bytes,
    n: int,
    conc: int,
    stream: bool,
    server_pid: int,
    proxy_pid: int | None,
) -> Run:
    """`load`, plus the CPU time it cost the client, the proxy (if any) and the server."""
    pids = [server_pid] + ([proxy_pid] if proxy_pid else [])
    before = [cpu_seconds(p) for p in pids]
    c0 = time.process_time()
    run = asyncio.run(load(url, path, payload, n, conc, stream))
    client = time.process_time() - c0
    after = [cpu_seconds(p) for p in pids]
    deltas = [a - b for a, b in zip(after, before, strict=True)]
    run.cpu = client + sum(deltas)
    run.proxy_cpu = deltas[1] if proxy_pid else 0.0
    return run


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[i]


@contextmanager
def fixture_servers(
    tmp: Path, threads: int = 1, aliases: tuple[str, str] | None = None
) -> Iterator[tuple[LlamaServer, LlamaServer]]:
    """A plain and a speculating fixture llama-server.

    One decode thread each: on a busy 2-core machine ggml's thread barrier stalls for seconds
    whenever a second decode thread is descheduled, which would swamp what is measured here.
    `aliases` (plain's, spec's) name their models (`--alias`): llama-server echoes the name as
    ``model`` in every response, so a client can tell which server answered.
    """
    bins = llama.ensure()
    fs = fixtures.build(tmp / "fixtures")
    common: dict[str, Any] = {"parallel": 4, "ctx_size": 1024}
    args = ["-t", str(threads), "-tb", str(threads)]
    plain_args, spec_args = ([*args, "--alias", a] for a in aliases) if aliases else (args, args)
    with (
        LlamaServer(
            bins, Path(fs.target), name="bench-plain", extra_args=plain_args, **common
        ) as plain,
        LlamaServer(
            bins,
            Path(fs.target),
            draft=Path(fs.draft),
            spec_type="draft-simple",
            name="bench-spec",
            extra_args=spec_args,
            **common,
        ) as spec,
    ):
        yield plain, spec


@contextmanager
def gemma_servers() -> Iterator[tuple[LlamaServer, LlamaServer]]:
    """Gemma 3 270M plain and as its own draft (the report's setup)."""
    from specaudit.models import gemma_270m

    bins = llama.ensure()
    g = gemma_270m().path
    with (
        LlamaServer(bins, g, parallel=2, ctx_size=4096, name="bench-gemma-plain") as plain,
        LlamaServer(
            bins,
            g,
            draft=g,
            spec_type="draft-simple",
            parallel=2,
            ctx_size=4096,
            name="bench-gemma-spec",
        ) as spec,
    ):
        yield plain, spec


@contextmanager
def proxy_process(
    plain: str, spec: str, extra: tuple[str, ...] = (), src: str | None = None
) -> Iterator[tuple[str, int]]:
    """`specaudit proxy` as a separate process, as a user runs it (`src`: another checkout's
    ``src`` directory, imported first)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-c",
        "from specaudit.cli import main; main()",
        "proxy",
        "--plain",
        plain,
        "--spec",
        spec,
        "--listen",
        f"127.0.0.1:{port}",
        "--log-level",
        "warning",
        *extra,
    ]
    yield from _serving(cmd, port, env={"PYTHONPATH": src} if src else None)


@contextmanager
def relay_process(upstream: str) -> Iterator[tuple[str, int]]:
    """benchmarks/relay_floor.py in front of one server: what a proxy costs that reads nothing."""
    port = free_port()
    host, _, up_port = upstream.removeprefix("http://").partition(":")
    cmd = [sys.executable, str(Path(__file__).with_name("relay_floor.py")), host, up_port]
    yield from _serving([*cmd, str(port), "uvloop"], port)


def _serving(
    cmd: list[str],
    port: int,
    env: dict[str, str] | None = None,
    health: str = "/health",
    within: float = 60.0,
) -> Iterator[tuple[str, int]]:
    """Start `cmd` (listening on `port`), wait until `health` answers through it (the relay
    passes it to its server), yield (url, pid), stop it after."""
    # stderr to a file, not a pipe: a chatty process (LiteLLM) would block on a full pipe
    with tempfile.TemporaryFile() as errlog:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=errlog,
            preexec_fn=pdeathsig,  # dies with us
            env={**os.environ, **env} if env else None,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + within
            while proc.poll() is None:
                try:
                    if httpx.get(url + health, timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd} did not come up in {within:g} s")
                time.sleep(0.1)
            else:
                errlog.seek(0)
                err = errlog.read().decode(errors="replace").strip()[-300:]
                raise RuntimeError(f"{Path(cmd[0]).name} exited: {err}")
            yield url, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass(frozen=True)
class Target:
    """A proxy in front of the two servers: its URL, its pid (for CPU) and the model names."""

    name: str
    url: str
    pid: int
    model_default: str = "fixture"
    model_logprobs: str = "fixture"
    scale: float = 1.0  # request count factor


LITELLM_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}


@contextmanager
def litellm_process(
    tmp: Path, name: str, groups: dict[str, list[str]], callback: bool
) -> Iterator[tuple[str, int]]:
    """``litellm --config`` (one worker) in front of the servers; yields (url, pid)."""
    lines = ["model_list:"]
    for group, urls in groups.items():
        for u in urls:
            lines += [
                f"  - model_name: {group}",
                f"    litellm_params: {{model: openai/fixture, api_base: {u}/v1, api_key: none}}",
            ]
    if callback:
        lines += ["litellm_settings:", "  callbacks: specaudit.integrations.litellm.handler"]
    cfg = tmp / f"{name}.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    port = free_port()
    exe = Path(sys.executable).with_name("litellm")
    cmd = [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
    yield from _serving(cmd, port, LITELLM_ENV, health="/health/liveliness", within=120.0)


@dataclass
class Row:
    label: str
    conc: int
    stream: bool
    direct: list[Run]
    proxied: list[Run]
    target: str = "specaudit"

    def pooled(self, runs: list[Run]) -> list[float]:
        return [x for r in runs for x in r.latencies]

    def cpu_px(self) -> float:
        """The proxy's CPU microseconds per request."""
        n = len(self.pooled(self.proxied)) or 1
        return sum(r.proxy_cpu for r in self.proxied) / n * 1e6

    def line(self) -> str:
        d, p = self.pooled(self.direct), self.pooled(self.proxied)
        d50, d99, p50, p99 = pct(d, 50), pct(d, 99), pct(p, 50), pct(p, 99)
        drps = statistics.median(r.rps for r in self.direct)
        prps = statistics.median(r.rps for r in self.proxied)
        errs = sum(r.errors for r in self.direct + self.proxied)
        nd, np_ = len(d) or 1, len(p) or 1
        cpu_d = sum(r.cpu for r in self.direct) / nd * 1e6
        cpu_p = sum(r.cpu for r in self.proxied) / np_ * 1e6
        cpu_px = sum(r.proxy_cpu for r in self.proxied) / np_ * 1e6
        mode = "stream" if self.stream else "json"
        return (
            f"{self.target:10} {self.label:9} {mode:6} {self.conc:>4} "
            f"{d50 * 1e3:8.2f} {p50 * 1e3:8.2f} {(p50 - d50) * 1e3:+8.2f} "
            f"{d99 * 1e3:8.2f} {p99 * 1e3:8.2f} {(p99 - d99) * 1e3:+8.2f} "
            f"{drps:8.0f} {prps:8.0f} {prps / drps:6.3f} "
            f"{cpu_d:7.0f} {cpu_p:7.0f} {cpu_px:7.0f} {errs:4d}"
        )


HEADER = (
    f"{'target':10} {'route':9} {'mode':6} {'conc':>4} {'d p50':>8} {'p p50':>8} {'+p50':>8} "
    f"{'d p99':>8} {'p p99':>8} {'+p99':>8} {'d rps':>8} {'p rps':>8} {'ratio':>6} "
    f"{'d cpu':>7} {'p cpu':>7} {'px cpu':>7} {'err':>4}"
)
LEGEND = (
    "d = direct to the backend, p = through the proxy; latencies in ms (pooled over rounds),\n"
    "+p50/+p99 = added latency, rps = requests/s (median round), ratio = p rps / d rps,\n"
    "cpu = CPU microseconds per request of all processes on the path (client, [proxy,] server),\n"
    "px cpu = the proxy's share; when the machine is CPU-bound, ratio ~ d cpu / p cpu"
)


def bench(
    direct: LlamaServer,
    targets: list[Target],
    label: str,
    logprobs: bool,
    concs: list[int],
    rounds: int,
    scale: float,
    path: str,
    counts: dict[int, int] | None = None,
    prompt: str = PROMPT,
    max_tokens: int = MAX_TOKENS,
) -> list[Row]:
    """Each cell: direct and every target alternating, `rounds` times (one shared baseline
    per target: direct is measured next to each target with that target's request count)."""
    direct_url = direct.url
    assert direct.proc is not None
    spid = direct.proc.pid
    rows = []
    for stream in (False, True):
        for conc in concs:
            n0 = int((counts or COUNTS).get(conc, 800) * scale)
            for t in targets:
                n = max(conc * 2, int(n0 * t.scale))
                model = t.model_logprobs if logprobs else t.model_default
                payload = body(path, stream, logprobs, prompt, max_tokens)
                tpayload = body(path, stream, logprobs, prompt, max_tokens, model)
                row = Row(label, conc, stream, [], [], t.name)
                # warm both paths (connections, caches) before measuring
                warm = min(n, 64 if counts is None else conc)
                asyncio.run(load(direct_url, path, payload, warm, conc, stream))
                asyncio.run(load(t.url, path, tpayload, warm, conc, stream))
                for _ in range(rounds):
                    row.direct.append(
                        measured(direct_url, path, payload, n, conc, stream, spid, None)
                    )
                    row.proxied.append(
                        measured(t.url, path, tpayload, n, conc, stream, spid, t.pid)
                    )
                print(row.line(), flush=True)
                rows.append(row)
    return rows


def callback_cost(plain: str, spec: str, n: int = 2000) -> str:
    """CPU microseconds of the specaudit LiteLLM callback's own work per request, in-process:
    the deployment filter (roles known) and the check of a real logprobs response."""
    for k, v in LITELLM_ENV.items():
        os.environ.setdefault(k, v)
    import litellm
    from litellm import Router

    from specaudit.integrations.litellm import SpecauditRouting

    h = SpecauditRouting()
    saved = list(litellm.callbacks)
    litellm.callbacks = [h]
    deps = [
        {
            "model_name": "fx",
            "litellm_params": {"model": "openai/fixture", "api_base": u + "/v1", "api_key": "none"},
        }
        for u in (plain, spec)
    ]
    router = Router(model_list=deps)
    req: dict[str, Any] = {
        "messages": [{"role": "user", "content": PROMPT}],
        "logprobs": True,
        "top_logprobs": 2,
    }

    async def go() -> tuple[float, float]:
        resp = await router.acompletion(model="fx", max_tokens=MAX_TOKENS, **req)
        kw = {**req, "api_base": plain + "/v1"}
        c0 = time.process_time()
        for _ in range(n):
            await h.async_filter_deployments("fx", deps, req["messages"], req)
        c1 = time.process_time()
        for _ in range(n):
            await h.async_post_call_success_deployment_hook(kw, resp, None)
        c2 = time.process_time()
        h.close()
        return (c1 - c0) / n * 1e6, (c2 - c1) / n * 1e6

    try:
        f, c = asyncio.run(go())
    finally:
        litellm.callbacks = saved
    return (
        f"specaudit LiteLLM callback, in-process CPU per request: deployment filter {f:.0f} us, "
        f"check of an {MAX_TOKENS}-token chat response with logprobs {c:.0f} us"
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    ap.add_argument("--path", default="/v1/completions")
    ap.add_argument("--threads", type=int, default=1, help="decode threads per llama-server")
    ap.add_argument(
        "--gemma",
        action="store_true",
        help="also compare on Gemma 3 270M (a real model: slower requests)",
    )
    ap.add_argument("--no-litellm", action="store_true", help="leave out the LiteLLM rows")
    ap.add_argument(
        "--no-floor", action="store_true", help="leave out the relay and sa/asyncio rows"
    )
    ap.add_argument(
        "--baseline-src",
        metavar="DIR",
        help="also run the proxy of another checkout (its src/ directory) as `baseline`, "
        "e.g. a git worktree of an older commit, to compare before/after in one run",
    )
    ap.add_argument(
        "--litellm-scale", type=float, default=0.1, help="LiteLLM's share of the request count"
    )
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)  # clean up servers and proxy on SIGTERM too
    t0 = time.monotonic()
    print(
        f"specaudit proxy benchmark: {args.path}, prompt {PROMPT!r}, max_tokens {MAX_TOKENS}, "
        f"{args.rounds} rounds, {args.threads} decode thread(s) per server, "
        f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}"
    )
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        plain, spec = stack.enter_context(fixture_servers(tmp, args.threads))
        px_url, px_pid = stack.enter_context(proxy_process(plain.url, spec.url))
        targets = [Target("specaudit", px_url, px_pid)]
        if args.baseline_src:
            old = proxy_process(plain.url, spec.url, src=args.baseline_src)
            targets.append(Target("baseline", *stack.enter_context(old)))
        plain_targets = list(targets)
        if not args.no_floor:
            aio = stack.enter_context(proxy_process(plain.url, spec.url, ("--loop", "asyncio")))
            targets.append(Target("sa/asyncio", *aio))
            plain_targets.append(targets[-1])
            targets.append(Target("relay", *stack.enter_context(relay_process(spec.url))))
            plain_targets.append(Target("relay", *stack.enter_context(relay_process(plain.url))))
        if not args.no_litellm:
            groups = {"fx": [plain.url, spec.url]}
            lsa = stack.enter_context(litellm_process(tmp, "litellm-sa", groups, True))
            alone = {"fx-spec": [spec.url], "fx-plain": [plain.url]}
            lal = stack.enter_context(litellm_process(tmp, "litellm", alone, False))
            lite = [
                Target("litellm+sa", *lsa, "fx", "fx", args.litellm_scale),
                Target("litellm", *lal, "fx-spec", "fx-plain", args.litellm_scale),
            ]
            targets += lite
            plain_targets += lite
        print(LEGEND)
        print(HEADER)
        rows = bench(
            spec, targets, "default", False, [1, 16, 64], args.rounds, args.scale, args.path
        )
        rows += bench(
            plain, plain_targets, "logprobs", True, [16], args.rounds, args.scale, args.path
        )
        if not args.no_litellm:
            print(callback_cost(plain.url, spec.url), flush=True)
    if args.gemma:
        with gemma_servers() as (gplain, gspec), proxy_process(gplain.url, gspec.url) as gpx:
            rows += bench(
                gspec,
                [Target("specaudit", *gpx)],
                "gemma",
                False,
                [1, 4],
                1,
                args.scale,
                "/v1/chat/completions",
                counts={1: 8, 4: 16},
                prompt="Explain how a CPU branch predictor works.",
                max_tokens=16,
            )
    floor = {(r.label, r.stream, r.conc): r.cpu_px() for r in rows if r.target == "relay"}
    rows = [r for r in rows if r.target == "specaudit"]  # the goals are specaudit proxy's
    for stream, goal in ((False, 150), (True, 400)):
        mine = [r for r in rows if r.stream == stream and r.label == "default"]
        if mine:
            worst = max(mine, key=lambda r: r.cpu_px())
            relay = floor.get((worst.label, worst.stream, worst.conc))
            print(
                f"proxy CPU per {'8-token stream' if stream else 'JSON request'}: worst "
                f"{worst.cpu_px():.0f} us at concurrency {worst.conc} (goal <= {goal} us)"
                + (f"; the byte relay there: {relay:.0f} us" if relay is not None else "")
            )
    worst99 = max(pct(r.pooled(r.proxied), 99) - pct(r.pooled(r.direct), 99) for r in rows)
    worst_ratio = min(
        statistics.median(x.rps for x in r.proxied) / statistics.median(x.rps for x in r.direct)
        for r in rows
    )
    print(
        f"worst p99 overhead {worst99 * 1e3:+.2f} ms (goal <= 2 ms); worst throughput ratio "
        f"{worst_ratio:.3f} (goal >= 0.95); took {time.monotonic() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
