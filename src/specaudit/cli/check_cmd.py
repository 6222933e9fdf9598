"""`specaudit check URL [URL...] [--litellm-config FILE]`: are a running server's logprobs real,
and does it speculate? One URL: the per-endpoint report; several (or a LiteLLM config): one
row per deployment (`specaudit.check.fleet`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

# specaudit.check is light (no numpy/scipy): its defaults and choices feed the options below.
from specaudit.check import DEFAULT_PROMPT, ENDPOINT_GROUPS
from specaudit.cli.common import (
    API_KEY,
    TEXT,
    URL,
    SafePath,
    emit_json,
    json_option,
    out,
    prompt_option,
    seed_option,
    temperature_option,
    timeout_option,
    tokens_option,
    top_k_option,
)
from specaudit.outcome import EXIT_TAIL_HELP

if TYPE_CHECKING:
    from pathlib import Path

    from specaudit.check import CheckResult
    from specaudit.check.fleet import FleetResult

CHECK_EXIT_HELP = (
    "\b\nExit codes:\n"
    "  0  every logprob is real (candidates came back for every token)\n"
    "  1  placeholders found: k candidates requested, none returned; with --reference,\n"
    "     also real but wrong logprobs (numbers that are not the reference's)\n"
    "  2  no decision: unreachable server, HTTP errors, non-JSON answers, not an LLM\n"
    "     server, no logprobs at all, or bad options\n"
    "  Several deployments: 1 if any returns placeholders, else 2 if any gave no decision.\n"
    + EXIT_TAIL_HELP
)


@click.command("check", epilog=CHECK_EXIT_HELP)
@click.argument("urls", metavar="URL...", nargs=-1, type=URL)
@click.option(
    "--litellm-config",
    type=SafePath(exists=True, dir_okay=False),
    default=None,
    help="Check every deployment (litellm_params.api_base) of this LiteLLM config.yaml.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="Deployments checked at once (several URLs or --litellm-config).",
)
@top_k_option()
@tokens_option(default=24, min_value=2, help="Tokens to generate per request.")
@click.option(
    "--endpoint",
    type=click.Choice(list(ENDPOINT_GROUPS)),
    default="all",
    show_default=True,
    help="chat = /v1/chat/completions; completion = /v1/completions and native /completion "
    "(n_probs, with and without post_sampling_probs); completions / native = one of those.",
)
@prompt_option(
    default=DEFAULT_PROMPT,
    help="Prompt (chat: the user message). Must be text the model can tokenize.",
)
@seed_option()
@temperature_option()
@click.option(
    "--stream/--no-stream",
    default=None,
    help="Only streamed (SSE) / only non-streamed requests. Default: both.",
)
@click.option(
    "--model", type=TEXT, default=None, help="'model' field for servers that require one."
)
@click.option(
    "--api-key", type=API_KEY, envvar="SPECAUDIT_API_KEY", default=None, help="Bearer token."
)
@timeout_option(default=120.0)
@click.option(
    "--summary", is_flag=True, help="Leave out the per-token tables; counts and verdict only."
)
@click.option(
    "--reference",
    type=URL,
    default=None,
    metavar="URL",
    help="A plain llama-server of the same model: classify every /completion token real and "
    "correct, real but wrong, placeholder or missing against it (docs/fidelity.md).",
)
@json_option
def command(
    urls: tuple[str, ...],
    litellm_config: Path | None,
    concurrency: int,
    top_k: int,
    tokens: int,
    endpoint: str,
    prompt: str,
    seed: int,
    temperature: float,
    stream: bool | None,
    model: str | None,
    api_key: str | None,
    timeout: float,
    summary: bool,
    reference: str | None,
    as_json: bool,
) -> None:
    """Check whether the logprobs a server at URL returns are real.

    Several URLs, or --litellm-config FILE, check a fleet: every deployment concurrently, one
    table (deployment, speculates per /slots and /props, placeholders, exit).

    Asks for TOP_K candidates per token on each endpoint, non-streamed and streamed, and
    classifies every token: real (candidates came back) or placeholder (none came back: a
    speculating llama-server sends logprob 0.0 / prob 1.0, or in streams no entry at all).
    A logprob of exactly 0 with candidates is real. Reads /slots and /props to say whether
    the server speculates, shows timings.draft_n, and tests the per-request
    "speculative.n_max": 0 switch.
    """
    from specaudit import check

    kwargs: dict[str, Any] = dict(
        top_k=top_k,
        tokens=tokens,
        endpoint=endpoint,
        prompt=prompt,
        seed=seed,
        temperature=temperature,
        stream=stream,
        model=model,
        timeout=timeout,
    )
    if not urls and litellm_config is None:
        raise click.UsageError("Missing argument 'URL' (one or more, or --litellm-config FILE).")
    if litellm_config is not None or len(urls) > 1:
        _fleet(urls, litellm_config, concurrency, api_key, kwargs, as_json)
    if reference is not None and (litellm_config is not None or len(urls) > 1):
        raise click.UsageError("--reference checks one server: give one URL")
    result = check.run(urls[0], api_key=api_key, reference=reference, **kwargs)
    if as_json:
        emit_json(to_json(result))
    else:
        render(result, tokens_tables=not summary)
    raise SystemExit(result.exit_code)


def _fleet(
    urls: tuple[str, ...],
    config: Path | None,
    concurrency: int,
    api_key: str | None,
    kwargs: dict[str, Any],
    as_json: bool,
) -> None:
    from specaudit.check import fleet

    deps = [fleet.Deployment(u, u, api_key) for u in urls]
    if config is not None:
        deps += fleet.read_litellm_config(config)
    result = fleet.run(deps, concurrency=concurrency, **kwargs)
    if as_json:
        emit_json(result)
    else:
        render_fleet(result)
    raise SystemExit(result.exit_code)


def render_fleet(result: FleetResult) -> None:
    """One row per deployment; the /slots vs /props line under the table."""
    from rich.table import Table

    t = Table(title=f"check: {len(result.deployments)} deployments", title_justify="left")
    named = any(d.name != d.url for d in result.deployments)  # URLs alone: one column
    heads = ("deployment", *(("url",) if named else ()), "speculates", "/slots", "/props")
    for h in (*heads, "placeholders", "exit"):
        t.add_column(h, justify="right" if h in ("placeholders", "exit") else "left")
    for d in result.deployments:
        spec = d.speculates + (" (hidden)" if d.hidden else "")
        t.add_row(
            d.name,
            *((d.url or "-",) if named else ()),
            spec if d.status == "checked" else d.status,
            d.slots or "-",
            d.props_types or "-",
            "-" if d.placeholders is None else f"{d.placeholders}/{d.placeholders + (d.real or 0)}",
            "-" if d.exit_code is None else str(d.exit_code),
            style="red" if d.placeholders else ("yellow" if d.status != "checked" else None),
        )
    out.print(t)
    for d in result.deployments:
        if d.status != "checked":
            out.print(f"{d.name}: {d.status}: {d.reason}", highlight=False)
    colour = "red" if result.exit_code else "green"
    out.print(
        f"[bold {colour}]verdict: {result.outcome.value}[/] - {result.reason}", highlight=False
    )


def to_json(result: CheckResult) -> dict[str, object]:
    """The result plus per-endpoint placeholder counts, for machines."""
    from specaudit.report import to_jsonable

    body = to_jsonable(result)
    assert isinstance(body, dict)
    body["placeholders"] = result.placeholders
    body["real"] = result.real
    body["placeholders_by_endpoint"] = result.placeholders_by_endpoint()
    return body


def render(result: CheckResult, tokens_tables: bool = True) -> None:
    from rich.table import Table

    from specaudit.check.rows import endpoint_rows

    if tokens_tables:
        _render_token_tables(result)
    t = Table(title=f"check {result.url}", title_justify="left")
    for h in ("endpoint", "stream", "tokens", "real", "placeholder", "draft_n", "verdict"):
        t.add_column(h)
    for ep in endpoint_rows(result):
        t.add_row(
            ep.endpoint,
            ep.stream,
            str(ep.tokens) if ep.decided else "-",
            str(ep.real) if ep.decided else "-",
            str(ep.placeholder) if ep.decided else "-",
            ep.drafted,
            ep.verdict,
            style="red" if ep.placeholder else None,
        )
    out.print(t)
    sp = result.speculation
    out.print(f"speculation: {sp.summary}", highlight=False)
    if result.switch is not None:
        out.print(f"per-request switch: {result.switch.detail}", highlight=False)
    _render_untracked_notes(result)
    if result.fidelity is not None:
        _render_fidelity(result)
    colour = "red" if result.exit_code else "green"
    out.print(f"[bold {colour}]verdict: {result.verdict}[/] - {result.reason}", highlight=False)


def _render_token_tables(result: CheckResult) -> None:
    """One table of token records per probe that returned any."""
    from rich.table import Table

    from specaudit.check import PROBE_LABELS
    from specaudit.check.rows import token_rows

    for r in result.endpoints:
        if not r.tokens:
            continue
        mode = "streamed" if r.stream else "non-streamed"
        t = Table(title=f"{PROBE_LABELS[r.kind]}, {mode}", title_justify="left")
        for h in ("#", "token", "logprob", "candidates", "class"):
            t.add_column(h, justify="right" if h in ("#", "candidates") else "left")
        for row in token_rows(r):
            style = "red" if row[4] == "placeholder" else None
            t.add_row(*(str(v) for v in row), style=style)
        out.print(t)


def _render_untracked_notes(result: CheckResult) -> None:
    """A note per probe whose server generated more tokens than came with a token record."""
    for r in result.endpoints:
        if r.decided and r.server_tokens is not None and r.server_tokens > r.total:
            out.print(
                f"note: {r.label}: the server generated {r.server_tokens} tokens, "
                f"{r.total} carried a token record",
                highlight=False,
            )


def _render_fidelity(result: CheckResult) -> None:
    from rich.table import Table

    f = result.fidelity
    assert f is not None
    t = Table(title=f"fidelity against {f.reference}", title_justify="left")
    for h in ("request", "real and correct", "real but wrong", "placeholder", "missing"):
        t.add_column(h, justify="left" if h == "request" else "right")
    for kind, c in f.by_kind.items():
        t.add_row(
            kind, str(c.real_correct), str(c.real_wrong), str(c.placeholder), str(c.missing),
            style="red" if c.real_wrong else None,
        )  # fmt: skip
    out.print(t)
    out.print(
        f"tolerance (twice the reference's own spread + float32 rounding): prob "
        f"{f.tolerance_prob:.2g}, logprob {f.tolerance_logprob:.2g}",
        highlight=False,
    )
    if f.uncompared:
        out.print(
            f"note: {f.uncompared} streamed tokens came after a token the stream never sent "
            "(held back inside a UTF-8 character): their prefix is unknown, not compared",
            highlight=False,
        )
    for line in f.worst:
        out.print(f"real but wrong: {line}", highlight=False)
