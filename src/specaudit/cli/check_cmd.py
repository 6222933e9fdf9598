"""`specaudit check URL`: are a running server's logprobs real, and does it speculate?"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

# specaudit.check is light (no numpy/scipy): its defaults and choices feed the options below.
from specaudit.check import DEFAULT_PROMPT, ENDPOINT_GROUPS
from specaudit.cli.common import (
    API_KEY,
    TEXT,
    URL,
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
    from specaudit.check import CheckResult

CHECK_EXIT_HELP = (
    "\b\nExit codes:\n"
    "  0  every logprob is real (candidates came back for every token)\n"
    "  1  placeholders found: k candidates requested, none returned\n"
    "  2  no decision: unreachable server, HTTP errors, non-JSON answers, not an LLM\n"
    "     server, no logprobs at all, or bad options\n" + EXIT_TAIL_HELP
)


@click.command("check", epilog=CHECK_EXIT_HELP)
@click.argument("url", type=URL)
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
@json_option
def command(
    url: str,
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
    as_json: bool,
) -> None:
    """Check whether the logprobs a server at URL returns are real.

    Asks for TOP_K candidates per token on each endpoint, non-streamed and streamed, and
    classifies every token: real (candidates came back) or placeholder (none came back: a
    speculating llama-server sends logprob 0.0 / prob 1.0, or in streams no entry at all).
    A logprob of exactly 0 with candidates is real. Reads /slots and /props to say whether
    the server speculates, shows timings.draft_n, and tests the per-request
    "speculative.n_max": 0 switch.
    """
    from specaudit import check

    result = check.run(
        url,
        top_k=top_k,
        tokens=tokens,
        endpoint=endpoint,
        prompt=prompt,
        seed=seed,
        temperature=temperature,
        stream=stream,
        model=model,
        timeout=timeout,
        api_key=api_key,
    )
    if as_json:
        emit_json(to_json(result))
    else:
        render(result, tokens_tables=not summary)
    raise SystemExit(result.exit_code)


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

    from specaudit.check import PROBE_LABELS, endpoint_verdict, token_rows

    if tokens_tables:
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
    t = Table(title=f"check {result.url}", title_justify="left")
    for h in ("endpoint", "stream", "tokens", "real", "placeholder", "draft_n", "verdict"):
        t.add_column(h)
    for r in result.endpoints:
        drafted = f"{r.draft_n} ({r.draft_n_accepted} acc.)" if r.draft_n is not None else "-"
        t.add_row(
            PROBE_LABELS[r.kind],
            "yes" if r.stream else "no",
            str(r.total) if r.decided else "-",
            str(r.real) if r.decided else "-",
            str(r.placeholder) if r.decided else "-",
            drafted,
            endpoint_verdict(r),
            style="red" if r.placeholder else None,
        )
    out.print(t)
    sp = result.speculation
    out.print(f"speculation: {sp.summary}", highlight=False)
    if result.switch is not None:
        out.print(f"per-request switch: {result.switch.detail}", highlight=False)
    for r in result.endpoints:
        if r.decided and r.server_tokens is not None and r.server_tokens > r.total:
            out.print(
                f"note: {r.label}: the server generated {r.server_tokens} tokens, "
                f"{r.total} carried a token record",
                highlight=False,
            )
    colour = "red" if result.exit_code else "green"
    out.print(f"[bold {colour}]verdict: {result.verdict}[/] - {result.reason}", highlight=False)
