"""`dist`'s verification paths (issue 12, item 0) and the CLI plumbing: `--path`,
`--fixture-kind`, `fixtures build --kind`. No server runs: spawning and measuring are stubbed."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from closed_form import draw
from specaudit import distribution, fixtures, llama
from specaudit.cli import common, dist_cmd
from specaudit.distribution import coverage, runner, wording
from specaudit.llama import presets
from specaudit.llama.server import LlamaServer
from specaudit.stats import Verdict

CliFn = Callable[..., tuple[int, str, str]]
B = 11434
# b11434's n-gram drafters besides ngram-mod, each a path of its own
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache")
# every --spec-type of b11434 (common/speculative.cpp, common_speculative_type_from_str)
B11434_SPEC_TYPES = (
    "none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark",
    "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
)  # fmt: skip


def _one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ------------------------------------------------------------------------------- constants


def test_the_cli_spells_the_library_choices() -> None:
    assert common.FIXTURE_KINDS == fixtures.KINDS
    assert distribution.PATHS == presets.PATHS == (
        "plain", "greedy", "rejection", "ngram", *NGRAM_TYPES, "mtp", "mtp-rejection",
        "eagle3", "dflash", "dspark", "replay", "replay-rejection",
    )  # fmt: skip
    assert set(distribution.PATH_ENGINES) == set(distribution.PATHS) == set(distribution.PATH_HELP)


def test_every_path_has_a_role_on_both_fixtures() -> None:
    for model, kind in (
        ("fixture", "last-token"),
        ("fixture-context", "context"),
        ("fixture-mtp", "mtp"),
        ("fixture-replay", "replay"),
    ):
        for path in coverage.kind_paths(kind):
            role = presets.fixture_role(model, path)
            p = presets.PRESETS[role]
            assert p.model == model and presets.path_of(p) == path, role
    assert presets.PRESETS["fixture-spec-rejection"].extra_args == (
        "--spec-draft-sampling", "probabilistic",
    )  # fmt: skip
    ngram = presets.PRESETS["fixture-context-ngram"]
    assert ngram.spec_type == "ngram-mod" and not ngram.uses_draft
    assert ngram.extra_args == presets.FIXTURE_NGRAM_ARGS
    for model in ("fixture", "fixture-context"):
        for t in NGRAM_TYPES:
            p = presets.PRESETS[presets.fixture_role(model, t)]
            assert p.spec_type == t and not p.uses_draft and p.variant == "stock"
            assert p.extra_args == presets.NGRAM_TYPE_ARGS[t]
    with pytest.raises(ValueError, match="path must be one of"):
        presets.fixture_role("fixture", "medusa")
    for model in ("fixture", "fixture-context"):
        for path, t in (("dflash", "draft-dflash"), ("dspark", "draft-dspark")):
            p = presets.PRESETS[presets.fixture_role(model, path)]
            assert p.spec_type == t and p.uses_draft and p.extra_args == ()
    with pytest.raises(ValueError, match="does not run on"):
        presets.fixture_role("fixture-mtp", "dflash")
    with pytest.raises(ValueError, match="does not run on"):
        presets.fixture_role("fixture", "mtp")
    with pytest.raises(ValueError, match="does not run on"):
        presets.fixture_role("fixture-mtp", "greedy")
    mtp = presets.PRESETS["fixture-mtp-mtp-rejection"]
    assert mtp.uses_mtp and not mtp.uses_draft and mtp.spec_type == "draft-mtp"
    assert mtp.extra_args == ("--spec-draft-sampling", "probabilistic")
    with pytest.raises(ValueError, match="draft_sampling needs a draft"):
        presets.Preset("x", "fixture", False, draft_sampling="probabilistic")


# ------------------------------------------------------------------------------------ help


def test_dist_help_documents_the_paths(cli: CliFn) -> None:
    code, out, _ = cli("dist", "--help")
    assert code == 0
    assert "--path [plain|greedy|rejection|ngram|ngram-simple|ngram-map-k|" in out
    assert "--fixture-kind [last-token|context|mtp|mtp-context|mtp-attention|replay]" in out
    assert "Verification paths" in out and "Not covered" in out
    for p in distribution.PATHS:
        assert f"  {p} " in out
    for name in ("mtp", "replay", "synthetic", "eagle3"):
        assert name in out
    assert "rejection sampling" in out and "sample-and-match" in out


def test_fixtures_build_help_documents_the_kind(cli: CliFn) -> None:
    code, out, _ = cli("fixtures", "build", "--help")
    assert (
        code == 0
        and "--kind [last-token|context|mtp|mtp-context|mtp-attention|replay]" in out
        and "default: last-token" in out
    )


# ------------------------------------------------------------------------- option checking


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("--path", "medusa"), "'medusa' is not one of"),
        (("--fixture-kind", "mtp", "--path", "dspark"), "--path dspark needs a fixture of"),
        (("--fixture-kind", "mtp", "--path", "eagle3"), "--path eagle3 needs a fixture of"),
        (
            ("--path", "mtp"),
            "--path mtp needs an mtp fixture (--fixture-kind mtp, mtp-context or mtp-attention)",
        ),
        (("--fixture-kind", "mtp", "--path", "greedy"), "--path greedy needs a fixture of"),
        (("--path", "Greedy"), "is not one of"),
        (("--fixture-kind", "other"), "'other' is not one of"),
        (("--engine", "url", "--url", "http://127.0.0.1:9", "--path", "greedy"), "--path applies"),
        (
            ("--engine", "server", "--path", "rejection", "--temperature", "0"),
            "needs --temperature",
        ),
    ],
)
def test_bad_path_or_kind_is_one_error_line_before_any_build(
    args: tuple[str, ...], match: str, cli: CliFn, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path))

    def no_build(*a: Any, **k: Any) -> None:
        raise AssertionError("looked for binaries before checking the options")

    monkeypatch.setattr(llama, "find", no_build)
    monkeypatch.setattr(llama, "ensure", no_build)
    code, _, err = cli("dist", *args, "--seeds", "5")
    assert code == 2
    assert match in _one_error(err)


def test_fixture_kind_must_match_the_fixture_given(
    cli: CliFn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = fixtures.build(tmp_path / "fx")
    monkeypatch.setattr(llama, "find", lambda *a, **k: pytest.fail("no build expected"))
    code, _, err = cli(
        "dist", "--fixture", str(fs.dir), "--fixture-kind", "context", "--engine", "server"
    )
    assert code == 2 and "not 'context'" in _one_error(err)


def test_cli_passes_paths_and_fixture_kind_to_dist_run(
    cli: CliFn, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path))
    from specaudit.cli import dist_cmd

    seen: dict[str, Any] = {}

    def fake_run(req: distribution.DistRequest, **kw: Any) -> None:
        seen.update(
            engines=req.engines, fixture_kind=req.fixture_kind, paths=req.option("paths"),
            fixture=req.fixture, binaries=req.binaries,
        )  # fmt: skip
        raise distribution.DistError("stop here")

    fake_bins = llama.LlamaBinaries(bin_dir=tmp_path, build=B, variant="stock")
    monkeypatch.setattr(dist_cmd, "ensure_binaries", lambda **k: fake_bins)
    monkeypatch.setattr(distribution, "run", fake_run)
    code, _, err = cli(
        "dist", "--engine", "server", "--fixture-kind", "context",
        "--path", "greedy", "--path", "ngram", "--seeds", "5",
    )  # fmt: skip
    assert code == 2 and "stop here" in err
    assert seen["engines"] == ("server",)
    assert seen["fixture_kind"] == "context" and seen["paths"] == ("greedy", "ngram")
    assert seen["fixture"].spec.kind == "context" and seen["binaries"] is fake_bins
    seen.clear()
    code, _, _ = cli("dist", "--engine", "server", "--seeds", "5")
    assert seen["paths"] is None and seen["fixture_kind"] is None  # every path, last-token
    assert seen["fixture"].spec.kind == "last-token"


# --------------------------------------------------------------------- fixtures build --kind


def test_fixtures_build_kind(cli: CliFn, tmp_path: Path) -> None:
    code, out, err = cli("fixtures", "build", str(tmp_path / "c"), "--kind", "context", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["kind"] == "context"
    assert fixtures.load(tmp_path / "c").spec.kind == "context"
    code, out, err = cli("fixtures", "build", str(tmp_path / "d"), "--json")
    assert code == 0 and json.loads(out)["kind"] == "last-token"
    code, _, err = cli("fixtures", "build", str(tmp_path / "e"), "--kind", "nope")
    assert code == 2 and "'nope' is not one of" in err


# ------------------------------------------------------------------- dist.run, one per path


def _fake_servers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    started: list[tuple[str, list[str]]] = []

    def enter(self: LlamaServer) -> LlamaServer:
        started.append((self.name, self.argv()))
        return self

    monkeypatch.setattr(LlamaServer, "__enter__", enter)
    monkeypatch.setattr(LlamaServer, "__exit__", lambda self, *exc: None)
    return started


def _fake_measure(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    measured: list[tuple[str, str]] = []

    def fake(eng: Any, *a: Any, **k: Any) -> Any:
        measured.append((eng.label, eng.kind))
        return SimpleNamespace(engine=eng.label, kind=eng.kind, path=None)

    monkeypatch.setattr(runner, "measure", fake)
    return measured


def test_server_runs_one_server_per_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started = _fake_servers(monkeypatch)
    measured = _fake_measure(monkeypatch)
    bins = llama.LlamaBinaries(bin_dir=tmp_path, build=B, variant="stock")
    res = distribution.run(
        distribution.make_request(("server",), binaries=bins, work_dir=tmp_path, seeds=5)
    )
    assert [e.path for e in res.engines] == list(coverage.kind_paths("last-token"))
    assert [k for _, k in measured] == [
        "server-plain", "server-spec", "server-spec-rejection", "server-ngram",
        *(f"server-{t}" for t in NGRAM_TYPES), "server-eagle3", "server-dflash", "server-dspark",
    ]  # fmt: skip
    names = [n for n, _ in started]
    assert names == [
        "dist-plain", "dist-spec", "dist-spec-probabilistic", "dist-ngram",
        *(f"dist-{t}" for t in NGRAM_TYPES), "dist-eagle3", "dist-dflash", "dist-dspark",
    ]  # fmt: skip
    argv = {n: a for n, a in started}
    assert "--spec-type" not in argv["dist-plain"] and "-md" not in argv["dist-plain"]
    assert "-md" in argv["dist-spec"] and "--spec-draft-sampling" not in argv["dist-spec"]
    rej = argv["dist-spec-probabilistic"]
    assert rej[rej.index("--spec-draft-sampling") + 1] == "probabilistic" and "-md" in rej
    ng = argv["dist-ngram"]
    assert ng[ng.index("--spec-type") + 1] == "ngram-mod" and "-md" not in ng
    assert ng[ng.index("--spec-ngram-mod-n-match") + 1] == "1"
    # each n-gram type alone (one --spec-type: its draft counts are its own), with its flags
    for t in NGRAM_TYPES:
        a = argv[f"dist-{t}"]
        assert a[a.index("--spec-type") + 1] == t and "-md" not in a
        assert a.count("--spec-type") == 1 and "--spec-ngram-mod-n-match" not in a
        flags = presets.NGRAM_TYPE_ARGS[t]
        assert a[len(a) - len(flags) :] == list(flags), t
    assert argv["dist-ngram-map-k4v"][-2:] == ["--spec-ngram-map-k4v-min-hits", "1"]
    assert "synthetic" in {p for p, _ in res.not_covered}
    assert "replay" not in {p for p, _ in res.not_covered}  # the replay fixture covers it
    assert "rejection" not in {p for p, _ in res.not_covered}


def test_paths_pick_and_temperature_zero_drops_rejection(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_servers(monkeypatch)
    _fake_measure(monkeypatch)
    bins = llama.LlamaBinaries(bin_dir=tmp_path, build=B, variant="stock")
    req = distribution.make_request(
        ("server",), binaries=bins, work_dir=tmp_path, seeds=5, paths=("ngram",)
    )
    res = distribution.run(req)
    assert [e.path for e in res.engines] == ["ngram"]
    greedy = fixtures.SamplerSettings(top_k=3, top_p=1.0, min_p=0.0, temperature=0.0)
    req = distribution.make_request(
        ("server",), binaries=bins, work_dir=tmp_path, seeds=5, sampler=greedy
    )
    res = distribution.run(req)
    assert [e.path for e in res.engines] == [
        "plain", "greedy", "ngram", *NGRAM_TYPES, "eagle3", "dflash", "dspark",
    ]  # fmt: skip
    assert res.not_covered[0][0] == "rejection" and "temperature" in res.not_covered[0][1]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"paths": "greedy"}, "not one string"),
        ({"paths": ()}, "no --path given"),
        ({"paths": ("greedy", "medusa")}, "unknown --path 'medusa'"),
        ({"paths": ("greedy", "mtp")}, "--path mtp needs an mtp fixture"),
        ({"engines": ("url",), "url": "http://127.0.0.1:9", "paths": ("plain",)}, "server engine"),
    ],
)
def test_the_request_checks_paths(kw: dict[str, Any], match: str, tmp_path: Path) -> None:
    engines = kw.pop("engines", ("server",))
    with pytest.raises(distribution.DistError, match=match):
        distribution.make_request(engines, work_dir=tmp_path, seeds=5, **kw)


def test_spawn_server_path_and_legacy_keywords(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started = _fake_servers(monkeypatch)
    fs = runner.load_fixture(None, tmp_path, "context")
    bins = llama.LlamaBinaries(bin_dir=tmp_path, build=B, variant="stock")
    with distribution.spawn_server(bins, fs, path="ngram"):
        pass
    with distribution.spawn_server(bins, fs, draft=True, draft_sampling="probabilistic"):
        pass
    (n1, a1), (n2, a2) = started
    assert n1 == "dist-ngram" and "-ctk" in a1  # the context fixture's policy
    assert n2 == "dist-spec-probabilistic" and "--spec-draft-sampling" in a2
    with (
        pytest.raises(distribution.DistError, match="not both"),
        distribution.spawn_server(bins, fs, path="greedy", draft=True),
    ):
        pass
    with (
        pytest.raises(distribution.DistError, match="needs path"),
        distribution.spawn_server(bins, fs),
    ):
        pass


def test_rejected_and_the_paths_table() -> None:
    e = distribution.EngineResult(
        engine="x", kind="server-spec", verdict=Verdict.PRESERVED, alpha=0.01, tolerance=0.15,
        n_samples=10, first_seed=1, last_seed=10, drafted=7, accepted=3, tests=[], contexts=[],
        headline=[], impossible=0, reason="", seconds=1.0, path="greedy",
    )  # fmt: skip
    assert distribution.rejected(e) == 4
    wl = distribution.make_workload(fixtures.default_spec())
    res = distribution.DistResult(
        "x", Path("."), {}, wl, 0.01, 0.15, False, [e], not_covered=[("mtp", "needs MTP heads")]
    )
    md = distribution.paths_markdown(res)
    assert "| x | greedy | PRESERVED | 10 | 7 | 3 | 4 | too rarely |" in md
    assert "- `mtp`: needs MTP heads" in md


def test_a_preserved_path_whose_speculation_barely_ran_says_so_in_its_verdict() -> None:
    """A PRESERVED over a handful of drafts says the outputs kept the distribution, not that
    the path's accept and reject branches are right: the verdict's line says so, with the
    counts; a path drafted and rejected hundreds of times does not."""
    spec = fixtures.default_spec()
    wl = distribution.make_workload(spec)
    truth = distribution.Truth(spec, wl)
    drawn = draw(truth, 400, np.random.default_rng(3))

    def run(drafted: int, accepted: int) -> distribution.EngineResult:
        samples = [distribution.Sample(s.seed, s.text, drafted, accepted) for s in drawn]
        e = distribution.analyse(spec, wl, samples, engine="ngram-map-k", tolerance=0.9)
        e.path = "ngram-map-k"
        e.reason = wording.reason(e, wl, spec)
        return e

    # 400 samples and nothing drafted: as ngram-map-k on the fixture (3 drafted in 600 seeds)
    barely = run(drafted=0, accepted=0)
    assert barely.verdict is Verdict.PRESERVED
    assert "too rarely to certify the path: 0 drafted, 0 accepted, 0 rejected" in barely.reason
    assert coverage.exercised(barely) == "too rarely"
    # 3 drafted, 2 accepted per sample: 1200 / 800 / 400
    busy = run(drafted=3, accepted=2)
    assert "too rarely" not in busy.reason and coverage.exercised(busy) == "yes"
    # few accepted though many rejected: the accept branch barely ran
    rejecting = run(drafted=3, accepted=0)
    assert "1200 drafted, 0 accepted, 1200 rejected" in rejecting.reason
    # the plain path has nothing to exercise
    rejecting.path = "plain"
    assert coverage.too_rarely(rejecting) is None and coverage.exercised(rejecting) == "-"


def test_inconsistent_draft_counters_are_said_never_printed_as_a_negative_count() -> None:
    """OpenVINO GenAI's draft path has reported more accepted than drafted tokens: no table or
    line prints "-1021 rejected"; each says the counters are inconsistent."""
    e = distribution.EngineResult(
        engine="x", kind="openvino", verdict=Verdict.PRESERVED, alpha=0.01, tolerance=0.15,
        n_samples=10, first_seed=1, last_seed=10, drafted=488, accepted=1509, tests=[],
        contexts=[], headline=[], impossible=0, reason="", seconds=1.0, path="draft",
    )  # fmt: skip
    assert distribution.rejected(e) is None
    cell = distribution.draft_cell(e)
    assert "-1021" not in cell and "inconsistent" in cell
    wl = distribution.make_workload(fixtures.default_spec())
    res = distribution.DistResult("x", Path("."), {}, wl, 0.01, 0.15, False, [e])
    md = distribution.paths_markdown(res)
    assert "| x | draft | PRESERVED | 10 | 488 | 1509 | inconsistent | - |" in md
    assert "-1021" not in md


def test_the_coverage_table_lists_every_spec_type_with_its_verdict_and_counts() -> None:
    """Every --spec-type of b11434 once: covered ones with the verdict and draft counts of the
    run that exercised their path ("not run" otherwise), the rest "no" with a reason."""
    names = [t for t, _, _ in coverage.SPEC_TYPES]
    assert sorted(names) == sorted(B11434_SPEC_TYPES) and len(set(names)) == len(names)
    covering = [p for _, paths, _ in coverage.SPEC_TYPES for p in paths]
    assert sorted(covering) == sorted(distribution.PATHS)  # each path covers one type
    e = distribution.EngineResult(
        engine="x", kind="server-ngram-cache", verdict=Verdict.PRESERVED, alpha=0.01,
        tolerance=0.15, n_samples=10, first_seed=1, last_seed=10, drafted=12, accepted=5,
        tests=[], contexts=[], headline=[], impossible=0, reason="", seconds=1.0,
        path="ngram-cache",
    )  # fmt: skip
    wl = distribution.make_workload(fixtures.default_spec())
    res = distribution.DistResult("x", Path("."), {}, wl, 0.01, 0.15, False, [e])
    rows = {(r[0], r[2]): r for r in coverage.coverage_rows(res)}
    # draft-simple: four paths (two on the replay fixture), draft-mtp: two
    assert len(rows) == len(coverage.coverage_rows(res)) == 15
    assert rows["draft-eagle3", "eagle3"][1:4] == ("yes", "eagle3", "not run")
    assert rows["ngram-cache", "ngram-cache"][1:6] == ("yes", "ngram-cache", "PRESERVED", 12, 5)
    assert rows["ngram-map-k", "ngram-map-k"][3:6] == ("not run", None, None)
    assert rows["ngram-mod", "ngram"][1] == "yes"
    assert rows["draft-simple", "rejection"][1] == "yes"
    assert rows["draft-mtp", "mtp"][1:4] == ("yes", "mtp", "not run")
    assert rows["draft-mtp", "mtp-rejection"][1] == "yes"
    assert rows["draft-simple", "replay"][1:4] == ("yes", "replay", "not run")
    assert rows["draft-simple", "replay-rejection"][1] == "yes"
    for t, path in (("draft-dflash", "dflash"), ("draft-dspark", "dspark")):
        assert rows[t, path][1:4] == ("yes", path, "not run"), t
        assert (t, "-") not in rows  # covered: no "no" row left
    k4v = rows["ngram-map-k4v", "ngram-map-k4v"][6]
    assert "--spec-ngram-map-k4v-min-hits 1" in k4v and "sample-and-match" in k4v
    md = distribution.paths_markdown(res)
    assert "Every --spec-type of b11434:" in md
    assert "| ngram-cache | yes | ngram-cache | PRESERVED | 12 | 5 |" in md
    assert "| draft-mtp | yes | mtp | not run | - | - |" in md
    assert "| draft-dflash | yes | dflash | not run | - | - |" in md
    # no server path ran (a URL): no coverage table
    e.path = None
    assert "Every --spec-type" not in distribution.paths_markdown(res)


def test_the_terminal_view_has_one_summary_and_the_detail_lines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a terminal: per engine its tables and the detail lines (directed power, certified
    bound); one summary table carrying path and drafted/accepted/rejected, no second paths
    table."""
    spec = fixtures.default_spec()
    wl = distribution.make_workload(spec)
    truth = distribution.Truth(spec, wl)
    samples = [
        distribution.Sample(s.seed, s.text, drafted=3, accepted=2)
        for s in draw(truth, 400, np.random.default_rng(3))
    ]
    e = distribution.analyse(spec, wl, samples, engine="spec")
    e.path = "rejection"
    res = distribution.DistResult("fixture", tmp_path, {}, wl, 0.01, 0.15, False, [e])
    buf = io.StringIO()
    monkeypatch.setattr(dist_cmd, "out", Console(file=buf, force_terminal=True, width=200))
    dist_cmd.render(res)
    shown = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buf.getvalue())
    assert "Draft-direction test:" in shown and "Certified TV (largest" in shown
    assert "1200 drafted, 800 accepted, 400 rejected" in shown
    assert shown.count("summary") == 1 and "verification paths" not in shown
    # the coverage table: every --spec-type, this run's path with its verdict
    assert "every --spec-type of b11434" in shown
    assert "draft-dspark" in shown and "ngram-map-k4v" in shown and "not run" in shown
