"""What every fixture kind's unit tests check of its files: a second build is byte-identical
and the set loads back as the same spec; the target's GGUF reader for the rest."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf

from specaudit import fixtures as fx


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rebuilt_identically(built: fx.FixtureSet, tmp_path: Path) -> gguf.GGUFReader:
    """Build `built`'s spec again under `tmp_path`: the same bytes in every file, the same
    spec loaded back. Returns a reader of the target."""
    again = fx.build(tmp_path / "again", built.spec)
    for name in (fx.TARGET_FILE, fx.DRAFT_FILE, fx.MANIFEST_FILE):
        assert sha256(built.dir / name) == sha256(again.dir / name), name
    loaded = fx.load(built.dir)
    assert loaded.spec == built.spec and loaded.spec.kind == built.spec.kind
    return gguf.GGUFReader(built.target)
