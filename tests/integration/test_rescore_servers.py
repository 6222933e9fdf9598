"""The re-scored test against real llama-servers: the fixture (where the closed form
cross-checks the reference) and Gemma 3 270M speculating with itself as its draft.

One server per role for the session (conftest; a mutant's from `shared_servers`); the
references are plain servers of the same model file.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from shared_servers import SharedServers
from specaudit import fixtures, llama
from specaudit.fidelity import FixtureReference
from specaudit.fixtures import REPORT_SAMPLER, SamplerSettings
from specaudit.llama.patches import resolve, resolve_all
from specaudit.llama.presets import draft_chain
from specaudit.llama.server import LlamaServer
from specaudit.outcome import Outcome
from specaudit.reference import Reference
from specaudit.rescore import fixture as fixture_ref
from specaudit.rescore import flags, request, runner
from specaudit.rescore.outside import EDGE_PREFIXES
from specaudit.rescore.records import RescoreError
from specaudit.stats import Verdict

GEMMA_SAMPLER = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=1.0)
ARM_SEEDS = 500  # per arm, 4 tokens each
# the fixture draft's q as llama.cpp's probabilistic draft samples it (top-k 10, the target's
# temperature): what rejection sampling weighs against p
DRAFT_CHAIN = draft_chain(REPORT_SAMPLER)
FLAG_SEEDS = 150


def _fixture_request(
    url: str, ref_url: str, fs: fixtures.FixtureSet, seeds: int = 300
) -> request.RescoreRequest:
    spec = fs.spec
    return request.make_request(
        url,
        reference_url=ref_url,
        prompt_ids=[spec.tokenize(spec.prompt)],
        seeds=seeds,
        tokens=4,
        sampler=REPORT_SAMPLER,
        draft=fixture_ref.FixtureDraft(spec, DRAFT_CHAIN),
    )


def test_the_reference_server_answers_the_closed_form(
    server: Callable[..., Any], fixture_set: fixtures.FixtureSet
) -> None:
    """The plain fixture server, asked as a reference, gives the exact processed distribution
    for every prefix we ask (the cross-check of the reference against a truth no server
    computes)."""
    import asyncio

    spec = fixture_set.spec
    closed = FixtureReference(spec, REPORT_SAMPLER)
    ref_url = server("fixture-plain").url
    prefixes = [spec.tokenize(spec.prompt + tail) for tail in ("", "a", "bc", "dd", "cab")]

    async def ask() -> None:
        async with Reference(ref_url, REPORT_SAMPLER) as ref:
            await ref.prepare()
            for ids in prefixes:
                got = await ref.next_token(ids)
                want = closed.next_token(ids)
                assert set(got.probs) == set(want.probs)
                for t, p in want.probs.items():
                    assert got.probs[t] == pytest.approx(p, abs=1e-5)

    asyncio.run(ask())


def test_rejection_sampling_on_the_fixture_is_preserved(
    server: Callable[..., Any], fixture_set: fixtures.FixtureSet
) -> None:
    eng = server("fixture-spec-rejection")
    res = runner.run(_fixture_request(eng.url, server("fixture-plain").url, fixture_set))
    assert res.error is None and res.stats is not None
    assert res.rescored == res.sampled_tokens == 1200
    assert res.drafted and res.drafted > 0 and res.accepted is not None  # it speculated
    assert res.stats.verdict is Verdict.PRESERVED, res.stats.reason
    assert res.stats.g_prefixes >= 1  # the first position's prefix repeats 300 times
    # the fixture's draft is known in closed form: every token went through the draft-aimed
    # e-process too, and the certificate's bounds include the repeated prefixes' TV
    assert res.stats.draft is not None and res.stats.draft.used == 1200
    assert res.stats.certificate is not None and len(res.stats.certificate.bounds) == 3
    b = res.batching  # the engine's /slots, read while it sampled
    assert b is not None and b.slots == 4 and b.speculative_before == b.speculative_after == 4
    print("fixture batching:", b.summary())


def test_a_rejection_sampler_mutant_is_broken_by_rescoring(
    server: Callable[..., Any], fixture_set: fixtures.FixtureSet, shared_servers: SharedServers
) -> None:
    """argmax-proposal (the draft proposes its argmax but reports its sampled q): the
    re-scored test catches it without the fixture's closed form."""
    bins = llama.ensure(patches=(resolve("mutants/argmax-proposal"),))
    srv = shared_servers.fixture(bins, fixture_set, "rejection")
    res = runner.run(_fixture_request(srv.url, server("fixture-plain").url, fixture_set))
    assert res.stats is not None and res.stats.verdict is Verdict.BROKEN, res.stats
    assert res.stats.favourite_rate > res.stats.favourite_expected


