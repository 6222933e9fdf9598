"""`specaudit ab`: speculative vs plain over seeds; what placeholders do to a mean logprob."""

from __future__ import annotations

from pathlib import Path

import click

from specaudit import ab, progress
from specaudit.cli.common import (
    TEXT,
    URL,
    WRITABLE_DIR,
    WRITABLE_FILE,
    SafePath,
    console,
    emit_json,
    ensure_binaries,
    json_option,
    out,
    prompt_option,
    sample_progress,
    seeds_option,
    temperature_option,
    timeout_option,
    tokens_option,
    top_k_option,
)
from specaudit.outcome import EXIT_FINDING, EXIT_OK, EXIT_TAIL_HELP
from specaudit.validate import MAX_INT32

AB_EXIT_HELP = (
    "\b\nExit codes:\n"
    "  0  consistent: both sides fully covered and in agreement\n"
    "  1  instrument fault: the spec side's aggregate comes from placeholders\n"
    "  2  inconclusive, or no decision: bad input, unreachable or non-LLM server\n" + EXIT_TAIL_HELP
)


def _status(msg: str) -> None:
    progress.say("ab", msg, console=console)


@click.command("ab", epilog=AB_EXIT_HELP)
@click.option(
    "--plain", "plain_url", type=URL, metavar="URL", help="Server started without speculation."
)
@click.option("--spec", "spec_url", type=URL, metavar="URL", help="Server that speculates.")
@seeds_option(
    default=ab.DEFAULT_SEEDS,
    min_value=1,
    max_value=ab.MAX_SEEDS,
    help=f"Seeds per side (1..N, N <= {ab.MAX_SEEDS}), sent concurrently up to each server's "
    "slots.",
)
@tokens_option(default=ab.DEFAULT_TOKENS, min_value=1, help="Tokens per response.")
@prompt_option(default=ab.DEFAULT_PROMPT, help="User prompt.")
@temperature_option()
@top_k_option(
    "top_logprobs",
    default=ab.DEFAULT_TOP_LOGPROBS,
    help="Candidates requested per token (top_logprobs / n_probs), as in check.",
)
@click.option(
    "--sampler-top-k",
    type=click.IntRange(min=0, max=MAX_INT32),
    default=None,
    help="Sampler top-k (default: the server's).",
)
@click.option(
    "--endpoint",
    type=click.Choice(ab.AB_ENDPOINTS),
    default="chat",
    show_default=True,
    help="chat = /v1/chat/completions (logprobs, top_logprobs); completion = /completion.",
)
@click.option(
    "--plot",
    type=WRITABLE_FILE,
    default=None,
    help="Write a PNG: per-token traces with placeholders marked, per-seed means (its "
    "directory is checked writable before sampling).",
)
@timeout_option(
    default=120.0,
    help=f"Seconds per request (the first /slots probe: at most {ab.PROBE_TIMEOUT:g}).",
)
@click.option(
    "--model",
    type=SafePath(dir_okay=False),
    default=None,
    help="Without URLs: GGUF for both servers (default: Gemma 3 270M).",
)
@click.option(
    "--draft",
    type=SafePath(dir_okay=False),
    default=None,
    help="Without URLs: draft GGUF (default: the model itself, for draft-* types).",
)
@click.option(
    "--spec-type",
    type=TEXT,
    default=None,
    help=f"Without URLs: llama-server --spec-type (default: {ab.DEFAULT_SPEC_TYPE}).",
)
@click.option(
    "--log-dir",
    type=WRITABLE_DIR,
    default=None,
    help="Without URLs: keep the servers' logs here.",
)
@json_option
def command(
    plain_url: str | None,
    spec_url: str | None,
    seeds: int,
    tokens: int,
    prompt: str,
    temperature: float,
    sampler_top_k: int | None,
    top_logprobs: int,
    endpoint: str,
    plot: Path | None,
    timeout: float,
    model: Path | None,
    draft: Path | None,
    spec_type: str | None,
    log_dir: Path | None,
    as_json: bool,
) -> None:
    """Sample the same prompt and seeds from a plain and a speculating server and compare
    the mean logprob a client would compute (naive) with the mean over real tokens.

    Per seed and side: naive mean, real-only mean, coverage (real tokens / tokens),
    placeholders and the server's draft_n / draft_n_accepted; per side a summary with
    t-intervals over seeds; a paired Δ (spec - plain) with its interval; and a verdict:
    "instrument fault", "consistent" or "inconclusive" (rules: docs/ab.md).

    Without --plain/--spec, ab starts both servers itself (127.0.0.1, free ports, always
    stopped): --model with itself as its own draft and --spec-type draft-simple by default,
    Gemma 3 270M unless --model is given, as in the field report.
    """
    if (plain_url is None) != (spec_url is None):
        raise ab.ABError("give both --plain and --spec, or neither (ab then starts both servers)")
    if plain_url is not None and (model or draft or spec_type or log_dir):
        raise ab.ABError(
            "--model/--draft/--spec-type/--log-dir only apply when ab starts the "
            "servers itself (no --plain/--spec)"
        )
    settings = ab.Settings(
        seeds=seeds,
        tokens=tokens,
        prompt=prompt,
        temperature=temperature,
        sampler_top_k=sampler_top_k,
        top_logprobs=top_logprobs,
        endpoint=endpoint,
    )
    if plain_url is None and (spec_type == "none" or spec_type == ""):
        raise ab.ABError("--spec-type must name a speculative decoding type (e.g. draft-simple)")
    for what, path in (("--model", model), ("--draft", draft)):
        if path is not None and not path.is_file():  # before a build, not after it
            raise ab.ABError(f"{what} file not found: {path}")
    bins = None if plain_url is not None else ensure_binaries()  # its own progress bar
    # A live bar on a terminal; silent off one (the result is the output).
    with sample_progress("sampling", 2 * seeds, unit="responses", quiet=True) as cb:
        if plain_url is not None and spec_url is not None:
            result = ab.run(plain_url, spec_url, settings, plot=plot, progress=cb, timeout=timeout)
        else:
            result = ab.run_local(
                settings,
                binaries=bins,
                model=model,
                draft=draft,
                spec_type=spec_type or ab.DEFAULT_SPEC_TYPE,
                log_dir=log_dir,
                plot=plot,
                progress=cb,
                status=_status,
                timeout=timeout,
            )
    if as_json:
        emit_json(result)
    else:
        _render(result)
    raise SystemExit(result.exit_code)


