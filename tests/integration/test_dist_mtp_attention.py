"""MTP's own KV cache under `dist`, on real llama-servers (b11434) and the mtp-attention
fixture, whose MTP layer attends over that cache (`fixtures.mtp_attention_spec`).

The other MTP fixtures' MTP layer has zero attention, so nothing llama-server keeps in the
MTP context's cache can show. Here the greedy drafts are a function of the cache's contents,
and a correct server's drafted/accepted counts are the closed form's
(`fixtures.mtp_greedy_counts`, from `fixtures.reference.mtp_attention_head`).

Two mutants of that cache's rollback (src/specaudit/patches/llama.cpp/b11434/mutants/):

* `mtp-kv-stale`: after verification only the target's KV is cropped, the MTP context keeps
  the rejected draft tokens' cells. Loud: llama.cpp's consecutive-positions check refuses the
  next MTP decode, and the server answers HTTP 500 "failed to process speculative batch"
  within a few requests. The stale cells are never read.
* `mtp-kv-reuse`: the draft's own cells are kept instead of being rolled back and
  re-evaluated with the target's hidden states. Positions stay consecutive, so nothing
  complains: the cells of accepted draft tokens are stale. A draft is only a proposal, so
  the output distribution is kept (every greedy sample is stock's), but the counts are not
  the closed form's, and only on this fixture (on the mtp fixture they are).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from specaudit import distribution, fixtures, llama
from specaudit.distribution.results import DistError
from specaudit.fixtures.reference import AmbiguousSamplingError
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import resolve
from specaudit.stats import Verdict

SEEDS = range(1, 301)
# a 4-token request drafts after an accepted draft never (the second round has no room), so
# a stale cell of an accepted draft token could not be read: 16 tokens give it many rounds
TOKENS = 16


def _progress(pct: float, msg: str) -> None:
    print(f"[specaudit] building an MTP mutant: {pct:3.0f}% {msg[-60:]}", file=sys.stderr)


@pytest.fixture(scope="module")
def attention_fixture(
    fixture_of_kind: Callable[[fixtures.FixtureKind], fixtures.FixtureSet],
) -> fixtures.FixtureSet:
    return fixture_of_kind("mtp-attention")


def _collect(
    bins: LlamaBinaries, fs: fixtures.FixtureSet, path: str, label: str
) -> list[distribution.Sample]:
    wl = distribution.make_workload(fs.spec, tokens=TOKENS)
    with distribution.spawn_server(bins, fs, path=path) as srv:  # this test's alone
        eng = distribution.ServerEngine(srv.url, fs.spec, wl, label=label, kind=path)
        return distribution.collect(eng, SEEDS)


def _counts_check(fs: fixtures.FixtureSet, samples: list[distribution.Sample]) -> tuple[int, int]:
    """(samples whose counts differ from the closed form's, samples the closed form cannot
    decide: a greedy draft within rounding of a tie)."""
    spec, wrong, undecided = fs.spec, 0, 0
    for s in samples:
        try:
            expected = fixtures.mtp_greedy_counts(spec, spec.prompt, s.text)
        except AmbiguousSamplingError:
            undecided += 1
            continue
        wrong += (s.drafted, s.accepted) != expected
    return wrong, undecided


@pytest.fixture(scope="module")
def stock_greedy(
    llama_bins: LlamaBinaries, attention_fixture: fixtures.FixtureSet
) -> list[distribution.Sample]:
    return _collect(llama_bins, attention_fixture, "mtp", "stock")


def test_stock_greedy_mtp_drafts_what_the_attention_closed_form_predicts(
    attention_fixture: fixtures.FixtureSet, stock_greedy: list[distribution.Sample]
) -> None:
    """Stock b11434 drafts and accepts exactly the closed form's counts on every sample it
    decides; the zero-attention head's closed form (the mtp fixture's) would be wrong on
    many: the MTP layer's attention over its cache matters."""
    wrong, undecided = _counts_check(attention_fixture, stock_greedy)
    mtp = fixtures.spec_for_kind("mtp")
    zero_attention_wrong = sum(
        (s.drafted, s.accepted) != fixtures.mtp_greedy_counts(mtp, mtp.prompt, s.text)
        for s in stock_greedy
    )
    print(f"\nstock mtp: {wrong} wrong, {undecided} undecided of {len(stock_greedy)}; "
          f"zero-attention closed form wrong on {zero_attention_wrong}")  # fmt: skip
    assert wrong == 0
    assert undecided <= len(stock_greedy) // 50
    assert zero_attention_wrong > len(stock_greedy) // 20
    assert sum(s.drafted or 0 for s in stock_greedy) > len(stock_greedy)


@pytest.mark.parametrize("path", ["mtp", "mtp-rejection"])
def test_skipping_the_mtp_kv_rollback_after_a_rejection_is_loud(
    path: str, attention_fixture: fixtures.FixtureSet
) -> None:
    bins = llama.ensure(patches=(resolve("mutants/mtp-kv-stale"),), progress=_progress)
    with pytest.raises(DistError, match="failed to process speculative batch"):
        _collect(bins, attention_fixture, path, "mtp-kv-stale")


def test_kept_draft_kv_cells_keep_the_distribution_but_not_the_counts(
    attention_fixture: fixtures.FixtureSet,
    stock_greedy: list[distribution.Sample],
    fixture_of_kind: Callable[[fixtures.FixtureKind], fixtures.FixtureSet],
) -> None:
    """Sample-and-match emits the target's own draw: every sample is stock's for its seed.
    The stale cells change the drafts, so the counts leave the closed form here, and on the
    zero-attention mtp fixture they do not (it cannot see the cache)."""
    bins = llama.ensure(patches=(resolve("mutants/mtp-kv-reuse"),), progress=_progress)
    samples = _collect(bins, attention_fixture, "mtp", "mtp-kv-reuse")
    assert [s.text for s in samples] == [s.text for s in stock_greedy]
    wrong, undecided = _counts_check(attention_fixture, samples)
    mtp_fixture = fixture_of_kind("mtp")
    blind, _ = _counts_check(mtp_fixture, _collect(bins, mtp_fixture, "mtp", "mtp-kv-reuse"))
    print(f"\nmtp-kv-reuse: counts wrong on {wrong} of {len(samples) - undecided} decided "
          f"samples; on the mtp fixture on {blind}")  # fmt: skip
    assert wrong > 0
    assert blind == 0


def test_kept_draft_kv_cells_are_not_called_broken_under_rejection_sampling(
    attention_fixture: fixtures.FixtureSet,
) -> None:
    """Rejection sampling is exact for any proposal drawn from the q it reports; the stale
    cells only change the proposals, so `dist` must not say BROKEN."""
    bins = llama.ensure(patches=(resolve("mutants/mtp-kv-reuse"),), progress=_progress)
    fs = attention_fixture
    wl = distribution.make_workload(fs.spec, tokens=TOKENS)
    with distribution.spawn_server(bins, fs, path="mtp-rejection") as srv:
        eng = distribution.ServerEngine(
            srv.url, fs.spec, wl, label="mtp-kv-reuse", kind="mtp-rejection"
        )
        e = distribution.measure(eng, fs.spec, wl, SEEDS)
    print(f"\nmtp-kv-reuse on mtp-rejection: {e.verdict.value} after {e.n_samples} samples, "
          f"{e.drafted} drafted, {e.accepted} accepted")  # fmt: skip
    assert e.verdict is not Verdict.BROKEN, e.reason
    assert e.drafted is not None and e.drafted > 0