def test_same_seed_coupling_sees_a_greedy_path_bug_a_correct_engine_does_not_have(
    server: Callable[..., Any], fixture_set: fixtures.FixtureSet, shared_servers: SharedServers
) -> None:
    """The greedy draft path samples and matches: correct, its sample at every seed is the
    plain reference's own, token for token, and the control arm (the reference sampled at the
    same seeds, through the same test) is not broken beside it. verify-index (each draft
    token verified with the logits of the position before) parts from the reference at the
    first accepted draft: the coupling test rejects, and names where."""
    spec = fixture_set.spec
    ref = server("fixture-plain").url

    def coupled(url: str) -> runner.RescoreResult:
        req = request.make_request(
            url, reference_url=ref, prompt_ids=[spec.tokenize(spec.prompt)], seeds=100,
            tokens=4, sampler=REPORT_SAMPLER, control=True, coupling=True,
            draft=fixture_ref.FixtureDraft(spec, DRAFT_CHAIN),
        )  # fmt: skip
        return runner.run(req)

    good = coupled(server("fixture-spec").url)
    assert good.error is None and good.stats is not None and good.coupling is not None
    assert good.drafted and good.accepted  # it speculated
    assert good.coupling.samples == 100 and good.coupling.control_samples == 64
    assert good.coupling.diverged == good.coupling.control_diverged == 0
    assert good.stats.verdict is not Verdict.BROKEN, good.stats.reason
    assert good.control is not None and good.control.stats is not None
    assert good.control.rescored == 400
    assert good.control.stats.verdict is not Verdict.BROKEN, good.control.stats.reason
    bins = llama.ensure(patches=(resolve("mutants/verify-index"),))
    bad = coupled(shared_servers.fixture(bins, fixture_set, "greedy").url)
    assert bad.stats is not None and bad.coupling is not None
    assert bad.coupling.diverged > 10 and bad.coupling.p_value < 1e-4
    assert bad.stats.verdict is Verdict.BROKEN
    assert "same-seed coupling" in bad.stats.reason


def test_flagged_tokens_test_the_verification_rule_and_catch_a_residual_bug(
    server: Callable[..., Any], fixture_set: fixtures.FixtureSet, shared_servers: SharedServers
) -> None:
    """The spec-logprobs build flags each speculated token (the draft's proposal there, the
    rule that verified it): on its rejection path the acceptance count and the residual
    draws keep their laws; with `residual-target` on top (after a rejection, x is drawn from
    p, not norm(max(0, p - q))), tokens the residual has no mass for appear and the residual
    test alone makes the run BROKEN, where the marginal tests see little at this size."""
    ref = server("fixture-plain").url

    def rescored(*patches: str) -> runner.RescoreResult:
        bins = llama.ensure(patches=resolve_all(patches))
        srv = shared_servers.fixture(bins, fixture_set, "rejection")
        return runner.run(_fixture_request(srv.url, ref, fixture_set, seeds=FLAG_SEEDS))

    good = rescored("spec-logprobs")
    assert good.stats is not None and good.stats.verdict is not Verdict.BROKEN, good.stats
    by = {t.name: t for t in good.stats.tests}
    acc, resid = by[flags.ACCEPTANCE], by[flags.RESIDUAL]
    flagged = [d for d in good.draws if d.verified_by is not None]
    assert {d.verified_by for d in flagged} == {"rejection"}
    assert len(flagged) > 200 and not acc.rejects and not resid.rejects
    assert "where the residual has no mass" not in resid.detail
    bad = rescored("spec-logprobs", "mutants/residual-target")
    assert bad.stats is not None and bad.stats.verdict is Verdict.BROKEN
    worst = {t.name: t for t in bad.stats.tests}
    assert worst[flags.RESIDUAL].rejects and "where the residual has no mass" in (
        worst[flags.RESIDUAL].detail
    )


