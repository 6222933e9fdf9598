"""`specaudit fixtures build DIR`: write the tiny GGUF fixtures and their manifest."""

from __future__ import annotations

from pathlib import Path

import click

from specaudit.cli.common import WRITABLE_DIR, emit_json, fixture_kind_option, json_option, out
from specaudit.outcome import EXIT_CODES_HELP


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
