"""llama.cpp's own server tests (tools/server/tests of b11434's source) against the real stock
and patched b11434 binaries, offline: every preset's model is Gemma 3 270M, and "forced spec"
gives every server that would not speculate Gemma as its own draft.

What they protect: upstream's logprobs tests catch the placeholder bug once the server
speculates (the premise of spec-logprobs); the spec-logprobs build passes every one of them
plain stock passes, and test_speculative.py wherever stock passes it; each bundled patch
brings a test in upstream's own files that upstream's runner collects, red on stock and green
on the patched build; and no server the upstream runner started outlives it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from specaudit import llama
from specaudit.llama import presets, upstream
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import resolve_all
from specaudit.llama.upstream import (
    LOGPROBS,
    PATCH_TESTS,
    SPECULATIVE,
    SPECULATIVE_FAST,
    UpstreamRun,
)

# the module's runs are set up once, inside its first test: more than the suite's per-test
# timeout on a loaded 2-core machine (four runs of upstream's pytest, each server loading Gemma)
pytestmark = pytest.mark.timeout(3600)

# upstream's tests that read the generated tokens' probabilities (n_probs, OpenAI logprobs)
LOGPROBS_IDS = (
    "unit/test_completion.py::test_n_probs",
    "unit/test_completion.py::test_n_probs_stream",
    "unit/test_completion.py::test_n_probs_post_sampling",
    "unit/test_chat_completion.py::test_logprobs",
    "unit/test_chat_completion.py::test_logprobs_stream",
)
SPEC_LOGPROBS_FILE = PATCH_TESTS["spec-logprobs"].path
EXAMPLE_FILE = PATCH_TESTS["speculative-fix"].path
EXAMPLE_SAMPLED = f"{EXAMPLE_FILE}::test_speculative_example_drafts_are_sampled"


def _in_file(run: UpstreamRun, path: str) -> list[str]:
    return [t.nodeid for t in run.results if t.nodeid.startswith(path + "::")]


@pytest.fixture(scope="module")
def runs(
    llama_bins: LlamaBinaries, patched_bins: LlamaBinaries, gemma_path: Path
) -> Iterator[dict[str, UpstreamRun]]:
    """Upstream's logprobs tests on stock plain; those, test_speculative.py and
    spec-logprobs' test on stock and spec-logprobs forced to speculate; speculative-fix's
    llama-speculative test on stock and fixed binaries. Every run has the test files of both
    bundled patches in its copy."""
    fix_bins = llama.ensure(patches=resolve_all((presets.SPECULATIVE_FIX,)))
    tests_of = resolve_all(tuple(PATCH_TESTS))
    spec_logprobs = (PATCH_TESTS["spec-logprobs"],)
    example = (PATCH_TESTS["speculative-fix"],)
    # test_speculative.py's cases that stock passes with Gemma as its own draft. The others
    # compare generated text with the stories models' (a regex, equal tokens across draft
    # settings) and fail on stock too (docs/upstream-server-tests.md)
    speculative = (upstream.Selection(SPECULATIVE[0].path, SPECULATIVE_FAST),)
    plan = (
        ("stock-plain", llama_bins, LOGPROBS, False),
        ("stock-spec", llama_bins, (*LOGPROBS, *speculative, *spec_logprobs, *example), True),
        ("patched-spec", patched_bins, (*LOGPROBS, *speculative, *spec_logprobs), True),
        ("fixed-example", fix_bins, example, True),
    )
    done: dict[str, UpstreamRun] = {}
    try:
        for label, bins, sels, force in plan:
            done[label] = upstream.run(
                bins, gemma_path, sels, force_spec=force, test_patches=tests_of, label=label
            )
        print(upstream.table(list(done.values())), file=sys.stderr)
        yield done
    finally:
        for r in done.values():
            upstream.cleanup(r)


def _processes_under(root: Path) -> list[int]:
    """Pids whose working directory lies under `root` (upstream's servers run in its tests
    copy)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            continue
        if cwd == root or root in cwd.parents:
            found.append(int(entry.name))
    return found


def test_no_server_outlives_the_upstream_runner(runs: dict[str, UpstreamRun]) -> None:
    for run in runs.values():
        # every run but the llama-speculative one started servers
        assert run.servers or run.label == "fixed-example", run.label
        assert _processes_under(run.work_dir) == [], run.label


def test_forced_spec_makes_every_server_speculate(runs: dict[str, UpstreamRun]) -> None:
    for label in ("stock-spec", "patched-spec"):
        assert all(s.speculative for s in runs[label].servers), label
    # the control: without forcing, upstream's logprobs tests run on plain servers
    plain = [s for s in runs["stock-plain"].servers if s.test in LOGPROBS_IDS]
    assert plain and not any(s.speculative for s in plain)


def test_stock_fails_upstreams_logprobs_tests_once_it_speculates(
    runs: dict[str, UpstreamRun],
) -> None:
    for nodeid in LOGPROBS_IDS:
        assert runs["stock-plain"].outcome(nodeid) == "passed", nodeid
        assert runs["stock-spec"].outcome(nodeid) == "failed", nodeid


def test_patched_passes_every_logprobs_test_plain_stock_passes(
    runs: dict[str, UpstreamRun],
) -> None:
    files = tuple(s.path for s in LOGPROBS)
    plain_passed = [i for i in runs["stock-plain"].passed if i.startswith(files)]
    assert set(LOGPROBS_IDS) <= set(plain_passed)
    for nodeid in plain_passed:
        assert runs["patched-spec"].outcome(nodeid) == "passed", nodeid


def test_patched_passes_test_speculative_wherever_stock_does(
    runs: dict[str, UpstreamRun],
) -> None:
    path = SPECULATIVE[0].path
    stock_passed = set(_in_file(runs["stock-spec"], path)) & set(runs["stock-spec"].passed)
    assert stock_passed
    for nodeid in stock_passed:
        assert runs["patched-spec"].outcome(nodeid) == "passed", nodeid


def test_spec_logprobs_brings_an_upstream_test_red_on_stock_green_patched(
    runs: dict[str, UpstreamRun],
) -> None:
    ids = _in_file(runs["patched-spec"], SPEC_LOGPROBS_FILE)
    assert len(ids) >= 3  # collected and run by upstream's runner
    for nodeid in ids:
        assert runs["stock-spec"].outcome(nodeid) == "failed", nodeid
        assert runs["patched-spec"].outcome(nodeid) == "passed", nodeid


def test_speculative_fix_brings_an_upstream_test_red_on_stock_green_fixed(
    runs: dict[str, UpstreamRun],
) -> None:
    assert runs["stock-spec"].outcome(EXAMPLE_SAMPLED) == "failed"
    assert runs["fixed-example"].outcome(EXAMPLE_SAMPLED) == "passed"
    # greedy runs are unchanged by the fix: the same test passes on both
    greedy = f"{EXAMPLE_FILE}::test_speculative_example_greedy_is_deterministic"
    assert runs["stock-spec"].outcome(greedy) == "passed"
    assert runs["fixed-example"].outcome(greedy) == "passed"
