"""llama-server's checkpoint replay path under `dist`, on real servers and the replay fixture.

The replay fixture (`fixtures.replay_spec`) is the last-token fixture with a Mamba target: a
recurrent memory that cannot drop a rejected draft suffix (b11434 rolls back only a few hybrid
architectures, not ``mamba``), so llama-server checkpoints the target before every
verification and, on a partial acceptance, restores the checkpoint, re-decodes what was
accepted and, on the next iteration, re-verifies it (greedy drafts: sample-and-match with the
sampler restored from its clone) or re-accepts it (``--spec-draft-sampling probabilistic``:
``server_accept_replay``). Its layer adds nothing, so its distribution is the last-token
closed form and the draft is the last-token fixture's llama draft.

What shows that the replay ran: with ``LLAMA_TRACE`` set llama-server logs "accepted k/n draft
tokens (restore checkpoint)" for every restore (tools/server/server-context.cpp); with no
trace there is no log line for it at the default verbosity.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import httpx
import pytest

from shared_servers import SharedServers
from specaudit import audit, distribution, fixtures
from specaudit.audit.sections import patched
from specaudit.llama.build import LlamaBinaries
from specaudit.stats import Verdict

SEEDS = range(1, 1001)  # the report's 1000 seeds: enough to certify TV <= 0.15


RESTORE = re.compile(r"accepted +(\d+)/ *(\d+) draft tokens \(restore checkpoint\)")


def _complete(url: str, spec: fixtures.FixtureSpec, seed: int, n_probs: int = 0) -> dict:
    body = {
        "prompt": spec.prompt,
        "n_predict": 4,
        "n_probs": n_probs,
        "seed": seed,
        **fixtures.REPORT_SAMPLER.request_fields(),
    }
    r = httpx.post(f"{url}/completion", json=body, timeout=60)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def test_the_mamba_target_serves_the_closed_form(
    llama_bins: LlamaBinaries, replay_fixture: fixtures.FixtureSet, shared_servers: SharedServers
) -> None:
    """The plain server on the Mamba target reports the last-token closed form at every
    position (first and later, five seeds)."""
    spec = replay_fixture.spec
    worst, checked = 0.0, 0
    srv = shared_servers.fixture(llama_bins, replay_fixture, "plain")
    for seed in range(1, 6):
        generated = ""
        for entry in _complete(srv.url, spec, seed, len(spec.tokens))["completion_probabilities"]:
            expected = fixtures.raw_distribution(spec, spec.prompt + generated)
            got = {c["token"]: math.exp(c["logprob"]) for c in entry["top_logprobs"]}
            for letter in spec.letters:
                worst = max(worst, abs(got.get(letter, 0.0) - expected[letter]))
            checked += 1
            generated += entry["token"]
    assert checked == 20
    assert worst < 1e-6


def test_greedy_replay_restores_and_returns_the_plain_servers_samples(
    llama_bins: LlamaBinaries, replay_fixture: fixtures.FixtureSet, shared_servers: SharedServers
) -> None:
    """The server drafts, restores its checkpoint on partial acceptances (the trace line), and
    sample-and-match still emits the target's own draw at each position: every sample is the
    plain server's for its seed."""
    spec = replay_fixture.spec
    seeds = range(1, 41)
    plain_srv = shared_servers.fixture(llama_bins, replay_fixture, "plain")
    plain = [_complete(plain_srv.url, spec, s)["content"] for s in seeds]
    drafted = accepted = 0
    srv = shared_servers.fixture(llama_bins, replay_fixture, "replay", env={"LLAMA_TRACE": "1"})
    logged = srv.log_path.stat().st_size  # what this test's requests add is counted
    replay = []
    for s in seeds:
        r = _complete(srv.url, spec, s)
        replay.append(r["content"])
        drafted += r["timings"].get("draft_n", 0)
        accepted += r["timings"].get("draft_n_accepted", 0)
    with srv.log_path.open("rb") as f:
        f.seek(logged)
        restores = RESTORE.findall(f.read().decode(errors="replace"))
    print(f"\nreplay, seeds 1..{seeds[-1]}: {drafted} drafted, {accepted} accepted, "
          f"{len(restores)} checkpoint restores")  # fmt: skip
    assert replay == plain
    assert drafted > 0 and 0 < accepted < drafted
    assert restores and all(int(k) < int(n) for k, n in restores)


