"""b11434's n-gram drafters besides ngram-mod as `dist` paths, on both fixtures (real servers).

ngram-simple, ngram-map-k, ngram-map-k4v and ngram-cache propose drafts from the context in
four different ways and all verify them by sample-and-match. Each runs alone (one
--spec-type, so ``timings.draft_n > 0`` proves that drafter ran), with the flags that make it
draft on the fixture's prompt (`presets.NGRAM_TYPE_ARGS`).

Three of them keep state per slot across requests (docs/dist.md, "Verification paths"), so a
draft may come from an earlier request (ngram-map-k/-k4v even stop drafting after a few
rejections: their rows show only a handful of drafts). Sample-and-match makes that harmless:
every emitted token is the target's own draw at its position, one RNG draw per token as on
the plain server. So beyond the statistical verdict each sample must equal the plain server's
for the same seed, token for token; on the context fixture (logits over the whole context,
through attention) that also catches a rejected draft token left in a slot's KV cache for the
next request.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from dataclasses import replace

import pytest

from specaudit import distribution, fixtures
from specaudit.audit import AuditContext
from specaudit.distribution import coverage
from specaudit.distribution.truth import encode_text
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.stats import Verdict

CliFn = Callable[..., tuple[int, str, str]]
NGRAM_TYPES = tuple(presets.NGRAM_TYPE_ARGS)
# PRESERVED needs the TV bounds under the 0.15 tolerance: ~500 samples on the last-token
# fixture, ~800 on the context one (300 leave even the plain server INCONCLUSIVE)
SEEDS = range(1, 1001)
KINDS = ["last-token", "context"]
# ngram-map-k/-k4v: a prompt key whose draft is rejected outright never drafts again in its
# slot, so under one repeated prompt they draft a handful of times, then stop (docs/dist.md)
MAP_TYPES = ("ngram-map-k", "ngram-map-k4v")


def _samples(url: str, fs: fixtures.FixtureSet, label: str) -> list[distribution.Sample]:
    wl = distribution.make_workload(fs.spec)
    eng = distribution.ServerEngine(url, fs.spec, wl, label=label, kind=label)
    return distribution.collect(eng, SEEDS)


Measured = tuple[
    fixtures.FixtureSet, list[distribution.Sample], dict[str, list[distribution.Sample]]
]


@pytest.fixture(scope="module", params=KINDS)
def measured(
    request: pytest.FixtureRequest,
    llama_bins: LlamaBinaries,
    audit_ctx: AuditContext,
    tmp_path_factory: pytest.TempPathFactory,
) -> Measured:
    """(fixture, the plain server's samples, each n-gram type's samples), seeds 1..1000.

    The plain server is the session's; the n-gram servers this module's own, fresh (the
    session's would carry other tests' per-slot drafter state), one at a time, each stopped
    once sampled.
    """
    fs = audit_ctx.fixture if request.param == "last-token" else audit_ctx.context_fixture
    assert fs.spec.kind == request.param
    logs = tmp_path_factory.mktemp(f"dist-ngram-{request.param}")
    model = "fixture" if request.param == "last-token" else "fixture-context"
    plain = _samples(audit_ctx.server(presets.fixture_role(model, "plain")).url, fs, "plain")
    got: dict[str, list[distribution.Sample]] = {}
    for path in NGRAM_TYPES:
        with distribution.spawn_server(llama_bins, fs, path=path, log_dir=logs) as srv:
            got[path] = _samples(srv.url, fs, path)
    return fs, plain, got


def test_each_ngram_type_keeps_the_distribution_and_drafts(
    measured: Measured,
) -> None:
    fs, _, by_type = measured
    wl = distribution.make_workload(fs.spec)
    engines = []
    for t, samples in by_type.items():
        coded = [replace(s, text=encode_text(s.text, wl.tokens, fs.spec)) for s in samples]
        e = distribution.analyse(fs.spec, wl, coded, engine=f"llama-server + {t}", kind=t)
        e.path = t
        engines.append(e)
    res = distribution.DistResult(
        fs.spec.name, fs.dir, dict(fs.sha256), wl, distribution.DEFAULT_ALPHA,
        distribution.DEFAULT_TOLERANCE, False, engines,
    )  # fmt: skip
    print(f"\n{fs.spec.kind} fixture, seeds 1..{SEEDS[-1]}:\n{distribution.paths_markdown(res)}")
    for t, samples in by_type.items():  # drafts per 100 seeds: the map types stop early
        blocks = [sum(s.drafted or 0 for s in samples[i : i + 100]) for i in range(0, 1000, 100)]
        print(f"{t}: drafted per 100 seeds {blocks}")
    for e in engines:
        assert e.verdict is Verdict.PRESERVED, (e.path, e.reason)
        assert e.n_samples == len(SEEDS)
        # one --spec-type per server: its drafts are this drafter's
        assert e.drafted is not None and e.drafted > 0, (e.path, "never drafted")
        assert e.accepted is not None and 0 <= e.accepted <= e.drafted, e.path
    rows = {r[0]: r for r in coverage.coverage_rows(res)}
    for e in engines:
        assert rows[e.path][2:6] == (e.path, "PRESERVED", e.drafted, e.accepted)


def test_each_ngram_type_returns_the_plain_servers_sample_for_every_seed(
    measured: Measured,
) -> None:
    """Whatever a slot remembers from earlier requests only changes what is proposed: the
    tokens are the target's own draws, the plain server's for the same seed."""
    fs, plain, by_type = measured
    want = {s.seed: s.text for s in plain}
    assert len(want) == len(SEEDS) and all(
        len(t) == distribution.make_workload(fs.spec).tokens for t in want.values()
    )
    for t, samples in by_type.items():
        differ = [s.seed for s in samples if s.text != want[s.seed]]
        assert not differ, f"{t}: seeds {differ[:10]} differ from the plain server's samples"
        if t not in MAP_TYPES:  # the map types' few drafts may all be rejected
            assert sum(s.accepted or 0 for s in samples) > 0, f"{t}: no draft token accepted"


def test_dist_cli_runs_the_ngram_paths_and_shows_the_coverage_table(cli: CliFn) -> None:
    """`specaudit dist --engine server --path <type>...`: its own servers, one per path, and
    the table of every --spec-type with the verdict and counts of each path it ran."""
    args = [a for t in NGRAM_TYPES for a in ("--path", t)]
    code, out, err = cli("dist", "--engine", "server", *args, "--seeds", "60")
    assert code in (0, 2), err[-2000:]  # 60 seeds may leave a bound above the tolerance
    assert "Every --spec-type of b11434:" in out
    for t in NGRAM_TYPES:
        row = re.search(rf"^\| {t} \| yes \| {t} \| (\w+) \| (\d+) \| (\d+) \|", out, re.M)
        assert row is not None, (t, out[-3000:])
        assert row[1] in ("PRESERVED", "INCONCLUSIVE") and int(row[2]) > 0, row[0]
    for t, paths, _ in coverage.SPEC_TYPES:  # every --spec-type, covered or not
        cell = r"yes \| [\w-]+" if paths else r"no \| - \| - \|"
        assert re.search(rf"^\| {t} \| {cell}", out, re.M), t


def test_the_coverage_table_has_every_spec_type_the_server_accepts(
    llama_bins: LlamaBinaries,
) -> None:
    """`coverage.SPEC_TYPES` against the built llama-server's own list (its --help): a type
    added upstream, or one the table invents, fails here."""
    help_text = subprocess.run(
        [str(llama_bins.server), "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    m = re.search(r"^--spec-type ([\w,-]+)", help_text, re.M)
    assert m is not None, help_text[-2000:]
    assert sorted(m[1].split(",")) == sorted(t for t, _, _ in coverage.SPEC_TYPES)