def _render(result: ab.ABResult) -> None:
    from rich.table import Table

    if not out.is_terminal:
        # Off a terminal rich squeezes tables into 80 columns: print Markdown, which pastes.
        click.echo(ab.markdown(result))
        return
    st = result.settings
    loc = result.local
    where = (
        f"local servers: {Path(loc['model']).name}, --spec-type {loc['spec_type']}"
        if loc
        else f"plain {result.plain.url}, spec {result.spec.url}"
    )
    out.print(
        f"[bold]specaudit ab[/bold]: {st.seeds} seeds × {st.tokens} tokens, "
        f"T={st.temperature:g}, {st.endpoint}, {where}",
        highlight=False,
    )
    shape = Table(
        title="naive mean logprob per seed (what a client computes)", title_justify="left"
    )
    for h in ab.report_shape_headers(result):
        shape.add_column(h, justify="left" if h == "side" else "right")
    for row in ab.report_shape_rows(result):
        shape.add_row(*[str(v) for v in row])
    out.print(shape)

    detail = Table(title="per seed and side", title_justify="left")
    for h in ab.DETAIL_HEADERS:
        detail.add_column(h, justify="left" if h in ("seed", "side") else "right")
    for row in ab.detail_rows(result, ci_sep="\n"):
        detail.add_row(*[str(v) for v in row], end_section=row[0] == "all" and row[1] == "plain")
    out.print(detail)

    for side in ab.SIDES:
        out.print(ab.side_line(result.side(side)), highlight=False)
    out.print(ab.delta_line(result.delta_naive, st.confidence), highlight=False)
    out.print(ab.delta_line(result.delta_real, st.confidence), highlight=False)
    style = {EXIT_FINDING: "bold red", EXIT_OK: "bold green"}.get(result.exit_code, "bold yellow")
    out.print(f"[{style}]verdict[/{style}]: {result.verdict.message}", highlight=False)
    for r in result.verdict.reasons:
        out.print(f"  - {r}", highlight=False)
    if result.plot is not None:
        out.print(f"plot: {result.plot}", highlight=False)
