"""Running the proxy: in the foreground until a signal (`run`), or in a background thread for
callers that are not async themselves (`serve_in_thread`: the audit, tests, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from specaudit.proxy.accounting import ProxyStats
from specaudit.proxy.config import ProxyConfig, ProxyError
from specaudit.proxy.lifecycle import Proxy

LOOPS = ("auto", "uvloop", "asyncio")


def new_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """The proxy's event loop: uvloop when installed (``auto``), else asyncio's own.

    Why uvloop: on the forwarding core (`forwarding`) the loop's own work is a large share of the
    proxy's CPU per request; benchmarks/bench_proxy_loop.py measures both side by side.
    """
    if kind not in LOOPS:
        raise ProxyError(f"event loop must be one of {', '.join(LOOPS)}, got {kind!r}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ProxyError("--loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(
    config: ProxyConfig,
    on_ready: Callable[[Proxy], None] | None = None,
    stop: asyncio.Event | None = None,
    loop: str = "auto",
) -> ProxyStats:
    """Serve until SIGINT/SIGTERM (or `stop` is set); return what the proxy did.

    The first signal stops gracefully (`Proxy.stop`: in-flight requests get up to
    ``config.shutdown_grace`` seconds); a second one ends the grace period at once.
    Raises `ProxyError` when it cannot start (plain backend speculates, port taken, ...).
    """

    async def main() -> ProxyStats:
        done = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        proxy = Proxy(config)

        def on_signal() -> None:
            if done.is_set():
                proxy.hurry()
            else:
                done.set()

        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, on_signal)
                installed.append(sig)
        try:
            await proxy.start()
            if on_ready is not None:
                on_ready(proxy)
            await done.wait()
        finally:
            try:
                await proxy.stop()
            finally:
                for sig in installed:
                    loop.remove_signal_handler(sig)
        # after stop: requests still in flight at the signal are counted once they end (the
        # snapshot used to be taken before, and a proxy stopped mid-stream said "0 requests")
        return proxy.stats()

    with asyncio.Runner(loop_factory=lambda: new_loop(loop)) as runner:
        return runner.run(main())


@dataclass
class RunningProxy:
    """A proxy serving from a background thread."""

    proxy: Proxy
    loop: asyncio.AbstractEventLoop

    @property
    def url(self) -> str:
        return self.proxy.url

    def stats(self) -> ProxyStats:
        return asyncio.run_coroutine_threadsafe(_stats(self.proxy), self.loop).result(10)

    def check_backends(self) -> None:
        """Run the role checks now (instead of waiting for the next periodic one)."""
        asyncio.run_coroutine_threadsafe(self.proxy.check_backends(), self.loop).result(60)


async def _stats(p: Proxy) -> ProxyStats:
    return p.stats()


@contextlib.contextmanager
def serve_in_thread(config: ProxyConfig, loop_kind: str = "auto") -> Iterator[RunningProxy]:
    """``with serve_in_thread(cfg) as rp: rp.url`` — started (roles checked) on entry."""
    loop = new_loop(loop_kind)
    thread = threading.Thread(target=loop.run_forever, name="specaudit-proxy", daemon=True)
    thread.start()
    proxy = Proxy(config)
    try:
        asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(120)
        try:
            yield RunningProxy(proxy, loop)
        finally:
            asyncio.run_coroutine_threadsafe(proxy.stop(), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
