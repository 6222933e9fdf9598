"""Does uvloop lower `specaudit proxy`'s CPU per request? Two proxy processes (``--loop
asyncio`` and ``--loop uvloop``, the default when installed) in front of the same fixture
servers, alternating rounds, CPU read from /proc. benchmarks/bench_proxy.py measures the same
pair (its ``specaudit`` and ``sa/asyncio`` rows) next to a direct connection.

    .venv/bin/python benchmarks/bench_proxy_loop.py [--rounds 4]

Result and reading: docs/proxy.md (Benchmark, "uvloop, re-measured").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from specaudit import audit
from specaudit.llama.server import free_port

N = 400  # requests per round and mode
CONC = 4


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def load(url: str, stream: bool, n: int = N, conc: int = CONC) -> None:
    body = {"prompt": "abcab", "max_tokens": 8, "stream": stream, "temperature": 1.0}
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=conc, force_close=stream)
    async with aiohttp.ClientSession(connector=connector) as s:
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                async with s.post(url + "/v1/completions", data=payload, headers=headers) as r:
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(conc)))


def start_proxy(plain: str, spec: str, uv: bool) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    code = "from specaudit.cli import main; main()"
    argv = [sys.executable, "-c", code, "proxy", "--plain", plain, "--spec", spec]
    argv += ["--listen", f"127.0.0.1:{port}", "--log-level", "warning"]
    argv += ["--loop", "uvloop" if uv else "asyncio"]
    p = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return p, url


def main() -> None:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        sys.exit("needs uvloop (a dependency of specaudit on Linux and macOS)")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    with audit.AuditContext(Path(tempfile.mkdtemp())) as ctx:
        plain, spec = ctx.server("fixture-plain").url, ctx.server("fixture-spec").url
        procs = {uv: start_proxy(plain, spec, uv) for uv in (False, True)}
        try:
            res: dict[tuple[bool, bool], list[float]] = {
                (uv, st): [] for uv in (False, True) for st in (False, True)
            }
            for uv in (False, True):
                for st in (False, True):
                    asyncio.run(load(procs[uv][1], st, 100))  # warm
            for _ in range(args.rounds):
                for st in (False, True):
                    for uv in (False, True):
                        p, url = procs[uv]
                        c0 = cpu_seconds(p.pid)
                        asyncio.run(load(url, st))
                        res[(uv, st)].append((cpu_seconds(p.pid) - c0) / N * 1e6)
            for (uv, st), xs in res.items():
                loop, mode = "uvloop " if uv else "asyncio", "stream" if st else "json  "
                rounds = [round(x) for x in xs]
                print(f"{loop} {mode} proxy CPU us/request per round {rounds}, "
                      f"median {statistics.median(xs):.0f}")  # fmt: skip
        finally:
            for p, _ in procs.values():
                p.terminate()
                p.wait(10)
    print(f"load avg {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
