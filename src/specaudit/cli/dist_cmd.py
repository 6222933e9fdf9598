"""`specaudit dist`: does speculative decoding preserve the sampling distribution?"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from specaudit import distribution, progress
from specaudit.cli.common import (
    URL,
    WRITABLE_FILE,
    FiniteFloat,
    SafePath,
    console,
    emit_json,
    ensure_binaries,
    fixture_kind_option,
    json_option,
    out,
    prompt_option,
    seed_option,
    seeds_option,
    temperature_option,
    timeout_option,
    tokens_option,
)
from specaudit.distribution import coverage
from specaudit.outcome import EXIT_TAIL_HELP, Outcome
from specaudit.validate import MAX_INT32

if TYPE_CHECKING:
    from specaudit.llama.patches import Patch

PATHS_HELP = (
    "\b\nVerification paths (--engine server runs one llama-server per path, --path picks):\n"
    + "".join(f"  {p:<13} {distribution.PATH_HELP[p]}\n" for p in distribution.PATHS)
    + "  Not covered, listed under every result with the reason (docs/dist.md):\n  "
    + ", ".join(name for name, _ in distribution.NOT_COVERED)
    + ".\n\n"
)

DIST_EXIT_HELP = (
    "\b\nExit codes:\n"
    "  0  PRESERVED (or, --sequential, WITHIN TOLERANCE): every engine's prefix-averaged\n"
    "     next-token TV and joint TV are certified below --tolerance\n"
    "  1  BROKEN: an engine's samples contradict the target distribution, or hold a token\n"
    "     the fixture forbids (a wrong letter, EOS, a special token, a short output)\n"
    "  2  INCONCLUSIVE (more samples needed), or no decision: bad input, missing or corrupt\n"
    "     fixture, unreachable server, failed build\n" + EXIT_TAIL_HELP
)


def _table(title: str, headers: tuple[str, ...], rows: list[tuple[Any, ...]]) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    for h in headers:
        t.add_column(h, overflow="fold")
    for r in rows:
        t.add_row(*("-" if v is None else str(v) for v in r))
    return t


def render(res: distribution.DistResult) -> None:
    wl = res.workload
    s = wl.sampler
    out.print(
        f"fixture {res.fixture} ({res.fixture_dir}), prompt {wl.prompt!r}, {wl.tokens} tokens "
        f"per sample, positions 1-{wl.positions}"
        + (f", joint 1-{wl.joint}" if wl.joint else "")
        + f"; top-k {s.top_k}, top-p {s.top_p:g}, min-p {s.min_p:g}, temperature "
        f"{s.temperature:g}; alpha {res.alpha:g}, TV tolerance {res.tolerance:g}"
        + ("; sequential (anytime-valid)" if res.sequential else ""),
        highlight=False,
    )
    out.print("expected = closed form from the fixture's definition", style="dim")
    colours = {Outcome.OK: "green", Outcome.FINDING: "red", Outcome.NO_DECISION: "yellow"}
    for e in res.engines:
        out.print()
        out.print(
            f"[bold]{e.engine}[/bold]: [{colours[e.verdict.outcome]}]{e.verdict.value}[/] "
            f"({f'path {e.path}, ' if e.path else ''}"
            f"seeds {e.first_seed}..{e.last_seed}, {e.n_samples} samples"
            + (f", {distribution.draft_cell(e)}" if e.drafted is not None else "")
            + f", {e.samples_per_s:.0f} samples/s)",
            highlight=False,
        )
        out.print(f"  {e.reason}", highlight=False)
        out.print(
            _table(
                "observed (expected) per token, most likely context per position",
                distribution.CONTEXT_HEADERS,
                distribution.context_rows(e),
            )
        )
        note = " (descriptive: the sample size was chosen sequentially)" if e.sequential else ""
        out.print(_table("tests" + note, distribution.TEST_HEADERS, distribution.test_rows(e)))
        for line in distribution.detail_lines(e, wl.prompt):
            out.print(f"  {line}", highlight=False)
    out.print()
    out.print(_table("summary", distribution.SUMMARY_HEADERS, distribution.summary_rows(res)))
    if any(e.path for e in res.engines):
        title = "every --spec-type of b11434: the path that covers it, or why none does"
        out.print(_table(title, coverage.COVERAGE_HEADERS, coverage.coverage_rows(res)))
    for note in res.notes:
        out.print(note, highlight=False)
    if res.not_covered:
        out.print("not covered:", highlight=False)
        for name, why in res.not_covered:
            out.print(f"  {name}: {why}", highlight=False)
    if res.plot is not None:
        out.print(f"plot: {res.plot}", highlight=False)


def _known_patches(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> tuple[Patch, ...]:
    """--patch: a bundled patch or mutant, or a .patch file, resolved (read) once, now."""
    from specaudit.errors import BuildError
    from specaudit.llama.patches import resolve_all

    try:
        return resolve_all(value)
    except BuildError as e:
        raise click.BadParameter(str(e), ctx, param) from None


class _EngineChoice(click.Choice):
    """--engine: one of the engines registered when the command runs (`dist.registry`)."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return distribution.registry.names()

    @choices.setter
    def choices(self, value: object) -> None:
        pass


