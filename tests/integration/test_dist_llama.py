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

from specaudit import audit, distribution, fixtures
from specaudit.audit import runner
from specaudit.distribution.coverage import kind_paths
from specaudit.llama.build import LlamaBinaries
from specaudit.stats import Verdict

CliFn = Callable[..., tuple[int, str, str]]
DistResultFn = Callable[[str, str], distribution.EngineResult]
SERVER_SEEDS = range(1, 1001)  # the report's 1000 seeds
EXAMPLE_SEEDS = range(1, 301)  # the example's bias is gross: 300 runs are plenty


def _server_result(url: str, fs: fixtures.FixtureSet, kind: str) -> distribution.EngineResult:
    wl = distribution.make_workload(fs.spec)
    eng = distribution.ServerEngine(url, fs.spec, wl, label=kind, kind=kind)
    return distribution.measure(eng, fs.spec, wl, SERVER_SEEDS)


def _example_result(bins: LlamaBinaries, fs: fixtures.FixtureSet) -> distribution.EngineResult:
    wl = distribution.make_workload(fs.spec)
    eng = distribution.ExampleEngine(bins.speculative, fs.target, fs.draft, fs.spec, wl)
    return distribution.measure(eng, fs.spec, wl, EXAMPLE_SEEDS)


# --------------------------------------------------------------------------------------------
# the default fixture (the report's): session servers from conftest, their 1000-seed results
# the audit's dist section's (`dist_result`)


def test_server_without_draft_preserves(dist_result: DistResultFn) -> None:
    res = dist_result("fixture", "plain")
    assert res.verdict is Verdict.PRESERVED, res.reason
    assert res.n_samples == 1000
    assert res.drafted is None  # no draft, no draft counts
    after_f = {r.token: r for r in res.headline[1].tokens}
    assert set(after_f) == {"e", "g", "h"}  # top-k 3 after f: nothing else ever sampled
    assert after_f["g"].expected == pytest.approx(0.452, abs=1e-6)


def test_server_with_draft_preserves(dist_result: DistResultFn) -> None:
    res = dist_result("fixture", "greedy")
    assert res.verdict is Verdict.PRESERVED, res.reason
    # speculation really happened: the server drafted and accepted tokens
    assert res.drafted is not None and res.drafted > 1000
    assert res.accepted is not None and 0 < res.accepted < res.drafted


def test_speculative_example_is_broken(dist_section: audit.Section) -> None:
    # llama-speculative on seeds 1..1000: the audit's dist section's run (300 were plenty)
    (res,) = [e for e in dist_section.data["dist"].engines if e.kind == "speculative-example"]
    assert res.verdict is Verdict.BROKEN, res.reason
    pos2 = next(t for t in res.tests if t.name == "position 2")
    assert pos2.rejected and pos2.gof.p_value < 1e-10
    after_f = {r.token: r for r in res.headline[1].tokens}
    assert after_f["e"].frequency > after_f["e"].expected + 0.2  # it favours the draft's pick


def test_sequential_flags_the_example_within_50_samples(
    llama_bins: LlamaBinaries, fixture_set: fixtures.FixtureSet
) -> None:
    wl = distribution.make_workload(fixture_set.spec)
    eng = distribution.ExampleEngine(
        llama_bins.speculative, fixture_set.target, fixture_set.draft, fixture_set.spec, wl
    )
    res = distribution.measure(
        eng, fixture_set.spec, wl, range(1, 501), alpha=1e-3, sequential=True
    )
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


