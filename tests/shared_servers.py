"""Servers of the integration suite that no preset names, each configuration started once.

`SharedServers` (the session fixture ``shared_servers`` in conftest.py) holds the fixture servers
of a build and a path that no `presets.PRESETS` role has (a mutant, a patched build on a path
the presets run stock), and the other fixtures' (mtp, replay); Gemma speculating on a mutant's
binaries. Why: the same configuration was started afresh by every test that used it, a few
seconds each (Gemma more), though nothing in it depended on a fresh process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from specaudit import distribution, fixtures
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer


class SharedServers:
    """Servers beyond the named presets, each configuration started once per session (on first
    use) and stopped at its end: a fixture server on a verification path with any binaries
    (`fixture`), Gemma speculating with itself (`gemma_spec`). For tests that only send
    requests: a test that kills a server, or needs one without per-slot drafter state from
    earlier requests, starts its own."""

    def __init__(self, stack: contextlib.ExitStack, log_root: Path) -> None:
        self._stack, self._log_root = stack, log_root
        self._servers: dict[tuple[object, ...], LlamaServer] = {}

    def _start(
        self,
        key: tuple[object, ...],
        env: Mapping[str, str],
        make: Callable[[Path], contextlib.AbstractContextManager[LlamaServer]],
    ) -> LlamaServer:
        if key not in self._servers:
            log_dir = self._log_root / f"{len(self._servers):03d}"
            log_dir.mkdir(parents=True)
            with pytest.MonkeyPatch.context() as mp:
                for k, v in env.items():  # the server inherits them at start
                    mp.setenv(k, v)
                srv = self._stack.enter_context(make(log_dir))
            self._servers[key] = srv
        return self._servers[key]

    def fixture(
        self,
        bins: LlamaBinaries,
        fs: fixtures.FixtureSet,
        path: str,
        *,
        parallel: int = 4,
        env: Mapping[str, str] | None = None,
    ) -> LlamaServer:
        """`distribution.spawn_server(bins, fs, path=path, parallel=parallel)`, started with
        `env` set; its log is `LlamaServer.log_path` (`dist-<path>.log`), shared by every test
        that uses the server (a test reading it counts what its own requests added)."""
        env = dict(env or {})
        key = (
            "fixture",
            str(bins.bin_dir),
            str(fs.dir),
            path,
            parallel,
            tuple(sorted(env.items())),
        )
        return self._start(
            key,
            env,
            lambda log_dir: distribution.spawn_server(
                bins, fs, path=path, parallel=parallel, log_dir=log_dir
            ),
        )

    def gemma_spec(self, bins: LlamaBinaries, gemma: Path, draft_sampling: str) -> LlamaServer:
        """Gemma 3 270M as its own draft (the "gemma-spec" role, `draft_sampling` greedy or
        probabilistic) on `bins`."""
        preset = presets.Preset(
            f"gemma-spec-{draft_sampling}", "gemma", True, draft_sampling=draft_sampling
        )
        key = ("gemma-spec", str(bins.bin_dir), str(gemma), draft_sampling)
        return self._start(
            key,
            {},
            lambda log_dir: presets.for_preset(
                preset, bins, gemma, gemma, log_path=log_dir / f"{preset.name}.log"
            ),
        )


__all__ = ["SharedServers"]
