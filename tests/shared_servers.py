"""Servers of the integration suite, each configuration started once per session.

`SharedServers` (the session fixture ``shared_servers`` in tests/integration/conftest.py) hands
out a fixture server for any binaries, fixture and verification path: the audit context's own
server when a `presets.PRESETS` role is that configuration (the one `server(...)` gives),
otherwise one it starts on first use and keeps for the session (a mutant, a patched build on a
path the presets run stock, the mtp-context and replay fixtures); and Gemma speculating with
itself on any binaries. Why: the same configuration used to be started afresh by every test
that used it, seconds each (Gemma more), though nothing the tests assert needed a fresh
process. A test that kills or stops its server, tests a start-up failure or the process's
lifecycle, or needs a server without drafter state from earlier requests (the n-gram types
that keep it per slot or per server) still starts its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from specaudit import distribution, fixtures
from specaudit.audit import AuditContext
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer


class SharedServers:
    """Fixture servers by (binaries, fixture, path) (`fixture`) and Gemma speculating with
    itself (`gemma_spec`), each started once, on first use, and stopped when the session
    ends. For tests that only send requests."""

    def __init__(self, ctx: AuditContext, stack: contextlib.ExitStack, log_root: Path) -> None:
        self._ctx, self._stack, self._log_root = ctx, stack, log_root
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
                self._servers[key] = self._stack.enter_context(make(log_dir))
        return self._servers[key]

    def _preset(self, bins: LlamaBinaries, fs: fixtures.FixtureSet, path: str) -> str | None:
        """The audit context's role that is exactly this server, if one is."""
        ctx = self._ctx
        session = {  # the audit context's fixture of each kind it has, and its model name
            "last-token": (lambda: ctx.fixture, "fixture"),
            "context": (lambda: ctx.context_fixture, "fixture-context"),
            "mtp": (lambda: ctx.mtp_fixture, "fixture-mtp"),
        }
        if fs.spec.kind not in session:
            return None
        fixture_of, model = session[fs.spec.kind]
        if fixture_of().dir != fs.dir:
            return None
        if bins == ctx.binaries("stock"):
            variant = "stock"
        elif bins.variant.startswith(f"{presets.PATCH}-") and bins == ctx.binaries("patched"):
            variant = "patched"
        else:
            return None
        for p in presets.PRESETS.values():
            if p.model == model and p.variant == variant and presets.path_of(p) == path:
                return p.name
        return None

    def fixture(
        self,
        bins: LlamaBinaries,
        fs: fixtures.FixtureSet,
        path: str,
        *,
        parallel: int = 4,
        env: Mapping[str, str] | None = None,
    ) -> LlamaServer:
        """A server like `distribution.spawn_server(bins, fs, path=path, parallel=parallel)`,
        started with `env` set: the audit context's server of that role if a preset is this
        configuration (4 slots, no `env`), else one of this pool's. Its log
        (`LlamaServer.log_path`) has every request any test sent it: a test reading the log
        counts what its own requests added."""
        env = dict(env or {})
        if path == "eagle3":
            parallel = 1  # whatever is asked (presets.for_preset), as the preset's
        slots = 1 if path == "eagle3" else presets.POLICIES["fixture"].parallel
        if not env and parallel == slots:
            role = self._preset(bins, fs, path)
            if role is not None:
                return self._ctx.server(role)
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
        """Gemma 3 270M as its own draft (the "gemma-spec" role; `draft_sampling` greedy or
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