def test_audit_section(audit_ctx: audit.AuditContext, dist_section: audit.Section) -> None:
    """Both fixtures on every path (plain, greedy, rejection, ngram), llama-speculative, and
    the mtp fixture on the MTP paths: stock llama-server PRESERVED on every path at the
    default 1000 seeds; every speculating path really drafted (the MTP ones with the fixture's
    own MTP layer); the example BROKEN; the paths no fixture covers listed."""
    sec = dist_section
    for key in ("dist", "dist_context"):  # last-token, context
        res = sec.data[key]
        servers = [e for e in res.engines if e.path is not None]
        assert [e.path for e in servers] == list(kind_paths("last-token")), key
        for e in servers:
            assert e.verdict is Verdict.PRESERVED, (key, e.path, e.reason)
            assert e.n_samples == 1000
            if e.path == "plain":
                assert e.drafted is None
            else:  # speculation on this path really happened
                assert e.drafted is not None and e.drafted > 0, (key, e.path)
                assert e.accepted is not None and e.accepted <= e.drafted, (key, e.path)
                # ngram-map-k/-k4v draft only a handful of times (a prompt key rejected once
                # drafts no more in its slot, docs/dist.md): those few may all be rejected
                if e.path not in ("ngram-map-k", "ngram-map-k4v"):
                    assert e.accepted > 0, (key, e.path)
        assert {p for p, _ in res.not_covered} >= {"synthetic"}
    res = sec.data["dist"]
    example = [e for e in res.engines if e.kind == "speculative-example"]
    assert len(example) == 1 and example[0].verdict is Verdict.BROKEN
    assert not any(e.kind == "speculative-example" for e in sec.data["dist_context"].engines)
    mtp = sec.data["dist_mtp"]
    assert mtp is not None and mtp.fixture == audit_ctx.mtp_fixture.spec.name
    assert [e.path for e in mtp.engines] == ["mtp", "mtp-rejection"]
    for e in mtp.engines:
        assert e.verdict is Verdict.PRESERVED, (e.path, e.reason)
        assert e.n_samples == 1000
        assert e.drafted is not None and e.accepted is not None, e.path
        assert e.drafted > 0 and 0 < e.accepted < e.drafted, e.path
        row = f"| {mtp.fixture} | {e.engine} | {e.path} | PRESERVED | 1000 | {e.drafted} |"
        assert row in sec.markdown, row
    # report.json carries the MTP rows' verdicts and counts
    rep = runner.AuditReport(audit_ctx.out_dir, [sec], started="", seconds=0.0, binaries={})
    (js,) = runner.to_json(rep)["sections"]
    got = [
        (e["path"], e["verdict"], e["drafted"], e["accepted"])
        for e in js["data"]["dist_mtp"]["engines"]
    ]
    assert got == [(e.path, "PRESERVED", e.drafted, e.accepted) for e in mtp.engines]
    assert sec.status == "finding"
    assert len(sec.plots) == 3 and all(p.is_file() for p in sec.plots)
    assert "drafted" in sec.markdown and "p (Holm)" in sec.markdown
    assert "| rejected |" in sec.markdown and "Not covered" in sec.markdown
    for path in (*kind_paths("last-token"), "mtp", "mtp-rejection"):
        assert f"| {path} |" in sec.markdown


def test_dist_run_server_every_path(
    llama_bins: LlamaBinaries, fixture_set: fixtures.FixtureSet, tmp_path: Path
) -> None:
    """The server engine: one llama-server per path, each row labelled with its path."""
    req = distribution.make_request(
        ["server"], fixture=fixture_set, binaries=llama_bins, work_dir=tmp_path
    )
    res = distribution.run(req)
    assert [e.path for e in res.engines] == list(kind_paths("last-token"))
    by_path = {e.path: e for e in res.engines}
    for e in res.engines:
        assert e.verdict is Verdict.PRESERVED, (e.path, e.reason)
    assert by_path["plain"].drafted is None
    for p in ("greedy", "rejection", "ngram"):
        e = by_path[p]
        assert e.drafted is not None and e.drafted > 0 and distribution.rejected(e) is not None, p
    # the rejection sampler accepts far more than sample-and-match (2257/1493 vs 2637/946)
    rej, greedy = by_path["rejection"], by_path["greedy"]
    assert rej.accepted is not None and greedy.accepted is not None and rej.drafted
    assert rej.accepted / rej.drafted > greedy.accepted / (greedy.drafted or 1)
    assert (tmp_path / "dist-ngram.log").is_file()
    assert res.not_covered and "synthetic" in {p for p, _ in res.not_covered}


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
        distribution.spawn_server(llama_bins, other_fixture, draft=False) as plain,
        distribution.spawn_server(llama_bins, other_fixture, draft=True) as spec,
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
