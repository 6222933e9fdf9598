"""`specaudit rescore`: sample any model's engine, re-score every token with a plain reference."""

from __future__ import annotations

from pathlib import Path

import click

from specaudit.cli.common import (
    TEXT,
    URL,
    WRITABLE_FILE,
    FiniteFloat,
    SafePath,
    console,
    emit_json,
    json_option,
    out,
    sample_progress,
    seeds_option,
    temperature_option,
    timeout_option,
    tokens_option,
)
from specaudit.outcome import EXIT_TAIL_HELP

RESCORE_EXIT_HELP = (
    "\b\nExit codes:\n"
    "  0  PRESERVED: the sampled tokens are draws from the reference's distribution\n"
    "  1  BROKEN: they are not (the reason names the test)\n"
    "  2  no decision: bad input, a reference that speculates or serves another model, text\n"
    "     that does not round-trip, too few samples to decide, a server that failed part-way\n"
    + EXIT_TAIL_HELP
)


@click.command("rescore", epilog=RESCORE_EXIT_HELP)
@click.option("--url", type=URL, required=True, metavar="URL", help="The engine under test.")
@click.option(
    "--engine",
    type=click.Choice(("server", "openai")),
    default="server",
    show_default=True,
    help="server: llama-server's /completion (prompt and tokens as ids); openai: "
    "/v1/completions text, turned into ids by the reference's tokenizer and refused unless "
    "it round-trips exactly.",
)
@click.option(
    "--reference-url", type=URL, default=None, metavar="URL", help="A plain llama-server."
)
@click.option(
    "--reference-model",
    type=SafePath(dir_okay=False),
    default=None,
    help="The same GGUF: specaudit serves it as a plain llama-server itself.",
)
@click.option(
    "--self",
    "self_check",
    is_flag=True,
    help="No reference: test each token against the post-sampling distribution the engine "
    "itself reports for it (llama-server; placeholders are counted, not tested).",
)
@click.option("--prompt", "prompts", type=TEXT, multiple=True, help="Prompt (repeatable).")
@seeds_option(default=200, min_value=1, help="Seeds per prompt (1..N).")
@tokens_option(default=8, min_value=1, help="Tokens per sample.")
@temperature_option()
@click.option("--top-k", type=click.IntRange(0, 1 << 20), default=40, show_default=True)
@click.option("--top-p", type=FiniteFloat(min=0, max=1, min_open=True), default=1.0)
@click.option("--min-p", type=FiniteFloat(min=0, max=1, max_open=True), default=0.0)
@click.option("--alpha", type=FiniteFloat(min=0, max=0.5, min_open=True), default=0.01)
@click.option("--sequential", is_flag=True, help="Decide by the anytime-valid e-process.")
@click.option("--concurrency", type=click.IntRange(1, 256), default=4, show_default=True)
@click.option("--model-name", default="model", help="OpenAI model name (--engine openai).")
@click.option("--plot", type=WRITABLE_FILE, default=None, help="Write a PIT histogram PNG.")
@timeout_option(default=60.0)
@json_option
def command(
    url: str,
    engine: str,
    reference_url: str | None,
    reference_model: Path | None,
    self_check: bool,
    prompts: tuple[str, ...],
    seeds: int,
    tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    alpha: float,
    sequential: bool,
    concurrency: int,
    model_name: str,
    plot: Path | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Re-score any model's samples against a plain reference of the same model.

    Draws seeds 1..N for each prompt from the engine at URL, then asks the reference (the
    same model file served without speculation) for its processed next-token distribution
    given each sampled token's exact prefix, as token ids. Every token becomes a randomised
    PIT value, Uniform(0,1) when the engine samples what the reference says; KS, a directed
    test toward the draft's favourite, per-prefix G-tests and an anytime-valid e-process
    decide (docs/rescore.md).
    """
    from specaudit.fixtures import SamplerSettings
    from specaudit.rescore import render, runner

    sampler = SamplerSettings(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    req = runner.make_request(
        url, engine=engine, reference_url=reference_url, reference_model=reference_model,
        prompts=prompts, seeds=seeds, tokens=tokens, sampler=sampler, alpha=alpha,
        sequential=sequential, concurrency=concurrency, timeout=timeout, model=model_name,
        self_check=self_check,
    )  # fmt: skip
    total = req.seeds * req.n_prompts
    with sample_progress("re-scoring", total, unit="samples", quiet=as_json) as cb:
        res = runner.run(req, progress=lambda done, _n: cb(done))
    if plot is not None and res.stats is not None:
        render.plot_pit(res, plot)
    if as_json:
        emit_json(render.to_json(res))
    else:
        click.echo(render.markdown(res))
    if res.error:
        console.print(f"error: {res.error}", markup=False, highlight=False)
    out.file.flush()
    raise SystemExit(res.exit_code)
