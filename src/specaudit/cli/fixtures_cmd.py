"""`specaudit fixtures build DIR`: write the tiny GGUF fixtures and their manifest."""

from __future__ import annotations

from pathlib import Path

import click

from specaudit.cli.common import WRITABLE_DIR, emit_json, json_option, out
from specaudit.outcome import EXIT_CODES_HELP


@click.group("fixtures", epilog=EXIT_CODES_HELP)
def command() -> None:
    """Tiny GGUF models with exactly known next-token distributions."""


@command.command("build", epilog=EXIT_CODES_HELP)
@click.argument("directory", type=WRITABLE_DIR)
@json_option
def build_cmd(directory: Path, as_json: bool) -> None:
    """Write target.gguf, draft.gguf and manifest.json (with SHA-256s) into DIRECTORY."""
    from specaudit import fixtures

    fs = fixtures.build(directory)
    if as_json:
        emit_json(
            {
                "dir": fs.dir,
                "target": fs.target,
                "draft": fs.draft,
                "manifest": fs.manifest,
                "sha256": fs.sha256,
            }
        )
        return
    for name, sha in fs.sha256.items():
        out.print(f"{name}  {sha}", highlight=False)
    out.print(f"manifest: {fs.manifest}", highlight=False)
