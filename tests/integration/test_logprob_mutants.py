"""Logprob fidelity on real servers: placeholders, the fix, and five plausible-but-wrong fixes.

`specaudit.check` tells a placeholder from a number, nothing more. Here every token a speculating
fixture server reports is compared with the closed form for its own prefix
(`fidelity.FixtureReference`), within a tolerance measured from the plain server's own spread
against the closed form (batch sizes 1, 2 and 4). Expected:

- stock speculating server: its speculative tokens are PLACEHOLDER (MISSING when streamed);
- spec-logprobs (greedy and rejection-sampling paths): every token REAL_CORRECT;
- each logprob mutant (src/specaudit/patches/llama.cpp/b11434/mutants/lp-*.patch, docs/mutants.md),
  built as its own cache entry (an incremental rebuild) and served once (`shared_servers`:
  lp-no-temperature's server is test_check_reference's and test_rescore_servers' too):
  REAL_WRONG tokens in the mode it breaks and no other, while `specaudit.check` calls every one
  of its tokens real.

The sampler makes each bug visible: temperature 0.7 (lp-no-temperature), top-k 5 of 11 tokens
with 3 candidates asked for (lp-topk-renorm; lp-pre-as-post: the raw softmax differs from the
truncated one), the rejection-sampling path for lp-draft-probs (the only path with a q).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from shared_servers import SharedServers
from specaudit import check, fidelity, fixtures, llama
from specaudit.check import fidelity_probe
from specaudit.check.fidelity_probe import FidelityRun
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import resolve

# a mutant test may build its mutant first (an incremental rebuild, minutes on 2 busy cores,
# after waiting for the build lock)
pytestmark = pytest.mark.timeout(2400)

PROMPT = "bcdbc"
SAMPLER = fixtures.SamplerSettings(top_k=5, top_p=1.0, min_p=0.0, temperature=0.7)
N_PROBS = 3
TOKENS = 16
SEEDS = range(1, 4)
BATCHES = (1, 2, 4)  # concurrent identical requests: the plain server's batch sizes

# mutant -> (verification path, the modes whose values it breaks)
MUTANTS: dict[str, tuple[str, set[str]]] = {
    "lp-neighbour-position": ("greedy", {"pre", "post"}),
    "lp-pre-as-post": ("greedy", {"post"}),
    "lp-draft-probs": ("rejection", {"post"}),
    "lp-no-temperature": ("greedy", {"post"}),
    "lp-topk-renorm": ("greedy", {"post"}),
}


def _progress(pct: float, msg: str) -> None:
    print(f"[specaudit] building a mutant: {pct:3.0f}% {msg[-60:]}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def reference(fixture_set: fixtures.FixtureSet) -> fidelity.FixtureReference:
    return fidelity.FixtureReference(fixture_set.spec, SAMPLER)


@pytest.fixture(scope="module")
def floor(
    server: Callable[[str], Any], reference: fidelity.FixtureReference
) -> fidelity.NoiseFloor:
    """The noise floor: per prefix (the prompt followed by each letter), the closed form and
    the plain server's answers at each batch size."""
    spec = reference.spec
    got = fidelity_probe.server_noise_floor(
        server("fixture-plain").url,
        [spec.tokenize(PROMPT + letter) for letter in spec.letters],
        SAMPLER.request_fields(),
        spec.n_vocab,  # the whole support, and the raw softmax of every token
        batches=BATCHES,
        extra=reference,
    )
    print(f"noise floor: {got}; tolerance: {fidelity.tolerance(got)}", file=sys.stderr)
    return got


def _run(url: str, reference: fidelity.FixtureReference, tol: fidelity.Tolerance) -> FidelityRun:
    spec = reference.spec
    run = fidelity_probe.probe_server(
        url,
        prompt=PROMPT,
        prompt_ids=spec.tokenize(PROMPT),
        reference=reference,
        tol=tol,
        sampling=SAMPLER.request_fields(),
        seeds=SEEDS,
        tokens=TOKENS,
        n_probs=N_PROBS,
        vocabulary=reference.vocabulary,
    )
    c = run.counts
    print(
        f"{url}: {c} drafted/accepted {run.drafted}; check: {run.check_counts}",
        file=sys.stderr,
    )
    return run


