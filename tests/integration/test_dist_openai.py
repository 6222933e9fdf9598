"""`--engine openai` (/v1/completions) against the session's real llama-servers: the same
samples, seed for seed, and the same verdict as the native /completion engine; a fleet of
servers spreads the seeds and changes nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from specaudit import distribution, fixtures
from specaudit.stats import Verdict

SEEDS = range(1, 1001)


def test_openai_engine_agrees_with_native(
    server: Callable, dist_result: Callable, fixture_set: fixtures.FixtureSet
) -> None:
    url = server("fixture-spec").url
    spec = fixture_set.spec
    wl = distribution.make_workload(spec)
    native = distribution.collect(distribution.ServerEngine(url, spec, wl), range(1, 201))
    oai = distribution.OpenAIEngine(url, spec, wl)
    assert oai.model.endswith(fixtures.TARGET_FILE)  # /v1/models named the fixture
    assert [s.text for s in distribution.collect(oai, range(1, 201))] == [s.text for s in native]
    # the native engine's result on this server and these seeds: the audit's dist section's
    res_native = dist_result("fixture", "greedy")
    assert res_native.n_samples == len(SEEDS)
    res_oai = distribution.measure(distribution.OpenAIEngine(url, spec, wl), spec, wl, SEEDS)
    assert res_native.verdict is Verdict.PRESERVED, res_native.reason
    assert res_oai.verdict is res_native.verdict, res_oai.reason
    # llama-server's /v1/completions carries its timings: the draft counts come through
    assert res_oai.drafted == res_native.drafted and res_oai.accepted == res_native.accepted
    assert res_oai.drafted is not None and res_oai.drafted > 0


def test_fleet_spreads_seeds_and_keeps_seed_order(
    server: Callable, fixture_set: fixtures.FixtureSet
) -> None:
    # the plain and the speculating server give the same sample for a seed: a fleet of the
    # two must give exactly one server's samples, in seed order
    urls = [server("fixture-plain").url, server("fixture-spec").url]
    res = distribution.run(
        distribution.make_request(["openai"], fixture=fixture_set, url=urls, seeds=400)
    )
    (e,) = res.engines
    assert e.verdict in (Verdict.PRESERVED, Verdict.INCONCLUSIVE), e.reason
    assert e.verdict is not Verdict.BROKEN
    spec = fixture_set.spec
    wl = distribution.make_workload(spec)
    fleet = distribution.FleetEngine([distribution.OpenAIEngine(u, spec, wl) for u in urls])
    one = distribution.collect(distribution.OpenAIEngine(urls[0], spec, wl), range(1, 301))
    got = distribution.collect(fleet, range(1, 301))
    assert [s.seed for s in got] == list(range(1, 301))
    assert [s.text for s in got] == [s.text for s in one]
    assert all(n > 50 for n in fleet.served), fleet.served  # both servers answered
    # the same through the native engine (--engine url, repeatable --url)
    res_url = distribution.run(
        distribution.make_request(["url"], fixture=fixture_set, url=urls, seeds=400)
    )
    assert res_url.engines[0].n_samples == 400
    assert res_url.engines[0].verdict is e.verdict


def test_cli_openai_repeatable_url(
    cli: Callable, server: Callable, fixture_set: fixtures.FixtureSet
) -> None:
    urls = [server("fixture-plain").url, server("fixture-spec").url]
    code, out, err = cli(
        "dist", "--engine", "openai", "--url", urls[0], "--url", urls[1],
        "--fixture", str(fixture_set.dir), "--seeds", "1000", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert '"verdict": "PRESERVED"' in out


def test_openai_refuses_a_server_that_is_not_the_fixture(
    server: Callable, fixture_set: fixtures.FixtureSet
) -> None:
    # a fixture with other letters than the served one: its prompt is not the server's
    # letters (llama-server refuses it) or, had it answered, the text would be: an error, never
    # a verdict
    other = fixtures.FixtureSpec(
        name="other-letters",
        letters=tuple("stuvwxyz"),
        target=fixture_set.spec.target,
        draft=fixture_set.spec.draft,
        draft_seed=0,
        draft_noise_scale=0.0,
        prompt="tuvtu",
    )
    wl = distribution.make_workload(other)
    eng = distribution.OpenAIEngine(server("fixture-plain").url, other, wl)
    with pytest.raises(distribution.DistError, match="HTTP 400|not fixture letters"):
        distribution.collect(eng, range(1, 3))
