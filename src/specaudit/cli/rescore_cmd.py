"""`specaudit rescore`: sample any model's engine, re-score every token with a plain reference."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from specaudit import progress
from specaudit.cli.common import (
    TEXT,
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
    sample_progress,
    seeds_option,
    temperature_option,
    timeout_option,
    tokens_option,
)
from specaudit.cli.dist_cmd import _EngineChoice, _known_patches
from specaudit.distribution import registry
from specaudit.llama.presets import DRAFT_TOP_K
from specaudit.outcome import EXIT_TAIL_HELP

if TYPE_CHECKING:
    from specaudit.fixtures import SamplerSettings
    from specaudit.llama.patches import Patch

RESCORE_EXIT_HELP = (
    "\b\nExit codes:\n"
    "  0  PRESERVED: the sampled tokens are draws from the reference's distribution\n"
    "  1  BROKEN: they are not (the reason names the test); with --dist-engine, any unit\n"
    "  2  no decision: bad input (an engine whose extra is not installed, --dist-engine url\n"
    "     or openai without --url), a reference that speculates or serves another model,\n"
    "     text that does not round-trip, too few samples to decide, a server that failed\n"
    "     part-way\n" + EXIT_TAIL_HELP
)


def _dist_engine_help() -> str:
    return (
        "Re-score an engine of `specaudit dist` on a fixture instead of --url, repeatable: "
        + "; ".join(f"{e.name}: {e.help}" for e in registry.entries())
        + ". Every sampled fixture letter is re-scored against a plain stock llama-server "
        "serving the fixture's GGUF (--reference-url, or started here); the directed test "
        "aims at the fixture draft's favourite."
    )


class _RescoreCommand(click.Command):
    """`rescore` with each registered dist engine's own options (`EngineOption`), after
    --dist-engine (engines registered since import are listed too)."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        params = super().get_params(ctx)
        for p in params:
            if isinstance(p, click.Option) and p.name == "dist_engines":
                p.help = _dist_engine_help()
        at = next(i for i, p in enumerate(params) if p.name == "dist_engines") + 1
        own = [
            click.Option(
                [opt.flag, opt.param],
                type=click.Choice(opt.choices) if opt.choices else str,
                multiple=True,
                help=f"(--dist-engine {entry.name}) {opt.help}",
            )  # fmt: skip
            for entry, opt in registry.options()
        ]
        return params[:at] + own + params[at:]


class _ArmTemperature(click.ParamType):
    """auto, off, or a temperature above 0 (checked with the request)."""

    name = "auto|off|T"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str) or value in ("auto", "off"):
            return value
        try:
            t = float(value)
        except ValueError:
            self.fail(f"{value!r} is not auto, off or a temperature", param, ctx)
        if not 0 < t < float("inf"):
            self.fail(f"{value!r} is not a temperature above 0", param, ctx)
        return t