def test_the_plain_server_agrees_with_the_closed_form_to_float32_rounding(
    floor: fidelity.NoiseFloor,
) -> None:
    """The tolerance is measured: the closed form and the plain server's answers at three batch
    sizes differ by float32 rounding only (the fixture's logits are exact float32 values)."""
    assert floor.prefixes == 8 and floor.answers == 1 + sum(BATCHES)
    assert 0.0 <= floor.prob < 1e-5 and 0.0 <= floor.logprob < 1e-5


def test_stock_speculative_tokens_are_placeholders(
    server: Callable[[str], Any],
    reference: fidelity.FixtureReference,
    floor: fidelity.NoiseFloor,
) -> None:
    run = _run(server("fixture-spec").url, reference, fidelity.tolerance(floor))
    c = run.counts
    assert c.placeholder > 0 and c.missing > 0  # non-streamed: 0.0 / 1.0; streamed: nothing
    assert c.real_wrong == 0 and c.real_correct >= len(run.probes)  # each first token is real
    # check sees the same placeholders (a streamed token without an entry is one to it too)
    assert run.check_counts.placeholder == c.placeholder + c.missing


def _assert_all_correct(run: FidelityRun) -> None:
    c = run.counts
    assert c.real_correct == c.total > 0, [
        (p.kind.label, t) for p, t in run.wrong()
    ] or run.counts_by_kind()
    drafted, accepted = run.drafted
    assert accepted > 0  # speculative tokens were among them


def test_spec_logprobs_tokens_are_real_and_correct(
    server: Callable[[str], Any],
    reference: fidelity.FixtureReference,
    floor: fidelity.NoiseFloor,
) -> None:
    _assert_all_correct(
        _run(server("fixture-spec-patched").url, reference, fidelity.tolerance(floor))
    )


def test_spec_logprobs_tokens_are_real_and_correct_under_rejection_sampling(
    patched_bins: LlamaBinaries,
    fixture_set: fixtures.FixtureSet,
    shared_servers: SharedServers,
    reference: fidelity.FixtureReference,
    floor: fidelity.NoiseFloor,
) -> None:
    srv = shared_servers.fixture(patched_bins, fixture_set, "rejection")
    _assert_all_correct(_run(srv.url, reference, fidelity.tolerance(floor)))


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_fidelity_catches_a_logprob_mutant_that_check_calls_real(
    mutant: str,
    fixture_set: fixtures.FixtureSet,
    shared_servers: SharedServers,
    reference: fidelity.FixtureReference,
    floor: fidelity.NoiseFloor,
) -> None:
    path, modes = MUTANTS[mutant]
    bins = llama.ensure(patches=(resolve(f"mutants/{mutant}"),), progress=_progress)
    assert bins.variant.startswith(f"mutant-{mutant}-")
    srv = shared_servers.fixture(bins, fixture_set, path)
    run = _run(srv.url, reference, fidelity.tolerance(floor))
    verdict = check.run(srv.url, prompt=PROMPT, tokens=TOKENS, temperature=0.7)
    # check: every token real, no placeholder anywhere
    assert verdict.verdict == "real" and verdict.placeholders == 0, verdict.reason
    assert run.check_counts.placeholder == 0 and run.counts.placeholder == 0
    assert run.counts.missing == 0
    # fidelity: wrong tokens, in the broken modes only
    wrong = run.wrong()
    assert wrong, run.counts_by_kind()
    assert {t.mode for _, t in wrong} == modes, run.counts_by_kind()
    # every wrong token is a speculative one: the first token comes from the plain path
    assert all(t.index > 0 for _, t in wrong)
    by_kind = run.counts_by_kind()
    for kind in fidelity_probe.DEFAULT_KINDS:
        if ("post" if kind.post else "pre") not in modes:
            assert by_kind[kind.label].real_wrong == 0, kind.label
