"""Session-scoped real llama-servers for the integration tests.

Like llama.cpp's own tools/server/tests: the binaries are built (or taken from the cache) once
per session and each named server is started at most once, on first use, and stopped at the
end of the session. Nothing here is ever skipped for lack of a binary: a missing build is
built. Environment:

- ``SPECAUDIT_LLAMA_BIN``: use an existing llama.cpp ``bin/`` instead of building b11434.
- ``SPECAUDIT_TEST_URL_<NAME>`` (NAME upper-cased, dashes as underscores, e.g.
  ``SPECAUDIT_TEST_URL_FIXTURE_SPEC``): point the suite at an external server for that role.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from specaudit import audit, fixtures, llama
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import Patch, resolve_all


@dataclass(frozen=True)
class ServerHandle:
    """What a test needs of a server: where it is, and how it was started (if by us)."""

    name: str
    url: str
    model: str  # "fixture" or "gemma"
    speculative: bool
    spec_type: str | None
    external: bool = False


def _progress(pct: float, msg: str) -> None:
    print(f"[specaudit] building llama.cpp: {pct:3.0f}% {msg[-70:]}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def llama_bins() -> LlamaBinaries:
    return llama.ensure(progress=_progress)


@pytest.fixture(scope="session")
def patched_bins(llama_bins: LlamaBinaries) -> LlamaBinaries:
    return llama.ensure(patches=resolve_all((presets.PATCH,)), progress=_progress)


@pytest.fixture(scope="session")
def audit_ctx(
    tmp_path_factory: pytest.TempPathFactory, llama_bins: LlamaBinaries
) -> Iterator[audit.AuditContext]:
    """One AuditContext for the whole session: its servers are started once, on demand."""
    out = tmp_path_factory.mktemp("audit")

    def ensure(build: int, patches: tuple[Patch, ...]) -> LlamaBinaries:
        return llama_bins if not patches else llama.ensure(build, patches, progress=_progress)

    with audit.AuditContext(out, ensure_bins=ensure) as ctx:
        yield ctx


@pytest.fixture(scope="session")
def fixture_set(audit_ctx: audit.AuditContext) -> fixtures.FixtureSet:
    return audit_ctx.fixture


@pytest.fixture(scope="session")
def replay_fixture(tmp_path_factory: pytest.TempPathFactory) -> fixtures.FixtureSet:
    """The replay fixture (`fixtures.replay_spec`: the last-token fixture with a Mamba target,
    whose rejected drafts llama-server undoes by a checkpoint restore and replay), built once
    for the session."""
    return fixtures.build(tmp_path_factory.mktemp("replay"), kind="replay")


@pytest.fixture(scope="session")
def gemma_path(audit_ctx: audit.AuditContext) -> Path:
    return audit_ctx.gemma


@pytest.fixture(scope="session")
def server(audit_ctx: audit.AuditContext) -> Callable[[str], ServerHandle]:
    """``server("fixture-spec")`` -> a running server of that role (see presets.PRESETS)."""

    def get(name: str) -> ServerHandle:
        spec = presets.PRESETS[name]
        env = os.environ.get("SPECAUDIT_TEST_URL_" + name.upper().replace("-", "_"))
        if env:
            return ServerHandle(
                name,
                env,
                spec.model,
                spec.speculative,
                spec.spec_type if spec.speculative else None,
                external=True,
            )
        srv = audit_ctx.server(name)
        return ServerHandle(name, srv.url, spec.model, spec.speculative, srv.spec_type)

    return get
