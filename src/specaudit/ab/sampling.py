"""`specaudit.ab`'s sampling: the same prompt and seeds sent to a plain and a speculating
server concurrently (`run`), or to two llama-servers `ab` starts itself (`run_local`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specaudit import speculation, validate
from specaudit.ab.analysis import (
    SIDES,
    ABError,
    ABResult,
    Response,
    Settings,
    analyse,
    parse_response,
)
from specaudit.ab.render import draw
from specaudit.client import ENDPOINTS, AsyncClient
from specaudit.llama import presets
from specaudit.llama.presets import uses_draft

if TYPE_CHECKING:
    from specaudit.llama.build import LlamaBinaries

DEFAULT_SPEC_TYPE = presets.DEFAULT_SPEC_TYPE

# The /slots and /props probe answers at once on any server: a server that accepts the
# connection and says nothing for this long (or --timeout, if shorter) is not going to.
PROBE_TIMEOUT = 30.0

ProgressFn = Callable[[int, int], None]
"""Called with (responses done, responses total) as samples come back."""


async def _server_info(client: AsyncClient) -> tuple[int, bool | None]:
    """(parallel slots, speculates?) as `specaudit.speculation` reads /slots and /props.

    Also the reachability check: a server that cannot be reached fails here, once, with one
    line, before any sampling starts.
    """
    info = await speculation.aread(client)
    return info.parallel, info.speculates


def _first_error(eg: BaseExceptionGroup) -> BaseException:
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            return _first_error(e)
        return e
    return eg


async def _collect(
    settings: Settings,
    urls: dict[str, str],
    progress: ProgressFn | None,
    timeout: float,
) -> tuple[list[Response], dict[str, tuple[int, bool | None]]]:
    distinct = sorted(set(urls.values()))
    per_url: dict[str, tuple[int, bool | None]] = {}
    for u in distinct:
        async with AsyncClient(u, timeout=min(timeout, PROBE_TIMEOUT)) as probe:
            per_url[u] = await _server_info(probe)
    clients = {u: AsyncClient(u, timeout=timeout) for u in distinct}
    try:
        # One semaphore per server: when both sides are the same URL they share its slots.
        sems = {u: asyncio.Semaphore(per_url[u][0]) for u in distinct}
        path = ENDPOINTS[settings.endpoint]
        total = len(SIDES) * settings.seeds
        done = 0
        if progress:
            progress(0, total)

        async def one(side: str, seed: int) -> Response:
            nonlocal done
            url = urls[side]
            async with sems[url]:
                body = await clients[url].post(path, settings.request(seed))
            resp = parse_response(side, seed, settings.endpoint, body, settings.top_logprobs)
            done += 1
            if progress:
                progress(done, total)
            return resp

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(one(side, seed))
                    for seed in settings.seed_values
                    for side in SIDES
                ]
        except BaseExceptionGroup as eg:
            raise _first_error(eg) from None
        responses = [t.result() for t in tasks]
    finally:
        for c in clients.values():
            await c.aclose()
    return responses, {side: per_url[urls[side]] for side in SIDES}


def check_timeout(timeout: float) -> float:
    return validate.number(
        timeout, "--timeout", min=0, min_open=True, max=validate.MAX_TIMEOUT, error=ABError
    )


def run(
    plain_url: str,
    spec_url: str,
    settings: Settings | None = None,
    *,
    plot: str | Path | None = None,
    progress: ProgressFn | None = None,
    timeout: float = 600.0,
    local: dict[str, Any] | None = None,
) -> ABResult:
    """Sample `settings.seeds` seeds from both servers concurrently and compare them.

    Seeds go out concurrently, up to each server's parallel slots (from /slots). A plot is
    written to `plot` if given; its directory is checked writable before any request. Every
    request gives up after `timeout` seconds, the /slots probe after at most
    `PROBE_TIMEOUT`: a server that accepts connections and never answers is a one-line
    `ClientError`, not a hang.
    """
    settings = settings or Settings()
    urls = {
        "plain": validate.url(plain_url, "--plain", ABError),
        "spec": validate.url(spec_url, "--spec", ABError),
    }
    check_timeout(timeout)
    if plot is not None:
        validate.writable_file(plot, "--plot", ABError)
    t0 = time.monotonic()
    responses, info = asyncio.run(_collect(settings, urls, progress, timeout))
    result = analyse(settings, responses, urls, info, time.monotonic() - t0, local)
    if plot is not None:
        result.plot = draw(result, plot)
    return result


def run_local(
    settings: Settings | None = None,
    *,
    binaries: LlamaBinaries | None = None,
    model: str | Path | None = None,
    draft: str | Path | None = None,
    spec_type: str = DEFAULT_SPEC_TYPE,
    parallel: int | None = None,
    log_dir: str | Path | None = None,
    plot: str | Path | None = None,
    progress: ProgressFn | None = None,
    status: Callable[[str], None] | None = None,
    timeout: float = 600.0,
) -> ABResult:
    """Start a plain and a speculating llama-server from one model, then `run` on them.

    Defaults: Gemma 3 270M as its own draft with draft-simple, the report's setup. Both
    servers bind 127.0.0.1 on free ports and are always stopped.
    """
    from specaudit import llama
    from specaudit.models import gemma_270m

    settings = settings or Settings()
    say = status or (lambda msg: None)
    if not spec_type or spec_type == "none":
        raise ABError("--spec-type must name a speculative decoding type (e.g. draft-simple)")
    validate.text(spec_type, "--spec-type", error=ABError)
    check_timeout(timeout)
    if plot is not None:
        validate.writable_file(plot, "--plot", ABError)
    if log_dir is not None:
        validate.writable_dir(log_dir, "--log-dir", error=ABError)
    if binaries is None:
        say("finding llama.cpp binaries")
        binaries = llama.ensure()
    model_path = Path(model) if model is not None else gemma_270m().path
    draft_path = (
        Path(draft) if draft is not None else (model_path if uses_draft(spec_type) else None)
    )
    for what, p in (("model", model_path), ("draft", draft_path)):
        if p is not None and not p.is_file():
            raise ABError(f"{what} file not found: {p}")
    n_par = parallel or min(settings.seeds, 4)
    # Each slot gets ctx/np tokens: room for the prompt (plus a chat template) and the answer.
    per_slot = settings.tokens + max(256, len(settings.prompt.encode()) + 128)
    ctx_per_slot = -(-per_slot // 256) * 256
    ctx_size = n_par * ctx_per_slot
    logs = Path(log_dir) if log_dir is not None else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    local = {
        "model": str(model_path),
        "draft": str(draft_path) if draft_path else None,
        "spec_type": spec_type,
        "parallel": n_par,
        "ctx_size": ctx_size,
        "binaries": str(binaries.bin_dir),
    }
    with contextlib.ExitStack() as stack:
        servers = {}
        for side in SIDES:
            say(f"starting the {side} llama-server")
            srv = presets.server(
                binaries,
                model_path,
                kind="gemma",
                draft=draft_path if side == "spec" else None,
                spec_type=spec_type if side == "spec" else None,
                parallel=n_par,
                ctx_per_slot=ctx_per_slot,
                log_path=logs / f"ab-{side}.log" if logs is not None else None,
                name=f"ab-{side}",
            )
            servers[side] = stack.enter_context(srv)
        say("sampling")
        return run(
            servers["plain"].url,
            servers["spec"].url,
            settings,
            plot=plot,
            progress=progress,
            timeout=timeout,
            local=local,
        )


__all__ = [
    "DEFAULT_SPEC_TYPE",
    "PROBE_TIMEOUT",
    "ProgressFn",
    "check_timeout",
    "run",
    "run_local",
    "uses_draft",
]
