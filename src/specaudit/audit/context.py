"""What every audit section gets: the shared run state, and the section record it returns.

The context provisions lazily (binaries, fixtures, Gemma) and starts each named server
(`specaudit.llama.presets.PRESETS`) at most once, on first use, for all sections; everything it
started is stopped when the audit ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specaudit import llama
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import Patch, resolve_all
from specaudit.llama.server import LlamaServer
from specaudit.outcome import Outcome

if TYPE_CHECKING:
    from specaudit.fixtures import FixtureSet

ProgressFn = Callable[[str], None]
EnsureFn = Callable[[int, tuple[Patch, ...]], LlamaBinaries]


@dataclass
class Section:
    """One part of the report, already rendered."""

    key: str
    title: str
    markdown: str  # the section body (tables, verdict lines, plot links)
    data: dict[str, Any] = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)
    status: Outcome = Outcome.OK  # FINDING: the audit found the fault it looks for
    summary: str = ""  # one line for the console
    error: str | None = None  # set when the section could not run (status NO_DECISION)


class AuditContext:
    """Shared state of one audit run: binaries, models, servers started on demand."""

    def __init__(
        self,
        out_dir: Path,
        build: int = llama.DEFAULT_BUILD,
        progress: ProgressFn | None = None,
        ensure_bins: EnsureFn | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.build = build
        self.progress: ProgressFn = progress or (lambda msg: None)
        self._ensure_bins: EnsureFn = ensure_bins or (lambda b, p: llama.ensure(b, p))
        self._stack = contextlib.ExitStack()
        self._servers: dict[str, LlamaServer] = {}
        self._bins: dict[str, LlamaBinaries] = {}
        self._fixture: FixtureSet | None = None
        self._context_fixture: FixtureSet | None = None
        self._mtp_fixture: FixtureSet | None = None
        self._replay_fixture: FixtureSet | None = None
        self._gemma: Path | None = None
        self.log_dir = out_dir / "logs"

    # provisioning ---------------------------------------------------------------------

    def binaries(self, variant: str = "stock") -> LlamaBinaries:
        if variant not in self._bins:
            patches = (presets.PATCH,) if variant == "patched" else ()
            if variant in (presets.SPECULATIVE_FIX, presets.REPLAY_FIX) or variant.startswith(
                "mutants/"
            ):
                patches = (variant,)  # a fix on its own, or a bundled mutant
            self.progress(f"llama.cpp b{self.build} {variant}")
            self._bins[variant] = self._ensure_bins(self.build, resolve_all(patches, self.build))
        return self._bins[variant]

    @property
    def binaries_used(self) -> dict[str, str]:
        """variant -> bin directory, for the report header."""
        return {k: str(v.bin_dir) for k, v in self._bins.items()}

    @property
    def fixture(self) -> FixtureSet:
        """The default fixture set, built once."""
        if self._fixture is None:
            from specaudit import fixtures

            self.progress("building fixtures")
            self._fixture = fixtures.build(self.out_dir / "fixtures")
        return self._fixture

    @property
    def context_fixture(self) -> FixtureSet:
        """The context-kind fixture set (`fixtures.context_spec`), built once."""
        if self._context_fixture is None:
            from specaudit import fixtures

            self.progress("building the context fixture")
            self._context_fixture = fixtures.build(
                self.out_dir / "fixtures-context", kind="context"
            )
        return self._context_fixture

    @property
    def mtp_fixture(self) -> FixtureSet:
        """The mtp-kind fixture set (`fixtures.mtp_spec`: a glm4moe with its own MTP layer, the
        model of the MTP paths), built once."""
        if self._mtp_fixture is None:
            from specaudit import fixtures

            self.progress("building the mtp fixture")
            self._mtp_fixture = fixtures.build(self.out_dir / "fixtures-mtp", kind="mtp")
        return self._mtp_fixture

    @property
    def replay_fixture(self) -> FixtureSet:
        """The replay-kind fixture set (`fixtures.replay_spec`: a Mamba target, whose rejected
        drafts llama-server undoes by a checkpoint restore and replay), built once."""
        if self._replay_fixture is None:
            from specaudit import fixtures

            self.progress("building the replay fixture")
            self._replay_fixture = fixtures.build(self.out_dir / "fixtures-replay", kind="replay")
        return self._replay_fixture

    @property
    def gemma(self) -> Path:
        if self._gemma is None:
            from specaudit.models import gemma_270m

            self.progress("assembling Gemma 3 270M")
            self._gemma = gemma_270m().path
        return self._gemma

    def _fixture_of(self, model: str) -> FixtureSet | None:
        if model == "fixture":
            return self.fixture
        if model == "fixture-context":
            return self.context_fixture
        if model == "fixture-mtp":
            return self.mtp_fixture
        if model == "fixture-replay":
            return self.replay_fixture
        return None

    def model_path(self, model: str) -> Path:
        fs = self._fixture_of(model)
        return Path(fs.target) if fs is not None else self.gemma

    def draft_path(self, model: str) -> Path:
        fs = self._fixture_of(model)
        return Path(fs.draft) if fs is not None else self.gemma

    def server(self, name: str) -> LlamaServer:
        """The named server (a `presets.PRESETS` key), started on first use and stopped when
        the audit ends."""
        if name in self._servers:
            return self._servers[name]
        preset = presets.PRESETS[name]
        bins = self.binaries(preset.variant)
        self.progress(f"starting {name}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        draft = self.draft_path(preset.model) if preset.uses_draft else None
        fs = self._fixture_of(preset.model)
        if preset.spec_type == "draft-eagle3" and fs is not None:
            from specaudit import fixtures

            draft = fixtures.eagle3_draft(fs)  # the fixture's EAGLE3 head, not draft.gguf
        block = {t: markov for t, markov in presets.BLOCK_DRAFT_PATHS.values()}
        if preset.spec_type in block and fs is not None:
            from specaudit import fixtures

            draft = fixtures.dflash_draft(fs, markov=block[preset.spec_type])
        srv = presets.for_preset(
            preset,
            bins,
            self.model_path(preset.model),
            draft,
            log_path=self.log_dir / f"{name}.log",
        )
        self._stack.enter_context(srv)
        self._servers[name] = srv
        return srv

    def close(self) -> None:
        self._stack.close()
        self._servers.clear()

    def __enter__(self) -> AuditContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["AuditContext", "EnsureFn", "ProgressFn", "Section"]