def test_dist_on_the_replay_paths_at_four_tokens(
    llama_bins: LlamaBinaries, replay_fixture: fixtures.FixtureSet, tmp_path: Path
) -> None:
    """The report's workload (4 tokens, 1000 seeds): every path PRESERVED, with drafts on both
    replay paths. At 4 tokens no verification follows a replay (the one round of drafts ends
    at the third or fourth token when it replays; a token left over is sampled without a
    draft), so what the next test finds cannot show here."""
    req = distribution.make_request(
        ("server",), fixture=replay_fixture, binaries=llama_bins, work_dir=tmp_path,
        seeds=len(SEEDS),
    )  # fmt: skip
    res = distribution.run(req)
    print(f"\nreplay fixture, seeds 1..{SEEDS[-1]}:\n{distribution.paths_markdown(res)}")
    by_path = {e.path: e for e in res.engines}
    assert list(by_path) == ["plain", "replay", "replay-rejection"]
    for e in res.engines:
        assert e.verdict is Verdict.PRESERVED, (e.path, e.reason)
        assert e.n_samples == len(SEEDS)
    for p in ("replay", "replay-rejection"):
        e = by_path[p]
        assert e.drafted is not None and e.accepted is not None, p
        assert e.drafted > len(SEEDS) and 0 < e.accepted < e.drafted, p
    assert not any(p == "replay" for p, _ in res.not_covered)


# Where the probabilistic replay shows: rounds verified after a replay, from position 4 on (8
# tokens), at a deviation (prefix-averaged TV ~0.02 at position 4, by a simulation of the
# mechanism) that needs about 15000 samples for the fixed test's power: the audit's own runs
# (`patched.replay_run`: `patched.REPLAY_TOKENS` tokens, `patched.REPLAY_SEEDS`), stock and
# with the bundled `replay-fix` patch (docs/replay-fix.md).


def _run(ctx: audit.AuditContext, variant: str) -> distribution.EngineResult:
    e = patched.replay_run(ctx, variant)
    print(f"\n{variant} {e.path}, {patched.REPLAY_TOKENS} tokens, seeds {e.first_seed}.."
          f"{e.last_seed}: {e.verdict.value}, {e.drafted} drafted, {e.accepted} accepted, "
          f"{e.seconds:.0f} s; {e.reason}")  # fmt: skip
    return e


# one run per fixture, so each counts against the timeout of the first test that uses it
@pytest.fixture(scope="module")
def stock_rewind(audit_ctx: audit.AuditContext) -> distribution.EngineResult:
    return _run(audit_ctx, "stock")


@pytest.fixture(scope="module")
def fixed_rewind(audit_ctx: audit.AuditContext) -> distribution.EngineResult:
    return _run(audit_ctx, patched.REPLAY_FIX)


def _rejecting(e: distribution.EngineResult) -> set[str]:
    return {t.name for t in e.tests if t.rejected}


def test_probabilistic_replay_reuses_the_rejection_samplers_draws(
    stock_rewind: distribution.EngineResult,
) -> None:
    """A b11434 finding. The checkpoint restore copies the sampler saved before verifying back
    whole (`common_sampler_copy`), the rejection sampler's own stream (`gsmpl->rng`)
    included, and `server_accept_replay` draws nothing from it: the next verification reuses
    the uniforms that decided the replayed tokens, so its accept/reject decisions depend on
    the history they made. Positions 1-3 (before any post-replay verification) keep the
    closed form; later positions do not."""
    e = stock_rewind
    assert (e.n_samples, patched.REPLAY_TOKENS) == (len(patched.REPLAY_SEEDS), 8)
    assert e.verdict is Verdict.BROKEN, e.reason
    assert "position 4" in _rejecting(e)
    assert not {"position 1", "position 2", "position 3", "joint 1-3"} & _rejecting(e)


def test_keeping_the_rejection_stream_across_the_restore_preserves_the_distribution(
    fixed_rewind: distribution.EngineResult,
) -> None:
    """The same run on the `replay-fix` build (`common_sampler_copy` leaves the stream
    alone): PRESERVED with no test rejecting, as the llama target's rejection path (no
    replay) is on this workload; and the replay still ran (drafts accepted and rejected)."""
    e = fixed_rewind
    assert e.verdict is Verdict.PRESERVED, e.reason
    assert not _rejecting(e)
    assert e.drafted is not None and e.accepted is not None
    assert 0 < e.accepted < e.drafted


def test_the_audit_section_shows_stock_broken_and_the_fix_preserved(
    audit_ctx: audit.AuditContext,
    stock_rewind: distribution.EngineResult,
    fixed_rewind: distribution.EngineResult,
) -> None:
    """The audit's pair (`patched.replay_pair` runs exactly these two) rendered."""
    pair = patched.ReplayPair(
        audit_ctx.replay_fixture.spec.name, patched.REPLAY_TOKENS, stock_rewind, fixed_rewind
    )
    assert pair.proven
    sec = patched.replay_section(audit_ctx, pair)
    assert sec.key == "replay" and sec.status == "ok", sec.summary
    assert sec.summary == "replay-rejection, 8 tokens, 15000 seeds: BROKEN -> PRESERVED"
    assert "| stock | BROKEN (15000 seeds" in sec.markdown
    assert "| replay-fix | PRESERVED (15000 seeds" in sec.markdown
