"""`specaudit fixtures build DIR`: write the tiny GGUF fixtures and their manifest;
`specaudit fixtures export DIR --format hf`: the same fixture as Hugging Face folders."""

from __future__ import annotations

from pathlib import Path

import click

from specaudit.cli.common import (
    WRITABLE_DIR,
    SafePath,
    emit_json,
    fixture_kind_option,
    json_option,
    out,
)
from specaudit.outcome import EXIT_TAIL_HELP

EXIT_CODES_HELP = (
    "\b\nExit codes:\n"
    "  0  written (and, for export, proven: logits and closed form within tolerance)\n"
    "  2  no decision: bad input, unwritable directory, a fixture that fails its checks, a\n"
    "     head size that cannot keep the function, a failed proof\n" + EXIT_TAIL_HELP
)
#: The widest head `fixtures export --head-size` writes (vLLM's CPU attention stops at 512).
MAX_HEAD_SIZE = 1024


@click.group("fixtures", epilog=EXIT_CODES_HELP)
def command() -> None:
    """Tiny GGUF models with exactly known next-token distributions."""


@command.command("build", epilog=EXIT_CODES_HELP)
@click.argument("directory", type=WRITABLE_DIR)
@fixture_kind_option(
    "--kind",
    default="last-token",
    help="Which fixture: last-token (each next-token distribution depends on the previous "
    "token only: `dist`'s default), context (on the whole context, through attention: "
    "`dist --fixture-kind context`), mtp (last-token, with an MTP layer that drafts: "
    "`dist --fixture-kind mtp`) or replay (last-token, a Mamba target: the server's "
    "checkpoint replay, `dist --fixture-kind replay`).",
)
@json_option
def build_cmd(directory: Path, fixture_kind: str, as_json: bool) -> None:
    """Write target.gguf, draft.gguf and manifest.json (with SHA-256s) into DIRECTORY."""
    from specaudit import fixtures

    fs = fixtures.build(directory, kind=fixture_kind)  # type: ignore[arg-type]
    if as_json:
        emit_json(
            {
                "dir": fs.dir,
                "kind": fs.spec.kind,
                "name": fs.spec.name,
                "target": fs.target,
                "draft": fs.draft,
                "manifest": fs.manifest,
                "sha256": fs.sha256,
            }
        )
        return
    for name, sha in fs.sha256.items():
        out.print(f"{name}  {sha}", highlight=False)
    out.print(f"manifest: {fs.manifest} ({fs.spec.kind} fixture {fs.spec.name})", highlight=False)


@command.command("export", epilog=EXIT_CODES_HELP)
@click.argument("directory", type=WRITABLE_DIR)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["hf"]),
    required=True,
    help="hf: a Hugging Face folder per model (config.json, model.safetensors, tokenizer "
    "files, generation_config.json) in DIRECTORY/target and DIRECTORY/draft, and "
    "DIRECTORY/export.json, for engines without a GGUF loader (vLLM).",
)
@fixture_kind_option(
    "--kind",
    help="Built-in fixture to build into DIRECTORY/fixture and export: last-token or context "
    "(the one-layer llama kinds) [default: last-token]. With --fixture, that fixture must be "
    "of this kind.",
)
@click.option(
    "--fixture",
    "fixture",
    type=SafePath(exists=True, file_okay=False),
    help="Fixture directory from `specaudit fixtures build` (SHA-256 checked) "
    "[default: the built-in fixture of --kind, built fresh].",
)
@click.option(
    "--head-size",
    "head_size",
    type=click.IntRange(min=2, max=MAX_HEAD_SIZE),
    default=None,
    help="Attention head size of the export [default: the fixture's own: last-token 8, "
    "context 64]. Padded with zeros (context: a multiple of 64, queries rescaled); the "
    "export's logits are then proven equal to the original's, or it is refused.",
)
@click.option(
    "--heads",
    is_flag=True,
    help="Also build what vLLM's eagle, eagle3, dflash, medusa and mtp methods load, each "
    "checked before it is written: DIRECTORY/eagle, DIRECTORY/eagle3, DIRECTORY/dflash and "
    "DIRECTORY/medusa (the --speculative-config model), DIRECTORY/mtp (the target with an MTP "
    "layer, served in place of DIRECTORY/target). vLLM's CPU attention takes head sizes 32 "
    "to 512 (--head-size).",
)
@json_option
def export_cmd(
    directory: Path, fmt: str, fixture_kind: str | None, fixture: Path | None,
    head_size: int | None, heads: bool, as_json: bool,
) -> None:  # fmt: skip
    """Write the fixture as Hugging Face folders into DIRECTORY and prove them: transformers'
    logits on the prompt and every continuation of up to three letters equal the original
    GGUF's, and their probabilities the closed form within 1e-5, before anyone samples."""
    from specaudit.fixtures import hf

    del fmt  # one format so far
    ex = hf.export_fixture(
        directory,
        fixture=fixture,
        kind=fixture_kind,  # type: ignore[arg-type]  # a FIXTURE_KINDS value, checked by click
        head_size=head_size,
    )
    built: dict[str, Path] = {}
    if heads:
        from specaudit.fixtures import hf_heads

        built = hf_heads.export_heads(ex)
    row = {
        "dir": ex.dir,
        "format": hf.FORMAT,
        "kind": ex.spec.kind,
        "name": ex.spec.name,
        "target": ex.target,
        "draft": ex.draft,
        "manifest": ex.manifest,
        "head_size": ex.head_size,
        "source_head_size": ex.source_head_size,
        "exact": ex.exact,
        "bitwise": ex.bitwise,
        "logits_max_diff": ex.logits_max_diff,
        "max_abs_diff": ex.max_abs_diff,
        "truth_tolerance": hf.TRUTH_TOLERANCE,
        "prefixes": ex.prefixes,
        "files": dict(ex.files),
        "heads": built,
    }
    if as_json:
        emit_json(row)
        return
    out.print(f"target: {ex.target}\ndraft: {ex.draft}\nmanifest: {ex.manifest}", highlight=False)
    same = "bitwise equal" if ex.bitwise else f"max |diff| {ex.logits_max_diff:.3g}"
    out.print(
        f"{ex.spec.kind} fixture {ex.spec.name}, head size {ex.head_size} (own "
        f"{ex.source_head_size}); on {ex.prefixes} prefixes: logits vs the GGUF's {same}; "
        f"max |p - closed form| {ex.max_abs_diff:.3g} (tolerance {hf.TRUTH_TOLERANCE:g})",
        highlight=False,
    )
    for method, folder in built.items():
        out.print(f"vLLM {method}: {folder}", highlight=False)
