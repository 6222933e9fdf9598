"""Which HTTP stack for `specaudit proxy`? The same minimal pass-through proxy (forward the
body, relay the response or the SSE stream chunk by chunk) written on each candidate stack,
measured in front of the same fixture llama-server against a direct connection.

    .venv/bin/python benchmarks/bench_proxy_stack.py [--rounds 3] [--scale 1.0]

Candidates (each runs as its own process; each round measures the direct connection and every
candidate back to back, so load from other work on the machine hits them alike):
- aiohttp: aiohttp server + aiohttp client (what specaudit proxy uses);
- aiohttp+httpx: aiohttp server + httpx client (isolates the client's share);
- starlette/uvicorn/httpx: Starlette on uvicorn (h11, the pure-Python parser a plain
  ``pip install uvicorn`` gets) + httpx;
- starlette/uvicorn[std]/httpx: the same on uvicorn with httptools and uvloop, if installed.

Needs starlette and uvicorn (the dev extra installs them); httptools/uvloop are optional.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_proxy import Run, body, fixture_servers, load, pct  # noqa: E402
from specaudit.llama import free_port  # noqa: E402
from specaudit.llama.process import pdeathsig  # noqa: E402

STACKS = ["aiohttp", "aiohttp+httpx", "starlette/uvicorn/httpx", "starlette/uvicorn[std]/httpx"]
COUNTS = {1: 300, 16: 1000}


# ------------------------------------------------------------------ the candidate proxies


def serve_aiohttp(port: int, target: str, client: str) -> None:
    from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

    async def main() -> None:
        pooled = ClientSession(connector=TCPConnector(limit=256), auto_decompress=False)
        fresh = ClientSession(
            connector=TCPConnector(limit=256, force_close=True), auto_decompress=False
        )
        hx = httpx.AsyncClient(limits=httpx.Limits(max_connections=256), timeout=600)
        timeout = ClientTimeout(total=None, sock_read=600)

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            data = await request.read()
            stream = b'"stream": true' in data
            headers = {"Content-Type": "application/json"}
            if client == "httpx":
                if stream:
                    req = hx.build_request(
                        "POST",
                        target + request.path,
                        content=data,
                        headers={**headers, "Connection": "close"},
                    )
                    r = await hx.send(req, stream=True)
                    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                    await out.prepare(request)
                    async for chunk in r.aiter_raw():
                        await out.write(chunk)
                    await r.aclose()
                    await out.write_eof()
                    return out
                r2 = await hx.post(target + request.path, content=data, headers=headers)
                return web.Response(
                    body=r2.content, status=r2.status_code, content_type="application/json"
                )
            session = fresh if stream else pooled
            async with session.post(
                target + request.path, data=data, headers=headers, timeout=timeout
            ) as r3:
                if stream:
                    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                    await out.prepare(request)
                    async for chunk in r3.content.iter_any():
                        await out.write(chunk)
                    await out.write_eof()
                    return out
                return web.Response(
                    body=await r3.read(), status=r3.status, content_type="application/json"
                )

        server = web.Server(handle, handler_cancellation=True, access_log=None)
        await asyncio.get_running_loop().create_server(server, "127.0.0.1", port, backlog=1024)
        await asyncio.Event().wait()

    asyncio.run(main())


def serve_starlette(port: int, target: str, std: bool) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    hx = httpx.AsyncClient(limits=httpx.Limits(max_connections=256), timeout=600)

    async def handle(request: Request) -> Response:
        data = await request.body()
        stream = b'"stream": true' in data
        headers = {"Content-Type": "application/json"}
        if stream:
            req = hx.build_request(
                "POST",
                target + request.url.path,
                content=data,
                headers={**headers, "Connection": "close"},
            )
            r = await hx.send(req, stream=True)

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in r.aiter_raw():
                        yield chunk
                finally:
                    await r.aclose()

            return StreamingResponse(relay(), media_type="text/event-stream")
        r2 = await hx.post(target + request.url.path, content=data, headers=headers)
        return Response(r2.content, status_code=r2.status_code, media_type="application/json")

    paths = ["/v1/completions", "/v1/chat/completions", "/completion"]
    app = Starlette(routes=[Route(p, handle, methods=["POST"]) for p in paths])
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        http="httptools" if std else "h11",
        loop="uvloop" if std else "asyncio",
        backlog=1024,
    )


def available(stack: str) -> str | None:
    """None if the stack can run here, else why not."""
    need = {
        "starlette/uvicorn/httpx": ["starlette", "uvicorn"],
        "starlette/uvicorn[std]/httpx": ["starlette", "uvicorn", "httptools", "uvloop"],
    }
    missing = [m for m in need.get(stack, []) if importlib.util.find_spec(m) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


@contextmanager
def stack_process(stack: str, target: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", stack, "--port", str(port), "--target", target],
        stderr=subprocess.PIPE,
        preexec_fn=pdeathsig,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                assert proc.stderr is not None  # stderr=PIPE
                raise RuntimeError(f"{stack} exited: {proc.stderr.read().decode()[-300:]}")
            try:
                httpx.post(url + "/completion", json={"prompt": "a", "n_predict": 1}, timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{stack} did not come up") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------ measuring


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        if args.serve.startswith("aiohttp"):
            serve_aiohttp(args.port, args.target, "httpx" if "httpx" in args.serve else "aiohttp")
        else:
            serve_starlette(args.port, args.target, std="[std]" in args.serve)
        return
    t0 = time.monotonic()
    path = "/v1/completions"
    print(
        f"HTTP stack benchmark: pass-through proxy in front of a fixture llama-server, {path}, "
        f"{args.rounds} rounds, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}"
    )
    stacks = []
    for stack in STACKS:
        why = available(stack)
        if why:
            print(f"{stack}: skipped ({why})")
        else:
            stacks.append(stack)
    print(
        f"{'stack':30} {'mode':6} {'conc':>4} {'d p50':>7} {'+p50':>7} {'d p99':>7} "
        f"{'+p99':>8} {'d rps':>7} {'p rps':>7} {'ratio':>6}"
    )
    with (
        tempfile.TemporaryDirectory() as tmp,
        fixture_servers(Path(tmp)) as (_, spec),
        contextlib.ExitStack() as es,
    ):
        urls = {st: es.enter_context(stack_process(st, spec.url)) for st in stacks}
        for stream in (False, True):
            payload = body(path, stream, False)
            for conc in (1, 16):
                n = int(COUNTS[conc] * args.scale)
                for url in [spec.url, *urls.values()]:
                    asyncio.run(load(url, path, payload, 64, conc, stream))  # warm up
                # every round measures direct and each stack back to back, so drift in the
                # machine's load hits all of them alike
                runs: dict[str, list[Run]] = {k: [] for k in ["direct", *stacks]}
                for _ in range(args.rounds):
                    runs["direct"].append(
                        asyncio.run(load(spec.url, path, payload, n, conc, stream))
                    )
                    for st in stacks:
                        runs[st].append(asyncio.run(load(urls[st], path, payload, n, conc, stream)))
                dl = [x for r in runs["direct"] for x in r.latencies]
                drps = statistics.median(r.rps for r in runs["direct"])
                for st in stacks:
                    pl = [x for r in runs[st] for x in r.latencies]
                    prps = statistics.median(r.rps for r in runs[st])
                    errs = sum(r.errors for r in runs["direct"] + runs[st])
                    print(
                        f"{st:30} {'stream' if stream else 'json':6} {conc:>4} "
                        f"{pct(dl, 50) * 1e3:7.2f} {(pct(pl, 50) - pct(dl, 50)) * 1e3:+7.2f} "
                        f"{pct(dl, 99) * 1e3:7.2f} {(pct(pl, 99) - pct(dl, 99)) * 1e3:+8.2f} "
                        f"{drps:7.0f} {prps:7.0f} {prps / drps:6.3f}"
                        + (f"  errors {errs}" if errs else ""),
                        flush=True,
                    )
    print(
        f"took {time.monotonic() - t0:.0f} s; ms, d = direct (same runs for every stack), "
        "+p = added by the proxy"
    )


if __name__ == "__main__":
    main()
