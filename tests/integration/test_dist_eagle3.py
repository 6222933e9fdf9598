"""EAGLE3 (``--spec-type draft-eagle3``) under `dist`, on real llama-servers and the default
fixture.

The fixture's EAGLE3 head (`fixtures.eagle3_draft`, arch eagle3, ``target_layers`` [0, 0, 0])
is handed the target's hidden states, proposes greedily and is verified by sample-and-match,
so every sample must equal the plain server's for its seed, token for token, and the verdict
must be PRESERVED while the head drafts.

The servers are the session's "fixture-eagle3" (one slot: `presets.for_preset`) and
"fixture-plain"; the EAGLE3 server's 1000 samples are drawn once, one request at a time, for
both tests.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from specaudit import distribution, fixtures
from specaudit.audit import AuditContext
from specaudit.distribution.truth import encode_text
from specaudit.fixtures.truth import eagle3_greedy_draft
from specaudit.stats import Verdict

SEEDS = range(1, 1001)  # the report's 1000 seeds: enough to certify TV <= 0.15


def _collect(
    url: str, fs: fixtures.FixtureSet, label: str, concurrency: int | None = None
) -> list[distribution.Sample]:
    wl = distribution.make_workload(fs.spec)
    eng = distribution.ServerEngine(
        url, fs.spec, wl, label=label, kind=label, concurrency=concurrency
    )
    return distribution.collect(eng, SEEDS)


@pytest.fixture(scope="module")
def eagle3_samples(audit_ctx: AuditContext) -> list[distribution.Sample]:
    """The EAGLE3 server's samples, seeds 1..1000, one request at a time."""
    srv = audit_ctx.server("fixture-eagle3")
    assert srv.parallel == 1
    return _collect(srv.url, audit_ctx.fixture, "eagle3", concurrency=1)


def test_eagle3_head_drafts_and_keeps_the_distribution(
    audit_ctx: AuditContext, eagle3_samples: list[distribution.Sample]
) -> None:
    fs, samples = audit_ctx.fixture, eagle3_samples
    log = audit_ctx.server("fixture-eagle3").log_path.read_text(errors="replace")
    assert "--spec-type draft-eagle3" in log and fixtures.EAGLE3_FILE in log
    wl = distribution.make_workload(fs.spec)
    coded = [replace(s, text=encode_text(s.text, wl.tokens, fs.spec)) for s in samples]
    e = distribution.analyse(fs.spec, wl, coded, engine="eagle3", kind="eagle3")
    print(f"\neagle3, seeds 1..{SEEDS[-1]}: {e.verdict.value}, {e.drafted} drafted, "
          f"{e.accepted} accepted")  # fmt: skip
    assert e.verdict is Verdict.PRESERVED, e.reason
    assert e.drafted is not None and e.drafted > len(SEEDS)
    assert e.accepted is not None and 0 < e.accepted < e.drafted
    # sample-and-match: the target's own draw at every position, as without a draft
    plain = _collect(audit_ctx.server("fixture-plain").url, fs, "plain")
    assert [s.text for s in samples] == [s.text for s in plain]
    # one slot (several abort now and then in b11434): every sample's counts are the closed form's
    strays = sum(_counts(fs, s) != (s.drafted, s.accepted) for s in samples)
    assert strays == 0, f"{strays} of {len(samples)} samples' counts off the closed form"


def _counts(fs: fixtures.FixtureSet, s: distribution.Sample) -> tuple[int, int]:
    spec = fs.spec
    return fixtures.mtp_greedy_counts(spec, spec.prompt, s.text, drafter=eagle3_greedy_draft)


def test_one_slot_eagle3_drafts_exactly_the_closed_form(
    audit_ctx: AuditContext, eagle3_samples: list[distribution.Sample]
) -> None:
    """On one slot, one request at a time, every sample's drafted/accepted counts are what
    the head's closed-form greedy drafts give (it is handed the hidden state of the token
    before the one it is fed). With four slots and concurrent requests b11434 strays from it
    on a few samples (measured 1-6 of 1000): EAGLE3 draft state that depends on the other
    slots. Draft-side only: the samples stay the plain server's."""
    fs, samples = audit_ctx.fixture, eagle3_samples
    assert sum(s.drafted or 0 for s in samples) > len(SEEDS)
    assert [s for s in samples if _counts(fs, s) != (s.drafted, s.accepted)] == []