class _DistCommand(click.Command):
    """`dist` with each registered engine's own options (`EngineOption`), after --url."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)
        for p in params:
            if isinstance(p, click.Option) and p.name == "engines":
                p.help = _engine_help()  # engines registered since import are listed too
        at = next(i for i, p in enumerate(params) if p.name == "url") + 1
        own = [
            click.Option(
                [opt.flag, opt.param],
                type=click.Choice(opt.choices) if opt.choices else str,
                multiple=True,
                help=opt.help,
            )
            for _, opt in distribution.registry.options()
        ]
        return params[:at] + own + params[at:]


def _engine_help() -> str:
    entries = distribution.registry.entries()
    return (
        "Engine(s) to test, repeatable [default: server and speculative-example]. "
        + "; ".join(f"{e.name}: {e.help}" for e in entries)
        + "."
    )


@click.command("dist", cls=_DistCommand, epilog=PATHS_HELP + DIST_EXIT_HELP)
@click.option("--engine", "engines", type=_EngineChoice(), multiple=True)
@click.option(
    "--url",
    "url",
    type=URL,
    multiple=True,
    help="Base URL of a running server (--engine url: llama-server's native /completion; "
    "--engine openai: any /v1/completions server). Repeatable: identical servers share the "
    "seeds.",
)
@click.option(
    "--fixture",
    "fixture",
    type=SafePath(),
    help="Fixture directory from `specaudit fixtures build` (SHA-256 checked) "
    "[default: the built-in fixture of --fixture-kind, built fresh].",
)
@fixture_kind_option(
    help="Built-in fixture: last-token (the report's; each next-token distribution depends on "
    "the previous token), context (on the whole context, through attention), mtp (last-token, "
    "an MTP layer drafts) or replay (last-token, a Mamba target: the checkpoint replay paths) "
    "[default: last-token]. With --fixture, that fixture must be of this kind.",
)
@prompt_option(default=None, help="Prompt, in the fixture's letters [default: the fixture's].")
@tokens_option(
    default=distribution.DEFAULT_TOKENS,
    help=f"Tokens generated per sample (at least {distribution.MIN_TOKENS}, so the server drafts).",
)
@click.option(
    "--positions",
    type=click.IntRange(1, MAX_INT32),
    help="Positions tested, 1..N [default: --tokens].",
)
@click.option(
    "--joint",
    type=click.IntRange(0, distribution.MAX_JOINT),
    help="Test the joint distribution of the first N positions [default: 3].",
)
# the sampler's top-k (not logprob candidates as in check/ab): its own option
@click.option("--top-k", type=click.IntRange(0, MAX_INT32), default=3, show_default=True)
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--min-p", type=FiniteFloat(0, 1, max_open=True), default=0.0, show_default=True)
@temperature_option("--temperature", "--temp")
@seeds_option(
    default=1000,
    min_value=1,
    help="Samples per engine: seeds S..S+N-1 (the maximum with --sequential); memory does "
    "not grow with N.",
)
@seed_option("--seed-start", default=1, help="First seed S.")
@click.option(
    "--alpha",
    type=FiniteFloat(0, 1, min_open=True, max_open=True),
    default=distribution.DEFAULT_ALPHA,
    show_default=True,
)
@click.option(
    "--tolerance",
    type=FiniteFloat(0, 1, min_open=True),
    default=distribution.DEFAULT_TOLERANCE,
    show_default=True,
    help="PRESERVED needs the data to rule out a larger prefix-averaged next-token TV at every "
    "position and a larger joint TV.",
)
@click.option(
    "--sequential",
    is_flag=True,
    help="Stop as soon as the evidence is decisive (anytime-valid e-values); reports the "
    "samples used.",
)
@click.option(
    "--parallel",
    type=click.IntRange(1, distribution.MAX_PARALLEL),
    default=4,
    show_default=True,
    help="Slots (-np) of spawned servers.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, distribution.MAX_CONCURRENCY),
    help="Requests in flight [default: 2 x slots].",
)
@click.option(
    "--jobs",
    type=click.IntRange(1, distribution.MAX_JOBS),
    help="Parallel llama-speculative processes [default: CPUs].",
)
@click.option(
    "--patch",
    "patches",
    multiple=True,
    callback=_known_patches,
    help="Run the server engine (every --path) and speculative-example on llama.cpp built "
    "with this patch: "
    "one shipped with specaudit (spec-logprobs), a mutant (mutants/NAME, docs/mutants.md), or a "
    "path to a .patch file. Repeatable.",
)
@timeout_option(
    default=distribution.DEFAULT_TIMEOUT, help="Seconds per request to a server engine."
)
@click.option(
    "--plot",
    type=WRITABLE_FILE,
    help="Write a PNG here (its directory is checked writable before sampling).",
)
@json_option
def command(
    engines: tuple[str, ...],
    top_k: int,
    top_p: float,
    min_p: float,
    temperature: float,
    as_json: bool,
    **params: Any,
) -> None:
    """Prove whether speculative decoding preserves the sampling distribution.

    Samples seeds 1..N from each engine running a fixture model and tests the tokens against
    the distribution the fixture's definition implies (closed form, never the engine's word):
    every position conditionally on its prefix, and the joint of the first positions, with
    G-tests (exact or Monte-Carlo when counts are small), Holm correction, and TV distances
    with confidence intervals. Reproduces the field report: llama-server keeps the
    distribution with and without a draft, on every verification path; llama-speculative
    does not.
    """
    # Every other option is a `make_request` keyword of the same name (an engine's own
    # option: its `EngineOption.param`, None when not given).
    if engines == ():
        engines = ("url",) if params["url"] else ("server", "speculative-example")
    for _, opt in distribution.registry.options():
        params[opt.param] = params.get(opt.param) or None
    from specaudit import fixtures

    sampler = fixtures.SamplerSettings(
        top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature
    )
    # Check every input first (a bad one must not wait for a build), then provision the
    # binaries with their own progress bar (one live display at a time), then sample.
    req = distribution.make_request(engines, sampler=sampler, **params)
    if req.needs_binaries:
        req = req.with_binaries(ensure_binaries(patches=req.patches))
    # One bar per engine on a terminal; off one, a line per tenth of each engine's samples.
    with progress.bars(console=console) as bars:

        def cb(label: str, done: int, total: int) -> None:
            bars(f"dist {label}", done, total)

        res = distribution.run(req, progress=cb)
    if as_json:
        emit_json(res)
    elif out.is_terminal:
        render(res)
    else:
        # Off a terminal rich would squeeze the tables into 80 columns: print Markdown.
        click.echo(distribution.to_markdown(res))
        if any(e.path for e in res.engines) or res.not_covered:
            click.echo("\n" + distribution.paths_markdown(res))
        for note in res.notes:
            click.echo(f"\n{note}")
        if res.plot is not None:
            click.echo(f"\nplot: {res.plot}")
    raise SystemExit(res.exit_code)  # PRESERVED 0, BROKEN 1, INCONCLUSIVE 2
