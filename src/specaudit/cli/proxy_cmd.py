"""`specaudit proxy --plain URL --spec URL`: the logprobs-aware router, in the foreground."""

from __future__ import annotations

import logging
import os
import sys

import click

from specaudit.cli.common import console, emit_json, json_option
from specaudit.outcome import EXIT_CODES_HELP

EPILOG = (
    "\b\nRouting: a request with logprobs: true, top_logprobs > 0 or n_probs > 0 goes to\n"
    "--plain; every other request to --spec. Endpoints: /v1/chat/completions,\n"
    "/v1/completions, /v1/models, /completion; the proxy's own /health and /metrics.\n"
    "Responses carry X-Specaudit-Backend; checked ones X-Specaudit-Placeholders.\n"
    "\b\nBackends started with --api-key: set SPECAUDIT_PLAIN_API_KEY / SPECAUDIT_SPEC_API_KEY\n"
    "for the proxy's own /slots checks (clients' Authorization headers are forwarded).\n\n"
    + EXIT_CODES_HELP.replace(
        "  0  OK: nothing found (every logprob real, distribution preserved, ...)",
        "  0  stopped cleanly (SIGINT or SIGTERM; in-flight requests get --shutdown-grace)",
    )
    .replace("  1  finding: placeholders found, distribution broken, instrument fault, ...\n", "")
    .replace(
        "  2  no decision: bad input, unreachable or non-LLM server, failed build",
        "  2  could not start: the plain backend speculates, port taken, bad URL",
    )
)


@click.command("proxy", epilog=EPILOG)
@click.option(
    "--plain",
    "plain",
    required=True,
    metavar="URL",
    help="llama-server started WITHOUT speculation: serves every logprobs request.",
)
@click.option(
    "--spec",
    "spec",
    required=True,
    metavar="URL",
    help="Speculating llama-server: serves every other request.",
)
@click.option(
    "--listen",
    default="127.0.0.1:8081",
    show_default=True,
    metavar="HOST:PORT",
    help="Where to listen (port 0: any free port).",
)
@click.option(
    "--on-plain-down",
    type=click.Choice(["error", "annotate"]),
    default="error",
    show_default=True,
    help="Logprobs request while plain is down or unfit: 503, or serve it from --spec "
    "with placeholders rewritten to logprob null.",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(min=1),
    default=4 * 1024 * 1024,
    show_default=True,
    help="Largest request body accepted (413 above).",
)
@click.option(
    "--connect-timeout",
    type=click.FloatRange(min=0.001),
    default=5.0,
    show_default=True,
    help="Seconds to connect to a backend.",
)
@click.option(
    "--read-timeout",
    type=click.FloatRange(min=0.001),
    default=600.0,
    show_default=True,
    help="Longest silence from a backend, in seconds, before 504 (or an error event).",
)
@click.option(
    "--client-timeout",
    type=click.FloatRange(min=0.001),
    default=30.0,
    show_default=True,
    help="Seconds a client has to send a whole request, headers and body, from its first "
    "byte (a new connection: from connecting); then 408 and the connection is closed.",
)
@click.option(
    "--max-incomplete-requests",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Connections that may be sending a request at once; one more pushes out the one "
    "sending longest (408).",
)
@click.option(
    "--shutdown-grace",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="On SIGTERM/SIGINT: seconds in-flight requests may still run; then streams end with "
    "an error event, other requests get 503. A second signal ends it at once.",
)
@click.option(
    "--check-interval",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Seconds between /slots role checks.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="Access and state logs, on stderr.",
)
@click.option(
    "--loop",
    "loop_kind",
    type=click.Choice(["auto", "uvloop", "asyncio"]),
    default="auto",
    show_default=True,
    help="Event loop: uvloop when installed (auto), or asyncio's own.",
)
@json_option
def command(
    plain: str,
    spec: str,
    listen: str,
    on_plain_down: str,
    max_body_bytes: int,
    connect_timeout: float,
    read_timeout: float,
    client_timeout: float,
    max_incomplete_requests: int,
    shutdown_grace: float,
    check_interval: float,
    log_level: str,
    loop_kind: str,
    as_json: bool,
) -> None:
    """Route logprobs requests to a plain llama-server and the rest to a speculating one.

    A speculating llama-server returns placeholder logprobs (0.0, no candidates). This
    OpenAI-compatible proxy sends requests that ask for logprobs to --plain, checks every
    returned token, and sends everything else to --spec for speed. It refuses to start if
    --plain speculates (read from /slots) and re-checks both backends periodically.
    """
    from specaudit.proxy import Proxy, ProxyConfig, parse_listen, run

    host, port = parse_listen(listen)
    config = ProxyConfig(
        plain=plain,
        spec=spec,
        host=host,
        port=port,
        on_plain_down=on_plain_down,  # type: ignore[arg-type]
        max_body_bytes=max_body_bytes,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        client_timeout=client_timeout,
        max_incomplete_requests=max_incomplete_requests,
        shutdown_grace=shutdown_grace,
        check_interval=check_interval,
        plain_api_key=os.environ.get("SPECAUDIT_PLAIN_API_KEY") or None,
        spec_api_key=os.environ.get("SPECAUDIT_SPEC_API_KEY") or None,
    )

    def ready(p: Proxy) -> None:
        if as_json:
            emit_json({"event": "listening", "url": p.url, **p.stats().__dict__})
        else:
            console.print(f"[bold]specaudit proxy[/] listening on {p.url}", highlight=False)
            for b in p.backends.values():
                console.print(
                    f"  {b.role:5} {b.url}  {b.state.value}: {b.detail}"
                    + (f"  [yellow]warning: {b.warning}[/]" if b.warning else ""),
                    highlight=False,
                )
        sys.stdout.flush()

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = logging.getLogger("specaudit.proxy")
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(log_level.upper())
    logger.propagate = False
    try:
        stats = run(config, on_ready=ready, loop=loop_kind)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
    if as_json:
        emit_json({"event": "stopped", **stats.__dict__})
    else:
        console.print(
            f"stopped after {stats.uptime_s:.0f}s: {stats.requests} requests "
            f"({', '.join(f'{k} {v}' for k, v in stats.requests_by_route.items()) or 'none'}), "
            f"placeholders caught {sum(stats.placeholders_caught.values())}",
            highlight=False,
        )