@click.command("rescore", cls=_RescoreCommand, epilog=RESCORE_EXIT_HELP)
@click.option(
    "--url",
    type=URL,
    default=None,
    metavar="URL",
    help="The engine under test (required without --dist-engine; with --dist-engine url or "
    "openai, the server that engine samples).",
)
@click.option("--dist-engine", "dist_engines", type=_EngineChoice(), multiple=True)
@click.option(
    "--fixture",
    type=SafePath(),
    default=None,
    help="--dist-engine: fixture directory (`specaudit fixtures build`) [default: the built-in "
    "fixture of --fixture-kind].",
)
@fixture_kind_option(
    help="--dist-engine: the built-in fixture's kind (last-token, context, mtp) [default: "
    "last-token]."
)
@click.option(
    "--patch",
    "patches",
    multiple=True,
    callback=_known_patches,
    help="--dist-engine server / speculative-example: llama.cpp built with this patch "
    "(speculative-fix, spec-logprobs, mutants/NAME, FILE.patch); repeatable. The reference "
    "stays stock.",
)
@click.option(
    "--engine",
    type=click.Choice(("server", "vllm", "openai")),
    default="server",
    show_default=True,
    help="server: llama-server's /completion (prompt and tokens as ids); vllm: vLLM's "
    "/v1/completions (prompt and tokens as ids, drafts counted from /metrics for the whole "
    "run); openai: /v1/completions text, turned into ids by the reference's tokenizer and "
    "refused unless it round-trips exactly.",
)
@click.option(
    "--reference-url",
    type=URL,
    default=None,
    metavar="URL",
    help="A plain llama-server (a plain vLLM server with --reference-engine vllm).",
)
@click.option(
    "--reference-model",
    type=SafePath(dir_okay=False),
    default=None,
    help="The same GGUF: specaudit serves it as a plain llama-server itself.",
)
@click.option(
    "--reference-vllm",
    type=SafePath(file_okay=False),
    default=None,
    metavar="DIR",
    help="--engine vllm: the same model as a Hugging Face folder; specaudit serves it as a "
    "plain vLLM server itself (its vLLM env, --logprobs-mode processed_logprobs, "
    "--max-logprobs -1).",
)
@click.option(
    "--reference-engine",
    type=click.Choice(("server", "vllm")),
    default="server",
    show_default=True,
    help="What --reference-url speaks: server (llama-server) or vllm (a plain vLLM server "
    "started with --logprobs-mode processed_logprobs --max-logprobs -1; --engine vllm only).",
)
@click.option(
    "--draft-url",
    type=URL,
    default=None,
    metavar="URL",
    help="A plain llama-server serving the draft model: its distribution at every prefix aims "
    "the tests at the bugs speculation makes (never needed for their validity).",
)
@click.option(
    "--draft-model",
    type=SafePath(dir_okay=False),
    default=None,
    help="The draft's GGUF: specaudit serves it as a plain llama-server itself.",
)
@click.option(
    "--draft-top-k",
    type=click.IntRange(1, 1 << 20),
    default=DRAFT_TOP_K,
    show_default=True,
    help="The draft's own top-k: the draft server is asked at it and the run's temperature "
    "(llama.cpp's probabilistic drafts sample at top-k 10), the q rejection sampling weighs.",
)
@click.option(
    "--self",
    "self_check",
    is_flag=True,
    help="No reference: test each token against the post-sampling distribution the engine "
    "itself reports for it (llama-server; placeholders are counted, not tested).",
)
@click.option(
    "--prompt",
    "prompts",
    type=TEXT,
    multiple=True,
    help="Prompt (repeatable); with --dist-engine one prompt in the fixture's letters "
    "[default: the fixture's].",
)
@seeds_option(
    default=200,
    min_value=1,
    help="Seeds per prompt (N). Sample i of prompt p (of P) has seed 1 + i*P + p: no seed "
    "depends on N, so a longer run extends a shorter one.",
)
@tokens_option(default=8, min_value=1, help="Tokens per sample.")
@temperature_option()
@click.option(
    "--arm-temperature",
    "arm",
    type=_ArmTemperature(),
    default="auto",
    show_default=True,
    help="With --url: the same run again at this temperature, decided as a second family "
    "(each arm at alpha / 2; twice the sampling). At T = 1 a sampler that applies the "
    "temperature wrongly is invisible. auto: 0.7 when --temperature is 1, no arm otherwise; "
    "off: no arm.",
)
@click.option("--top-k", type=click.IntRange(0, 1 << 20), default=40, show_default=True)
@click.option("--top-p", type=FiniteFloat(min=0, max=1, min_open=True), default=1.0)
@click.option("--min-p", type=FiniteFloat(min=0, max=1, max_open=True), default=0.0)
@click.option("--alpha", type=FiniteFloat(min=0, max=0.5, min_open=True), default=0.01)
@click.option(
    "--tolerance",
    type=FiniteFloat(min=0, max=1, min_open=True, max_open=True),
    default=None,
    help="The largest deviation PRESERVED may leave unexcluded (default: dist's, 0.15); "
    "a bound above it is INCONCLUSIVE, with the tokens that would decide.",
)
@click.option(
    "--control/--no-control",
    default=True,
    show_default=True,
    help="With --url: also sample the reference at the same seeds and decide it through the "
    "same test (the noisy null on your model), printed beside the engine's verdict.",
)
@click.option(
    "--coupling",
    is_flag=True,
    help="The engine samples and matches (greedy draft, MTP, EAGLE3, n-gram): its sample at a "
    "seed must be the reference's own; divergence beyond the reference's from itself is a "
    "test of the family.",
)
@click.option("--sequential", is_flag=True, help="Decide by the anytime-valid e-process.")
@click.option("--concurrency", type=click.IntRange(1, 256), default=4, show_default=True)
@click.option(
    "--model-name",
    default="model",
    help="OpenAI model name (--engine openai; --engine vllm: default the one it serves).",
)
@click.option("--plot", type=WRITABLE_FILE, default=None, help="Write a PIT histogram PNG.")
@timeout_option(default=60.0)
@json_option
def command(
    url: str | None,
    dist_engines: tuple[str, ...],
    fixture: Path | None,
    fixture_kind: str | None,
    patches: tuple[Patch, ...],
    engine: str,
    reference_url: str | None,
    reference_model: Path | None,
    reference_vllm: Path | None,
    reference_engine: str,
    draft_url: str | None,
    draft_model: Path | None,
    draft_top_k: int,
    self_check: bool,
    prompts: tuple[str, ...],
    seeds: int,
    tokens: int,
    temperature: float,
    arm: str | float,
    top_k: int,
    top_p: float,
    min_p: float,
    alpha: float,
    tolerance: float | None,
    control: bool,
    coupling: bool,
    sequential: bool,
    concurrency: int,
    model_name: str,
    plot: Path | None,
    timeout: float,
    as_json: bool,
    **engine_options: Any,
) -> None:
    """Re-score any model's samples against a plain reference of the same model.

    Draws N seeds for each prompt from the engine at URL (each prompt its own range: one
    seed gives every prompt the same uniforms, and the tests need independent draws), then
    asks the reference (the same model file served without speculation) for its processed
    next-token distribution given each sampled token's exact prefix, as token ids. Every
    token becomes a randomised PIT value, Uniform(0,1) when the engine samples what the
    reference says; KS, a directed test toward the draft's favourite, per-prefix G-tests and
    an anytime-valid e-process decide (docs/rescore.md).

    With --dist-engine NAME, the engine is one of `specaudit dist`'s (its own options as
    there), run on a fixture, and every token it samples is re-scored against a plain stock
    llama-server serving the fixture's GGUF; one result per unit (a spawned server: one per
    --path).
    """
    from specaudit.fixtures import SamplerSettings
    from specaudit.rescore import render, request, runner

    sampler = SamplerSettings(top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    if dist_engines:
        _refuse_url_only_options(
            self_check=self_check, url_engine=engine != "server" or model_name != "model",
            prompts=len(prompts), draft=bool(draft_url or draft_model), coupling=coupling,
            arm=not isinstance(arm, str),
            vllm_reference=reference_vllm is not None or reference_engine != "server",
        )  # fmt: skip
        _dist(
            dist_engines, url=url, fixture=fixture, fixture_kind=fixture_kind, patches=patches,
            prompt=prompts[0] if prompts else None, reference_url=reference_url,
            reference_model=reference_model, seeds=seeds, tokens=tokens, sampler=sampler,
            alpha=alpha, sequential=sequential, concurrency=concurrency, timeout=timeout,
            plot=plot, as_json=as_json,
            options={k: (v or None) for k, v in engine_options.items()}, tolerance=tolerance,
        )  # fmt: skip
    given = [n for n, v in (("--fixture", fixture), ("--fixture-kind", fixture_kind)) if v]
    given += ["--patch"] if patches else []
    given += [o.flag for _, o in registry.options() if engine_options.get(o.param)]
    if given:
        raise click.UsageError(f"{given[0]} needs --dist-engine")
    if url is None:
        raise click.UsageError("give --url (the engine under test) or --dist-engine NAME")
    req = request.make_request(
        url, engine=engine, reference_url=reference_url, reference_model=reference_model,
        reference_vllm=reference_vllm, reference_engine=reference_engine, prompts=prompts,
        seeds=seeds, tokens=tokens, sampler=sampler, alpha=alpha,
        sequential=sequential, concurrency=concurrency, timeout=timeout, model=model_name,
        draft_url=draft_url, draft_model=draft_model, draft_top_k=draft_top_k,
        self_check=self_check,
        control=control and not self_check, coupling=coupling,
        tolerance=tolerance, arm_temperature=_arm(arm, sampler, self_check),
    )  # fmt: skip
    total = req.seeds * req.n_prompts * (2 if req.arm_temperature is not None else 1)
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


def _arm(arm: str | float, sampler: SamplerSettings, self_check: bool) -> float | None:
    """--arm-temperature resolved: auto is `request.default_arm` (none with --self)."""
    from specaudit.rescore import request

    if arm == "off" or (arm == "auto" and self_check):
        return None
    return request.default_arm(sampler) if arm == "auto" else float(arm)


def _refuse_url_only_options(
    *,
    self_check: bool,
    url_engine: bool,
    prompts: int,
    draft: bool,
    coupling: bool,
    arm: bool,
    vllm_reference: bool = False,
) -> None:
    """What --dist-engine cannot take (a usage error, exit 2)."""
    if self_check:
        raise click.UsageError("--self takes --url, not --dist-engine")
    if url_engine:
        raise click.UsageError("--engine and --model-name go with --url, not --dist-engine")
    if prompts > 1:
        raise click.UsageError("--dist-engine takes one --prompt (the fixture's letters)")
    if draft:
        raise click.UsageError("--dist-engine knows its fixture's draft: no --draft-url")
    if coupling:
        raise click.UsageError("--coupling goes with --url (a server sampled at its seeds)")
    if vllm_reference:
        raise click.UsageError(
            "--reference-vllm and --reference-engine go with --url --engine vllm, not "
            "--dist-engine (its reference is a llama-server serving the fixture's GGUF)"
        )
    if arm:
        raise click.UsageError(
            "--arm-temperature goes with --url (--dist-engine samples the fixture at "
            "--temperature; run it again at another)"
        )


def _dist(
    engines: tuple[str, ...],
    *,
    patches: tuple[Patch, ...],
    plot: Path | None,
    as_json: bool,
    options: dict[str, Any],
    **params: Any,
) -> None:
    """`rescore --dist-engine`: registry engines on a fixture, one result per unit."""
    from specaudit.rescore import engines as rescore_engines
    from specaudit.rescore import render

    req = rescore_engines.make_request(engines, patches=patches, **params, **options)
    if req.dist.needs_binaries:
        req = dataclasses.replace(
            req, dist=req.dist.with_binaries(ensure_binaries(patches=req.dist.patches))
        )
    with progress.bars(console=console) as bars:

        def cb(label: str, done: int, total: int) -> None:
            if not as_json:
                bars(f"rescore {label}", done, total)

        res = rescore_engines.run(req, progress=cb)
    if plot is not None:
        for i, r in enumerate(x for x in res.results if x.stats is not None):
            target = plot if i == 0 else plot.with_name(f"{plot.stem}-{i + 1}{plot.suffix}")
            render.plot_pit(r, target)
    if as_json:
        emit_json(render.engines_json(res))
    else:
        click.echo(render.engines_markdown(res))
    for r in res.results:
        if r.error:
            console.print(f"error: {r.engine}: {r.error}", markup=False, highlight=False)
    out.file.flush()
    raise SystemExit(res.exit_code)