def test_a_temperature_bug_invisible_at_t_1_is_broken_by_the_arm(
    server: Callable[..., Any], fixture_set: fixtures.FixtureSet, shared_servers: SharedServers
) -> None:
    """q-raw (the acceptance ratio's q is the draft's raw softmax, not the distribution the
    draft token was drawn from) changes no sample at T = 1 on this fixture (docs/mutants.md:
    byte-identical to stock there), so a run at T = 1 alone cannot see it; the arm at
    T = 0.7, on by default, does, and the run is BROKEN."""
    bins = llama.ensure(patches=(resolve("mutants/q-raw"),))
    srv = shared_servers.fixture(bins, fixture_set, "rejection")
    req = dataclasses.replace(
        _fixture_request(srv.url, server("fixture-plain").url, fixture_set, seeds=ARM_SEEDS),
        arm_temperature=request.default_arm(REPORT_SAMPLER),
    )
    res = runner.run(req)
    assert res.stats is not None and res.arm is not None and res.arm.stats is not None
    print("q-raw, T = 1:", res.stats.verdict.value, res.stats.reason)
    print("q-raw, arm:", res.arm.stats.verdict.value, res.arm.stats.reason)
    assert res.stats.verdict is not Verdict.BROKEN, res.stats.reason
    assert res.arm.sampler.temperature == 0.7 and res.arm.rescored == ARM_SEEDS * 4
    assert res.arm.stats.verdict is Verdict.BROKEN, res.arm.stats.reason
    assert res.outcome is Outcome.FINDING and res.exit_code == 1


def test_the_command_adds_the_arm_at_t_0_7_by_default(
    server: Callable[..., Any], fixture_set: fixtures.FixtureSet, cli: Any
) -> None:
    """`specaudit rescore --url` at T = 1 runs the arm at 0.7 without being asked, reports
    both arms and their joint outcome as its exit code; `--arm-temperature off` runs one."""
    spec = fixture_set.spec
    args = [
        "rescore", "--url", server("fixture-spec-rejection").url,
        "--reference-url", server("fixture-plain").url, "--prompt", spec.prompt,
        "--seeds", "200", "--tokens", "4", "--top-k", "3", "--no-control", "--json",
    ]  # fmt: skip
    r = cli(*args)
    out = json.loads(r.stdout)
    assert r.exit_code == {"ok": 0, "finding": 1, "no decision": 2}[out["outcome"]]
    assert out["outcome"] != "finding", out["stats"]
    assert out["sampler"]["temperature"] == 1.0 and out["rescored"] == 800
    arm = out["arm"]
    assert arm["sampler"]["temperature"] == 0.7 and arm["rescored"] == 800
    assert arm["verdict"] in ("PRESERVED", "INCONCLUSIVE"), arm["stats"]
    one = json.loads(cli(*args, "--arm-temperature", "off").stdout)
    assert one["arm"] is None and one["rescored"] == 800


def _gemma(url: str, **ref: Any) -> runner.RescoreResult:
    req = request.make_request(
        url,
        prompts=request.DEFAULT_PROMPTS,
        seeds=20,
        tokens=6,
        sampler=GEMMA_SAMPLER,
        concurrency=2,
        timeout=600.0,
        **ref,
    )
    return runner.run(req)


def _inconclusive_not_broken(res: runner.RescoreResult) -> None:
    """360 tokens: no test of the family rejects, and the certificate's bounds are wider
    than the default tolerance, so the run says INCONCLUSIVE and names the tokens that
    would decide (the audit's model section certifies at 810)."""
    s = res.stats
    assert s is not None and s.verdict is Verdict.INCONCLUSIVE, s and s.reason
    assert not any(t.rejects for t in s.tests)
    assert s.needed is not None and s.needed > res.rescored
    assert f"about {s.needed} tokens would decide" in s.reason


def test_gemma_plain_against_its_own_reference_is_not_broken(
    server: Callable[..., Any], gemma_path: Any
) -> None:
    """The null control on a real model: a plain Gemma server against a plain reference that
    specaudit starts itself from the same file (--reference-model). Tokens outside the
    reference's top-k are counted against its own leak across batch shapes, measured at 16 of
    the run's prefixes; none is impossible in every shape."""
    res = _gemma(server("gemma-plain").url, reference_model=gemma_path)
    assert res.error is None and res.stats is not None
    assert res.rescored == res.sampled_tokens == 360
    assert res.noise_tv is not None and res.stats.impossible == 0
    assert res.edge is not None and len(res.edge.leaks) == EDGE_PREFIXES
    assert res.stats.outside is not None and res.stats.outside.far == 0
    _inconclusive_not_broken(res)
    assert res.identity is not None and res.identity.n_vocab == 262144


