"""SIGTERM with a stream in flight ends it with an error event, and the proxy exits promptly.

What this guards against: `specaudit proxy` in front of a backend that hangs mid-stream; a client
opens a stream; `kill -TERM` the proxy. It took 10 s to exit, cut the stream without an error
event, and its final summary said "0 requests". Now it stops accepting, lets in-flight requests
finish for ``--shutdown-grace`` seconds, ends the streams still open with an SSE error event,
exits promptly and counts the requests it served.

The first test runs the real CLI as a process (its own process group, 127.0.0.1, free ports)
in front of the fakes from tests/fakes.py; the others drive the in-process proxy's `stop()`.
No llama-server is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from fakes import Fake, serve
from proxy_helpers import sse_objects
from specaudit.llama import free_port
from specaudit.proxy import Proxy, ProxyConfig, serve_in_thread

GRACE = 1.0
SLACK = 4.0  # start-up of nothing, the event loop's shutdown, a loaded machine
STREAM = {"prompt": "a", "max_tokens": 8, "stream": True}  # no logprobs: the spec backend


@contextlib.contextmanager
def hanging_backends() -> Iterator[tuple[str, str, Fake]]:
    """plain answers "ok"; spec (speculating) sends one event of a stream, then hangs."""
    hang = Fake("slow", delay=600, speculative=True)
    with serve(Fake("ok")) as plain, serve(hang) as spec:
        yield plain.url, spec.url, hang


def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        assert time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.1)


def read_first_event(chunks: Iterator[bytes]) -> bytes:
    got = b""
    while b"\n\n" not in got:
        got += next(chunks)
    return got


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_ends_an_open_stream_with_an_error_event_and_exits_promptly() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with hanging_backends() as (plain, spec, _):
        proc = subprocess.Popen(
            [
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
                "--shutdown-grace",
                str(GRACE),
                "--check-interval",
                "3600",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: nothing of it may outlive it
        )
        try:
            wait_up(url, proc)
            body = b""
            with (
                httpx.Client(timeout=httpx.Timeout(30)) as c,
                c.stream("POST", url + "/v1/completions", json=STREAM) as r,
            ):
                assert r.status_code == 200
                chunks = r.iter_raw()
                body = read_first_event(chunks)  # the stream is open, the backend hangs
                os.kill(proc.pid, signal.SIGTERM)
                t0 = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    for chunk in chunks:
                        body += chunk
            out, err = proc.communicate(timeout=GRACE + SLACK + 30)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stdout, stderr = out.decode(), err.decode()
    assert proc.returncode == 0, stderr[-2000:]
    assert took <= GRACE + SLACK, f"took {took:.1f}s to exit after SIGTERM"
    objs = sse_objects(body)  # whole events only: the stream was not torn
    assert len(objs) == 2, body
    assert objs[0]["choices"][0]["text"] == "a"
    error = objs[-1]["error"]
    assert isinstance(error, dict)
    assert error["code"] == 503 and error["type"] == "unavailable_error"
    assert "shutting down" in error["message"]
    m = re.search(r"stopped after \S+: (\d+) requests", stdout + stderr)  # on stderr
    assert m, stdout + stderr
    assert int(m[1]) >= 1, m[0]
    assert group_gone(proc.pid)


# --------------------------------------------------------------------- in-process stop()


def _post_in_thread(url: str, body: dict[str, object]) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []

    def go() -> None:
        try:
            result.append(httpx.post(url, json=body, timeout=30))
        except httpx.HTTPError as e:
            result.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, result


def test_a_request_that_finishes_within_the_grace_period_is_served() -> None:
    slow = Fake("slow", delay=0.5, speculative=True)
    with serve(Fake("ok")) as plain, serve(slow) as spec:
        with serve_in_thread(
            ProxyConfig(plain.url, spec.url, port=0, check_interval=3600, shutdown_grace=10)
        ) as p:
            t, result = _post_in_thread(p.url + "/v1/completions", {"prompt": "a"})
            deadline = time.monotonic() + 10
            while not any(h.path == "/v1/completions" for h in slow.hits):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            t0 = time.monotonic()
        took = time.monotonic() - t0  # stop() waited for it, not for the whole grace
        t.join(30)
    (r,) = result
    assert isinstance(r, httpx.Response) and r.status_code == 200, r
    assert r.json()["choices"][0]["text"] == "late"
    assert took < 10 - 1, took


@pytest.mark.parametrize("stream", [False, True])
def test_requests_still_running_after_the_grace_period_end_with_503(stream: bool) -> None:
    slow = Fake("slow", delay=600, speculative=True)
    with serve(Fake("ok")) as plain, serve(slow) as spec:
        rp = serve_in_thread(
            ProxyConfig(plain.url, spec.url, port=0, check_interval=3600, shutdown_grace=GRACE)
        )
        p = rp.__enter__()
        try:
            t, result = _post_in_thread(
                p.url + "/v1/completions", {"prompt": "a", "stream": stream}
            )
            deadline = time.monotonic() + 10
            while not any(h.path == "/v1/completions" for h in slow.hits):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.2)  # the stream's first event is out
        finally:
            t0 = time.monotonic()
            stats_fut = asyncio.run_coroutine_threadsafe(_stop(p.proxy), p.loop)
            stats_fut.result(GRACE + SLACK + 30)
            took = time.monotonic() - t0
            rp.__exit__(None, None, None)
        t.join(30)
    assert took <= GRACE + SLACK, took
    (r,) = result
    assert isinstance(r, httpx.Response), r
    if stream:
        assert r.status_code == 200
        objs = sse_objects(r.content)
        assert [set(o) for o in objs] == [{"choices"}, {"error"}], objs
        err = objs[-1]["error"]
    else:
        assert r.status_code == 503
        err = r.json()["error"]
    assert isinstance(err, dict) and err["code"] == 503 and "shutting down" in err["message"]
    stats = p.proxy.stats()
    assert stats.requests == 1 and stats.errors.get("shutdown") == 1, stats


async def _stop(proxy: Proxy) -> None:
    await proxy.stop()
