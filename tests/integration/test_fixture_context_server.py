"""The context fixture against real llama-servers (b11434): the closed form of a fixture whose
next-token distribution depends on the whole context (and positions) agrees with the plain
server's reported probabilities, and speculation keeps its sampling distribution.

The servers are the session's context-fixture roles (conftest: "fixture-context-plain",
"-spec", "-spec-rejection", sized by presets' "fixture-context" policy), the fixture the
session's context fixture; their results at the report's 1000 seeds are the audit's dist
section's, run once for the session (conftest's `dist_result`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from specaudit import distribution, fixtures
from specaudit.audit import AuditContext
from specaudit.stats import Verdict

DistResultFn = Callable[[str, str], distribution.EngineResult]
# several contexts: the report's prompt, one letter, mixed, repeated, and a long one
PROMPTS = ("bcdbc", "a", "hgfeab", "ddddddd", "abcdefgh" * 6 + "b")
N_PREDICT = 6  # positions 1..6 after each prompt
OTHER_SAMPLER = fixtures.SamplerSettings(top_k=0, top_p=0.9, min_p=0.05, temperature=0.7)


@pytest.fixture(scope="module")
def ctx_fixture(audit_ctx: AuditContext) -> fixtures.FixtureSet:
    fs = audit_ctx.context_fixture
    assert fs.spec.kind == "context"
    return fixtures.load(fs.dir)  # through the SHA-checking loader, as the CLI does


@pytest.fixture(scope="module")
def plain_url(audit_ctx: AuditContext, server: Callable[[str], Any]) -> str:
    handle = server("fixture-context-plain")
    if not handle.external:  # the f32 KV cache the closed form needs (presets.POLICIES)
        assert audit_ctx.server(handle.name).argv()[-4:] == ["-ctk", "f32", "-ctv", "f32"]
    return str(handle.url)


def _probs(
    url: str, prompt: str, seed: int, sampler: fixtures.SamplerSettings, post: bool
) -> list[dict]:
    body = {
        "prompt": prompt,
        "n_predict": N_PREDICT,
        "n_probs": 11,
        "post_sampling_probs": post,
        "seed": seed,
        "samplers": list(distribution.SAMPLER_CHAIN),
        **sampler.request_fields(),
    }
    r = httpx.post(f"{url}/completion", json=body, timeout=60)
    assert r.status_code == 200, r.text
    entries = r.json()["completion_probabilities"]
    assert len(entries) == N_PREDICT
    return entries


def _worst_by_position(
    url: str, spec: fixtures.FixtureSpec, sampler: fixtures.SamplerSettings, post: bool
) -> list[float]:
    """max |server - closed form| over every token, per generated position (1-based index+1),
    over PROMPTS x seeds 1..3."""
    worst = [0.0] * N_PREDICT
    for prompt in PROMPTS:
        for seed in (1, 2, 3):
            generated = ""
            for pos, entry in enumerate(_probs(url, prompt, seed, sampler, post)):
                ctx = prompt + generated
                # keyed by token id: specials come back as "" pieces
                if post:
                    expected = fixtures.next_token_distribution(spec, ctx, sampler)
                    got = {spec.tokens[c["id"]]: c["prob"] for c in entry["top_probs"]}
                    # exactly the tokens the chain keeps are reported
                    assert set(got) == {t for t, p in expected.items() if p > 0}, ctx
                else:
                    expected = fixtures.raw_distribution(spec, ctx)
                    got = {
                        spec.tokens[c["id"]]: math.exp(c["logprob"]) for c in entry["top_logprobs"]
                    }
                    assert set(got) == set(spec.tokens)  # n_probs = vocabulary: all reported
                err = max(abs(got.get(t, 0.0) - expected[t]) for t in spec.tokens)
                worst[pos] = max(worst[pos], err)
                generated += entry["token"]
    return worst


@pytest.mark.parametrize("post", [False, True], ids=["pre-sampling", "post-sampling"])
@pytest.mark.parametrize(
    "sampler", [fixtures.REPORT_SAMPLER, OTHER_SAMPLER], ids=["top-k-3", "top-p-min-p-temp"]
)
def test_n_probs_match_the_closed_form(
    plain_url: str,
    ctx_fixture: fixtures.FixtureSet,
    sampler: fixtures.SamplerSettings,
    post: bool,
) -> None:
    worst = _worst_by_position(plain_url, ctx_fixture.spec, sampler, post)
    print(f"max |server - closed form| by position: {[f'{w:.1e}' for w in worst]}")
    assert max(worst) < 1e-4, worst


def test_the_server_sees_the_context(plain_url: str, ctx_fixture: fixtures.FixtureSet) -> None:
    """Same last letter, other histories: the server's own probabilities differ (the
    last-token fixture's could not)."""
    spec = ctx_fixture.spec
    seen = []
    for prompt in ("bcdbc", "aaaac", "hgfec"):
        entry = _probs(plain_url, prompt, 1, fixtures.REPORT_SAMPLER, False)[0]
        seen.append({c["token"]: math.exp(c["logprob"]) for c in entry["top_logprobs"]})
    tv = 0.5 * sum(abs(seen[0][t] - seen[1][t]) for t in spec.letters)
    assert tv >= 0.2


# the 1000-seed results of the session's servers: the audit's dist section's (`dist_result`)


def test_plain_server_preserves(dist_result: DistResultFn) -> None:
    res = dist_result("fixture-context", "plain")
    print(res.reason)
    assert res.verdict is Verdict.PRESERVED, res.reason
    assert res.n_samples == 1000 and res.drafted is None


def test_draft_server_preserves(dist_result: DistResultFn) -> None:
    res = dist_result("fixture-context", "greedy")
    print(res.reason, res.drafted, res.accepted)
    assert res.verdict is Verdict.PRESERVED, res.reason
    # speculation happened, and drafts were rejected as well as accepted
    assert res.drafted is not None and res.drafted > 1000
    assert res.accepted is not None and 0 < res.accepted < res.drafted


def test_probabilistic_draft_server_preserves(dist_result: DistResultFn) -> None:
    res = dist_result("fixture-context", "rejection")
    print(res.reason, res.drafted, res.accepted)
    assert res.verdict is Verdict.PRESERVED, res.reason
    assert res.drafted is not None and res.accepted is not None and 0 < res.accepted < res.drafted


def test_run_with_fixture_kind_context(
    plain_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A request with `fixture_kind="context"` builds the context fixture itself and tests
    with it."""
    work = tmp_path_factory.mktemp("dist-run-context")
    req = distribution.make_request(
        ["url"], url=plain_url, fixture_kind="context", seeds=300, tolerance=0.3, work_dir=work
    )
    res = distribution.run(req)
    assert res.fixture == fixtures.context_spec().name
    assert res.fixture_dir == work / "context"
    (eng,) = res.engines
    assert eng.verdict is Verdict.PRESERVED, eng.reason