def test_gemma_speculating_with_itself_is_not_broken(
    server: Callable[..., Any],
) -> None:
    res = _gemma(server("gemma-spec").url, reference_url=server("gemma-plain").url)
    assert res.error is None and res.stats is not None
    assert res.rescored == res.sampled_tokens == 360
    assert res.drafted and res.drafted > 0
    # two requests in flight on two slots: /slots saw both busy at once, both speculating
    b = res.batching
    assert b is not None and b.batched and b.max_busy == 2, b
    assert b.speculative_before == b.speculative_after == 2
    _inconclusive_not_broken(res)


def test_a_reference_that_speculates_is_refused(server: Callable[..., Any]) -> None:
    req = request.make_request(
        server("fixture-plain").url, reference_url=server("fixture-spec").url, seeds=100
    )
    with pytest.raises(RescoreError, match="speculates"):
        runner.run(req)


def test_a_different_model_is_refused(server: Callable[..., Any]) -> None:
    req = request.make_request(
        server("gemma-plain").url, reference_url=server("fixture-plain").url, seeds=100
    )
    with pytest.raises(RescoreError, match="do not serve the same model"):
        runner.run(req)


def test_top_k_zero_on_gemma_is_refused(server: Callable[..., Any]) -> None:
    req = request.make_request(
        server("gemma-spec").url,
        reference_url=server("gemma-plain").url,
        seeds=100,
        sampler=SamplerSettings(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0),
    )
    with pytest.raises(RescoreError, match="262144-token vocabulary"):
        runner.run(req)


def test_a_reference_dying_mid_run_keeps_every_sample(
    server: Callable[..., Any], fixture_set: fixtures.FixtureSet
) -> None:
    """The reference is stopped after a few samples: every sample already drawn stays in the
    result, which says how far re-scoring got and decides nothing. (Its own reference server:
    the test stops it.)"""
    bins = llama.ensure()
    ref = LlamaServer(bins, fixture_set.target, parallel=1, name="reference")
    stopped = threading.Event()

    def progress(done: int, _total: int) -> None:
        if done >= 10 and not stopped.is_set():
            stopped.set()
            ref.stop()

    with ref:
        req = _fixture_request(server("fixture-spec").url, ref.url, fixture_set, seeds=100)
        res = runner.run(req, progress=progress)
    assert stopped.is_set()
    assert res.error is not None and "reference failed after" in res.error
    assert res.stats is None and res.exit_code == 2
    assert len(res.samples) == 100  # sampling went on: nothing drawn is lost
    assert 40 <= res.rescored < res.sampled_tokens


def _self_request(url: str, fs: fixtures.FixtureSet, sampler: SamplerSettings) -> Any:
    spec = fs.spec
    return request.make_request(
        url,
        self_check=True,
        prompt_ids=[spec.tokenize(spec.prompt)],
        seeds=300,
        tokens=4,
        sampler=sampler,
    )


def test_self_check_without_a_reference(
    server: Callable[..., Any], fixture_set: fixtures.FixtureSet, shared_servers: SharedServers
) -> None:
    """--self: the patched server samples what it reports (PRESERVED, every token tested);
    the stock one's placeholders are counted, not tested; a logprob mutant that reports the
    distribution without its temperature is BROKEN against its own numbers."""
    warm = SamplerSettings(top_k=3, top_p=1.0, min_p=0.0, temperature=0.7)
    good = runner.run(_self_request(server("fixture-spec-patched").url, fixture_set, warm))
    assert good.stats is not None and good.unreported == 0 and good.rescored == 1200
    assert good.stats.verdict is Verdict.PRESERVED, good.stats.reason
    stock = runner.run(_self_request(server("fixture-spec").url, fixture_set, warm))
    assert stock.unreported > 0 and stock.rescored + stock.unreported == 1200
    bins = llama.ensure(patches=(resolve("mutants/lp-no-temperature"),))
    bad = runner.run(
        _self_request(shared_servers.fixture(bins, fixture_set, "greedy").url, fixture_set, warm)
    )
    assert bad.stats is not None
    assert bad.stats.verdict is Verdict.BROKEN, bad.stats.reason
