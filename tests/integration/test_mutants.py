"""Mutation testing of `specaudit dist` with real builds: a broken speculative path is caught.

Three bundled mutants of llama.cpp b11434's speculative path (src/specaudit/patches/llama.cpp/
b11434/mutants/, docs/mutants.md), each built as its own cache entry (an incremental rebuild of
the cached work tree, ~10-60 s cold; cached afterwards), must come out BROKEN under
`--spec-draft-sampling probabilistic` on the default fixture, while the stock build stays
PRESERVED on the same path. One file per verification stage they break: the rejection
sampler (common/sampling.cpp), the draft (common/speculative.cpp), the server's verification
batch (tools/server/server-context.cpp). benchmarks/bench_mutants.py measures all of them.
Stock runs on the session's servers, each mutant on one of `shared_servers` (argmax-proposal's
is test_rescore_servers' too).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from shared_servers import SharedServers
from specaudit import distribution, fixtures, llama
from specaudit.llama import sources
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import resolve
from specaudit.stats import Verdict

MUTANTS = ("mutants/ratio-inverted", "mutants/argmax-proposal", "mutants/verify-index")
MUTANT_SEEDS = range(1, 301)  # sequential: each of the three is flagged within 25 samples
STOCK_SEEDS = range(1, 1001)  # the report's 1000 seeds: enough to certify TV <= 0.15


def _progress(pct: float, msg: str) -> None:
    print(f"[specaudit] building a mutant: {pct:3.0f}% {msg[-60:]}", file=sys.stderr, flush=True)


def _spec_server(
    url: str,
    label: str,
    fs: fixtures.FixtureSet,
    seeds: range,
    *,
    sequential: bool = False,
    alpha: float = distribution.DEFAULT_ALPHA,
) -> distribution.EngineResult:
    wl = distribution.make_workload(fs.spec)
    eng = distribution.ServerEngine(url, fs.spec, wl, label=label, kind="server-spec")
    return distribution.measure(eng, fs.spec, wl, seeds, alpha=alpha, sequential=sequential)


def _texts(url: str, label: str, fs: fixtures.FixtureSet, seeds: range) -> list[str]:
    wl = distribution.make_workload(fs.spec)
    eng = distribution.ServerEngine(url, fs.spec, wl, label=label, kind="server-spec")
    return [s.text for s in distribution.collect(eng, seeds)]


def test_every_bundled_mutant_applies_to_pristine_b11434(llama_bins: LlamaBinaries) -> None:
    """Checked the way a build applies them: in a scratch dir holding the sdist's bytes."""
    mutants = llama.available_mutants()
    assert len(mutants) >= 7 and set(MUTANTS) <= set(mutants)
    assert not any(m.startswith("mutants/") for m in llama.available_patches())  # ./run skips
    for m in mutants:
        assert llama.describe_patch(m), f"{m} has no one-line description"
        patch = resolve(m, llama.DEFAULT_BUILD)
        files = sources.patch_files(patch)
        pristine = sources.variant_sources(llama.DEFAULT_BUILD, (), files)
        mutated = sources.variant_sources(llama.DEFAULT_BUILD, (patch,), files)
        assert all(mutated[f] is not None and mutated[f] != pristine[f] for f in files), m


def test_stock_preserves_under_probabilistic_drafting(
    dist_result: Callable[[str, str], distribution.EngineResult],
) -> None:
    # the session's stock rejection server on seeds 1..1000: the audit's dist section's result
    res = dist_result("fixture", "rejection")
    assert res.n_samples == len(STOCK_SEEDS)
    assert res.verdict is Verdict.PRESERVED, res.reason
    # the rejection sampler really ran: it accepts far more than greedy's sample-and-match
    # (2637 drafted / 946 accepted on these seeds; measured 2257 / 1493 here)
    assert res.drafted is not None and res.accepted is not None and res.drafted > 1000
    assert res.accepted > 0.5 * res.drafted


@pytest.mark.parametrize("mutant", MUTANTS)
def test_mutant_is_broken_under_probabilistic_drafting(
    mutant: str, fixture_set: fixtures.FixtureSet, shared_servers: SharedServers
) -> None:
    bins = llama.ensure(patches=(resolve(mutant),), progress=_progress)
    assert bins.variant.startswith("mutant-")
    url = shared_servers.fixture(bins, fixture_set, "rejection").url
    res = _spec_server(url, bins.variant, fixture_set, MUTANT_SEEDS, sequential=True, alpha=1e-3)
    assert res.verdict is Verdict.BROKEN, res.reason
    assert res.sequential is not None and res.sequential.samples_used <= 50


def test_a_rejection_sampler_mutant_is_invisible_under_greedy_drafting(
    server: Callable[[str], Any], fixture_set: fixtures.FixtureSet, shared_servers: SharedServers
) -> None:
    """Greedy drafting never calls the rejection sampler: the same samples as stock, byte for
    byte. Why dist has to run the probabilistic path to see such a bug at all."""
    bins = llama.ensure(patches=(resolve("mutants/ratio-inverted"),), progress=_progress)
    seeds = range(1, 201)
    mutant = shared_servers.fixture(bins, fixture_set, "greedy").url
    stock = server("fixture-spec").url
    assert _texts(mutant, bins.variant, fixture_set, seeds) == _texts(
        stock, "stock", fixture_set, seeds
    )
