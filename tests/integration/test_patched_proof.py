"""Issue 7's proof, by specaudit's own instruments, against the real patched llama-server.

The per-token equality with the plain server is in test_patch_equality.py; here `check`,
`ab` and `dist` judge the patched speculating server exactly as they judge the stock one.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shared_servers import SharedServers
from specaudit import ab, check, distribution, fixtures
from specaudit.audit import AuditContext
from specaudit.audit.sections import patched
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer
from specaudit.stats import Verdict

CliFn = Callable[..., tuple[int, str, str]]


def _url(server: Callable[[str], Any], name: str) -> str:
    return str(server(name).url)


def test_check_exits_0_on_every_endpoint_of_the_patched_fixture_server(
    server: Callable[[str], Any], fixture_set: fixtures.FixtureSet, cli: CliFn
) -> None:
    url = _url(server, "fixture-spec-patched")
    code, out, err = cli("check", url, "--prompt", fixture_set.spec.prompt, "--json")
    assert code == 0, out[-3000:] + err[-1000:]
    data = json.loads(out)
    assert data["verdict"] == "real"
    eps = data["endpoints"]
    # all four request kinds, streamed and not, answered with real values only
    assert {(e["kind"], e["stream"]) for e in eps if e["status"] == "ok"} == {
        (k, s) for k in check.PROBE_KINDS for s in (False, True)
    }
    assert all(e["placeholder"] == 0 and e["real"] > 0 for e in eps)
    # and it really speculated while doing so
    assert data["speculation"]["state"] == "yes"
    assert (data["speculation"]["draft_n"] or 0) > 0


SPECULATIVE_PATHS = [p for p in presets.PATHS if p != "plain"]


def _fixture_kind(path: str) -> fixtures.FixtureKind:
    """The fixture a path runs on: the mtp and replay fixtures for theirs, else the default."""
    if path in presets.MTP_PATHS:
        return "mtp"
    if path in presets.REPLAY_PATHS:
        return "replay"
    return "last-token"


# The n-gram drafters that keep state across requests (per slot, or ngram-mod's pool shared by
# the slots: docs/dist.md): their servers are fresh, not the session's, whose drafters have
# served other tests (a map type's rejected key drafts no more in its slot)
STATEFUL_DRAFTERS = ("ngram", "ngram-map-k", "ngram-map-k4v", "ngram-cache")


@contextlib.contextmanager
def _server(
    shared_servers: SharedServers,
    bins: LlamaBinaries,
    fs: fixtures.FixtureSet,
    path: str,
    log_dir: Path,
) -> Iterator[LlamaServer]:
    """A fresh server for a stateful drafter (stopped on exit), else the session's."""
    if path not in STATEFUL_DRAFTERS:
        yield shared_servers.fixture(bins, fs, path)
        return
    log_dir.mkdir()
    with distribution.spawn_server(bins, fs, path=path, log_dir=log_dir) as srv:
        yield srv


@pytest.mark.parametrize("path", SPECULATIVE_PATHS)
def test_check_flags_stock_and_passes_patched_on_every_speculative_path(
    path: str,
    llama_bins: LlamaBinaries,
    patched_bins: LlamaBinaries,
    fixture_of_kind: Callable[[fixtures.FixtureKind], fixtures.FixtureSet],
    shared_servers: SharedServers,
    cli: CliFn,
    tmp_path: Path,
) -> None:
    """`check` on a stock and a patched server of each verification path (the draft model
    greedy and probabilistic, each n-gram type, EAGLE3, MTP greedy and probabilistic,
    checkpoint replay greedy and probabilistic): stock returns placeholders (exit 1), patched
    only real values on every endpoint, streamed and not (exit 0), both while drafting. The
    n-gram drafters with state across requests get fresh servers (`STATEFUL_DRAFTERS`), the
    other paths the session's (`shared_servers`)."""
    fs = fixture_of_kind(_fixture_kind(path))
    seen: dict[str, tuple[int, int, int, int]] = {}
    for variant, bins in (("stock", llama_bins), ("patched", patched_bins)):
        with _server(shared_servers, bins, fs, path, tmp_path / variant) as srv:
            code, out, err = cli("check", srv.url, "--prompt", fs.spec.prompt, "--json")
        assert code in (0, 1), err[-2000:]
        data = json.loads(out)
        eps = [e for e in data["endpoints"] if e["status"] == "ok"]
        assert len(eps) == 2 * len(check.PROBE_KINDS), data["endpoints"]
        drafted = sum(e["draft_n"] or 0 for e in eps)
        seen[variant] = (code, sum(e["real"] for e in eps), data["placeholders"], drafted)
        assert data["speculation"]["state"] == "yes", (variant, data["speculation"])
        assert drafted > 0, f"{variant} {path} never drafted: nothing was checked under speculation"
    print(f"\ncheck on {path} (exit, real, placeholders, drafted): {seen}")
    stock_code, _, stock_ph, _ = seen["stock"]
    assert stock_code == 1 and stock_ph > 0, f"stock {path}: {seen['stock']}"
    patched_code, patched_real, patched_ph, _ = seen["patched"]
    assert patched_code == 0 and patched_ph == 0 and patched_real > 0, f"patched {path}"


@pytest.mark.gemma
def test_check_on_patched_gemma_chat_is_real(server: Callable[[str], Any]) -> None:
    stock = check.run(_url(server, "gemma-spec"), endpoint="chat", tokens=24)
    patched = check.run(_url(server, "gemma-spec-patched"), endpoint="chat", tokens=24)
    assert stock.exit_code == 1 and stock.placeholders > 0
    assert patched.exit_code == 0 and patched.placeholders == 0
    assert (patched.speculation.draft_n or 0) > 0


def test_ab_patched_spec_against_plain_is_consistent(
    server: Callable[[str], Any], fixture_set: fixtures.FixtureSet
) -> None:
    settings = ab.Settings(seeds=5, tokens=32, prompt=fixture_set.spec.prompt, endpoint="chat")
    res = ab.run(_url(server, "fixture-plain"), _url(server, "fixture-spec-patched"), settings)
    assert res.spec.coverage == 1.0 and res.plain.coverage == 1.0
    assert res.verdict.kind is ab.ABVerdict.CONSISTENT, res.verdict.message
    # consistent *while speculating*: a patched server that stopped drafting would pass above
    assert res.spec.speculative is True
    assert (res.spec.draft_n or 0) > 0 and (res.spec.draft_n_accepted or 0) > 0
    assert not res.plain.draft_n


def test_dist_on_the_patched_server_is_still_preserved(
    server: Callable[[str], Any], fixture_set: fixtures.FixtureSet
) -> None:
    spec = fixture_set.spec
    wl = distribution.make_workload(spec)
    eng = distribution.ServerEngine(
        _url(server, "fixture-spec-patched"), spec, wl, label="patched", kind="server-spec"
    )
    res = distribution.measure(eng, spec, wl, list(range(1, 1001)))
    assert res.verdict is Verdict.PRESERVED
    # preserved *while speculating*: every sample went through drafting and verification
    assert (res.drafted or 0) > 0 and (res.accepted or 0) > 0


@pytest.mark.gemma
def test_patched_audit_section(audit_ctx: AuditContext) -> None:
    sec = patched.section(audit_ctx)
    assert sec.status == "ok", sec.summary
    rows = sec.data["check"]
    assert len(rows) == len(patched.PAIRS)  # one row per pair: none left out of the checks
    assert all(r["stock"][1] > 0 and r["patched"][1] == 0 for r in rows)
    assert all(r["stock_exit"] == 1 and r["patched_exit"] == 0 for r in rows)
