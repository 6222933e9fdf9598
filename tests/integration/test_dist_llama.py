"""`specaudit dist` against real llama.cpp binaries on fixtures (fixed seeds: deterministic).

The report's result, reproduced: llama-server keeps the target distribution with and without
a draft model; llama.cpp's llama-speculative example does not. Then the same verdicts on a
second fixture with other numbers, built here, served by this module's own servers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from specaudit import audit, dist, fixtures
from specaudit.audit.sections import dist as dist_section
from specaudit.llama.build import LlamaBinaries
from specaudit.stats import Verdict

CliFn = Callable[..., tuple[int, str, str]]
SERVER_SEEDS = range(1, 1001)  # the report's 1000 seeds
EXAMPLE_SEEDS = range(1, 301)  # the example's bias is gross: 300 runs are plenty


def _server_result(url: str, fs: fixtures.FixtureSet, kind: str) -> dist.EngineResult:
    wl = dist.make_workload(fs.spec)
    eng = dist.ServerEngine(url, fs.spec, wl, label=kind, kind=kind)
    return dist.measure(eng, fs.spec, wl, SERVER_SEEDS)


def _example_result(bins: LlamaBinaries, fs: fixtures.FixtureSet) -> dist.EngineResult:
    wl = dist.make_workload(fs.spec)
    eng = dist.ExampleEngine(bins.speculative, fs.target, fs.draft, fs.spec, wl)
    return dist.measure(eng, fs.spec, wl, EXAMPLE_SEEDS)


# --------------------------------------------------------------------------------------------
# the default fixture (the report's): session servers from conftest


def test_server_without_draft_preserves(server: Callable, fixture_set: fixtures.FixtureSet) -> None:
    res = _server_result(server("fixture-plain").url, fixture_set, "server-plain")
    assert res.verdict is Verdict.PRESERVED, res.reason
    assert res.n_samples == 1000
    assert res.drafted is None  # no draft, no draft counts
    after_f = {r.token: r for r in res.headline[1].tokens}
    assert set(after_f) == {"e", "g", "h"}  # top-k 3 after f: nothing else ever sampled
    assert after_f["g"].expected == pytest.approx(0.452, abs=1e-6)


def test_server_with_draft_preserves(server: Callable, fixture_set: fixtures.FixtureSet) -> None:
    res = _server_result(server("fixture-spec").url, fixture_set, "server-spec")
    assert res.verdict is Verdict.PRESERVED, res.reason
    # speculation really happened: the server drafted and accepted tokens
    assert res.drafted is not None and res.drafted > 1000
    assert res.accepted is not None and 0 < res.accepted < res.drafted


def test_speculative_example_is_broken(
    llama_bins: LlamaBinaries, fixture_set: fixtures.FixtureSet
) -> None:
    res = _example_result(llama_bins, fixture_set)
    assert res.verdict is Verdict.BROKEN, res.reason
    pos2 = next(t for t in res.tests if t.name == "position 2")
    assert pos2.rejected and pos2.gof.p_value < 1e-10
    after_f = {r.token: r for r in res.headline[1].tokens}
    assert after_f["e"].frequency > after_f["e"].expected + 0.2  # it favours the draft's pick


def test_sequential_flags_the_example_within_50_samples(
    llama_bins: LlamaBinaries, fixture_set: fixtures.FixtureSet
) -> None:
    wl = dist.make_workload(fixture_set.spec)
    eng = dist.ExampleEngine(
        llama_bins.speculative, fixture_set.target, fixture_set.draft, fixture_set.spec, wl
    )
    res = dist.measure(eng, fixture_set.spec, wl, range(1, 501), alpha=1e-3, sequential=True)
    assert res.verdict is Verdict.BROKEN
    assert res.sequential is not None and res.sequential.decided_by == "e-value"
    assert res.sequential.samples_used <= 50
    assert res.n_samples == res.sequential.samples_used


def test_cli_url_engine_json_and_plot(
    server: Callable, fixture_set: fixtures.FixtureSet, tmp_path: Path, cli: CliFn
) -> None:
    png = tmp_path / "dist.png"
    url = server("fixture-spec").url
    code, out, err = cli(
        "dist", "--engine", "url", "--url", url, "--fixture", str(fixture_set.dir),
        "--seeds", "300", "--tolerance", "0.3", "--plot", str(png), "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    (eng,) = data["engines"]
    assert eng["verdict"] == "PRESERVED"
    assert eng["n_samples"] == 300 and eng["drafted"] > 0
    assert {t["name"] for t in eng["tests"]} >= {"position 1", "joint 1-3"}
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_audit_section(audit_ctx: audit.AuditContext) -> None:
    sec = dist_section.section(audit_ctx)
    res = sec.data["dist"]
    verdicts = {e.kind: e.verdict for e in res.engines}
    assert verdicts == {
        "server-plain": Verdict.PRESERVED,
        "server-spec": Verdict.PRESERVED,
        "speculative-example": Verdict.BROKEN,
    }
    assert sec.status == "finding"
    assert sec.plots and sec.plots[0].is_file()
    assert "drafted" in sec.markdown and "p (Holm)" in sec.markdown


# --------------------------------------------------------------------------------------------
# a second fixture with other numbers, built here, with this module's own servers


@pytest.fixture(scope="module")
def other_fixture(tmp_path_factory: pytest.TempPathFactory) -> fixtures.FixtureSet:
    fs = fixtures.build(tmp_path_factory.mktemp("dist-other"), fixtures.other_spec())
    assert fs.spec.target != fixtures.default_spec().target
    return fixtures.load(fs.dir)  # and through the SHA-checking loader, as the CLI does


@pytest.fixture(scope="module")
def other_servers(
    llama_bins: LlamaBinaries, other_fixture: fixtures.FixtureSet
) -> Iterator[dict[str, str]]:
    with (
        dist.spawn_server(llama_bins, other_fixture, draft=False) as plain,
        dist.spawn_server(llama_bins, other_fixture, draft=True) as spec,
    ):
        yield {"plain": plain.url, "spec": spec.url}


def test_other_fixture_server_without_draft_preserves(
    other_servers: dict[str, str], other_fixture: fixtures.FixtureSet
) -> None:
    res = _server_result(other_servers["plain"], other_fixture, "server-plain")
    assert res.verdict is Verdict.PRESERVED, res.reason


def test_other_fixture_server_with_draft_preserves(
    other_servers: dict[str, str], other_fixture: fixtures.FixtureSet
) -> None:
    res = _server_result(other_servers["spec"], other_fixture, "server-spec")
    assert res.verdict is Verdict.PRESERVED, res.reason
    # speculation really happened: the server drafted and accepted tokens
    assert res.drafted is not None and res.drafted > 1000
    assert res.accepted is not None and res.accepted > 0


def test_other_fixture_speculative_example_is_broken(
    llama_bins: LlamaBinaries, other_fixture: fixtures.FixtureSet
) -> None:
    res = _example_result(llama_bins, other_fixture)
    assert res.verdict is Verdict.BROKEN, res.reason
