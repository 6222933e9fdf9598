"""Session-scoped real llama-servers for the integration tests.

Like llama.cpp's own tools/server/tests: the binaries are built (or taken from the cache) once
per session and each named server is started at most once, on first use, and stopped at the
end of the session. Nothing here is ever skipped for lack of a binary: a missing build is
built. Environment:

- ``SPECAUDIT_LLAMA_BIN``: use an existing llama.cpp ``bin/`` instead of building b11434.
- ``SPECAUDIT_TEST_URL_<NAME>`` (NAME upper-cased, dashes as underscores, e.g.
  ``SPECAUDIT_TEST_URL_FIXTURE_SPEC``): point the suite at an external server for that role.

Servers of no preset (a mutant or a patched build on some path, the mtp and replay fixtures)
come from `shared_servers`: each configuration, too, starts once per session. A test starts a
server of its own only when it needs the process itself (it kills or stops it, tests a start-up
failure or the process's lifecycle) or a fresh one (drafter state kept per slot across
requests: the n-gram types but ngram-mod).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from litellm_helpers import extra_server
from shared_servers import SharedServers
from specaudit import audit, distribution, fixtures, llama
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import Patch, resolve_all

if TYPE_CHECKING:
    from specaudit.fixtures.hf import HfExport
    from specaudit.vllm.env import VllmEnv
    from specaudit.vllm.server import VllmServer


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
def replay_fixture(audit_ctx: audit.AuditContext) -> fixtures.FixtureSet:
    """The replay fixture (`fixtures.replay_spec`: the last-token fixture with a Mamba target,
    whose rejected drafts llama-server undoes by a checkpoint restore and replay): the audit
    context's, built once for the session."""
    return audit_ctx.replay_fixture


@pytest.fixture(scope="session")
def fixture_of_kind(
    audit_ctx: audit.AuditContext,
    replay_fixture: fixtures.FixtureSet,
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[fixtures.FixtureKind], fixtures.FixtureSet]:
    """``fixture_of_kind("mtp")`` -> the session's fixture set of that kind (`fixtures.KINDS`),
    built once: the audit context's last-token, context and mtp fixtures, `replay_fixture`, and
    the others on first use."""
    built: dict[str, fixtures.FixtureSet] = {"replay": replay_fixture}

    def get(kind: fixtures.FixtureKind) -> fixtures.FixtureSet:
        if kind == "last-token":
            return audit_ctx.fixture
        if kind == "context":
            return audit_ctx.context_fixture
        if kind == "mtp":
            return audit_ctx.mtp_fixture
        if kind not in built:
            built[kind] = fixtures.build(tmp_path_factory.mktemp(f"fixture-{kind}"), kind=kind)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def shared_servers(
    audit_ctx: audit.AuditContext, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedServers]:
    """Fixture servers for any binaries, fixture and path, and Gemma speculating on any
    binaries, each configuration started once (tests/shared_servers.py)."""
    with contextlib.ExitStack() as stack:
        yield SharedServers(audit_ctx, stack, tmp_path_factory.mktemp("shared-servers"))


@pytest.fixture(scope="session")
def dist_section(audit_ctx: audit.AuditContext) -> audit.Section:
    """The audit's dist section, run once: every path of the session's llama fixture servers
    and the MTP paths, 1000 seeds each (`audit.sections.dist`). Its results are the 1000-seed
    results of those servers for every test (`dist_result`): sampling them again gave the same
    samples, seed for seed, at the cost of another 1000 requests."""
    from specaudit.audit.sections import dist

    return dist.section(audit_ctx)


_DIST_KEYS = {"fixture": "dist", "fixture-context": "dist_context", "fixture-mtp": "dist_mtp"}


@pytest.fixture(scope="session")
def dist_result(dist_section: audit.Section) -> Callable[[str, str], distribution.EngineResult]:
    """``dist_result("fixture-context", "rejection")`` -> the dist section's result of the
    session's server of that model (`presets.MODELS`: fixture, fixture-context, fixture-mtp)
    and path: `distribution.measure` of a `distribution.ServerEngine` on it, seeds 1..1000,
    the fixture's default workload, the default alpha and tolerance."""

    def get(model: str, path: str) -> distribution.EngineResult:
        res = dist_section.data[_DIST_KEYS[model]]
        (e,) = [e for e in res.engines if e.path == path]
        return e

    return get


@pytest.fixture(scope="session")
def fixture_spec_b(audit_ctx: audit.AuditContext, llama_bins: LlamaBinaries) -> Iterator[str]:
    """A second "fixture-spec" process (its URL): the second speculating deployment of the
    LiteLLM tests' model groups, which none of them stops."""
    with extra_server(audit_ctx, llama_bins, "fixture-spec", "fixture-spec-b") as srv:
        yield srv.url


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


# vLLM (its CPU build): one plain and one n-gram-speculating server for the whole session, on
# the default fixture exported as `dist --engine vllm` exports and serves it (`vllm_export`,
# `dist.vllm.server_args`), each started by the first test that asks for it and stopped at the
# session's end. A start costs minutes of a 2-core machine (two processes importing torch), so
# the files that use them (test_vllm_server.py; test_dist_vllm.py, which samples them through
# `dist --vllm-url`) share an xdist worker (`suite_order.SHARED_SESSION_GROUPS`). A test that
# needs the process itself (its stop, what it leaves running) starts its own: `dist --engine
# vllm --vllm-method` does (test_dist_vllm.py).


@pytest.fixture(scope="session")
def vllm_env() -> VllmEnv:
    """The vLLM env, found by its stamp after ``python -m specaudit.vllm install`` (built here
    otherwise: never skipped)."""
    from specaudit.vllm.env import ensure_env

    return ensure_env()


@pytest.fixture(scope="session")
def vllm_export(tmp_path_factory: pytest.TempPathFactory) -> HfExport:
    """The default (last-token) fixture exported as Hugging Face folders at vLLM's smallest CPU
    head size, as `dist --engine vllm` exports it (proven by the export)."""
    from specaudit.distribution.vllm import MIN_HEAD_SIZE
    from specaudit.fixtures import hf

    fs = fixtures.build(tmp_path_factory.mktemp("vllm-fixture"), kind="last-token")
    return hf.export_hf(fs, tmp_path_factory.mktemp("vllm-export"), head_size=MIN_HEAD_SIZE)


def _vllm_server(
    env: VllmEnv, ex: HfExport, method: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    from specaudit.distribution import vllm as dv
    from specaudit.vllm.server import VllmServer

    log = tmp_path_factory.mktemp(f"vllm-{method}") / "vllm.log"
    spec = dv.speculative_config(method, ex.draft)
    with VllmServer(
        env, ex.target, speculative=spec, log_path=log, **dv.server_args(ex.spec)
    ) as srv:
        yield srv


@pytest.fixture(scope="session")
def vllm_plain(
    vllm_env: VllmEnv, vllm_export: HfExport, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    yield from _vllm_server(vllm_env, vllm_export, "plain", tmp_path_factory)


@pytest.fixture(scope="session")
def vllm_ngram(
    vllm_env: VllmEnv, vllm_export: HfExport, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    yield from _vllm_server(vllm_env, vllm_export, "ngram", tmp_path_factory)
