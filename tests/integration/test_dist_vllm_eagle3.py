"""vLLM's ``eagle3`` method for real, on the default fixture exported for vLLM and an EAGLE3
head specaudit builds on it (`fixtures.hf_heads.export_eagle3_head`): the aux hidden states of two
target layers, ``fc``, the head's own norm and lm_head over a draft vocabulary mapped by
``d2t``. The head's drafts are known in closed form (the target's favourite two tokens after
the position vLLM hands it, repeated), so every request's drafted and accepted counts (from
/metrics) are a function of its sample, and vLLM's whole EAGLE3 path (aux-state collection,
the proposer's schedule, verification) is checked request by request; with specaudit's
cpu-sampler fix the samples keep the distribution. One server, module-scoped, always stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from specaudit import distribution, fixtures
from specaudit.distribution import vllm as dv
from specaudit.fixtures import hf_heads
from specaudit.stats import Verdict
from specaudit.vllm.fixes import resolve

if TYPE_CHECKING:
    from specaudit.fixtures.hf import HfExport
    from specaudit.vllm.env import VllmEnv
    from specaudit.vllm.server import VllmServer

pytestmark = pytest.mark.timeout(3600)  # a vLLM start takes minutes on a busy 2-core machine
SEEDS = range(1, 401)
# measured 167 of 1431 (200 seeds, top-p 0.8): the first draft of a round is accepted about
# one time in three, its repeats rarely
MIN_ACCEPTED_SHARE = 0.06
SAMPLER = fixtures.SamplerSettings(top_k=0, top_p=0.8, min_p=0.0, temperature=1.0)


@pytest.fixture(scope="module")
def eagle3_server(
    vllm_env: VllmEnv, vllm_export: HfExport, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    from specaudit.vllm.server import VllmServer

    head = hf_heads.export_eagle3_head(vllm_export)
    log = tmp_path_factory.mktemp("vllm-eagle3") / "vllm.log"
    ex = vllm_export
    with VllmServer(
        vllm_env, ex.target, speculative=dv.speculative_config("eagle3", ex.draft, head),
        log_path=log, fixes=resolve(("cpu-sampler",)), **dv.server_args(ex.spec),
    ) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def eagle3_samples(
    eagle3_server: VllmServer, vllm_export: HfExport
) -> tuple[distribution.Workload, list[distribution.Sample]]:
    spec = vllm_export.spec
    wl = distribution.make_workload(spec, sampler=SAMPLER)
    eng = dv.VllmEngine(
        eagle3_server.url, str(vllm_export.target), spec, wl, "eagle3-fixed", family="vLLM"
    )
    return wl, distribution.collect(eng, SEEDS)


def _closed_form_counts(spec: fixtures.FixtureSpec, generated: str) -> tuple[int, int]:
    favourite = {x: f for x, (f, _) in hf_heads.two_step_favourites(spec).items()}

    def head(_spec: fixtures.FixtureSpec, prev: str, last: str, n: int) -> str:
        return favourite[prev[-1]] * n  # handed the state of the token before `last`

    return fixtures.mtp_greedy_counts(
        spec, spec.prompt, generated, n_max=dv.SPECULATIVE_TOKENS, drafter=head, capped=False
    )


def test_every_vllm_eagle3_request_drafts_and_accepts_what_the_heads_closed_form_gives(
    eagle3_samples: tuple[distribution.Workload, list[distribution.Sample]],
    vllm_export: HfExport,
) -> None:
    """Per request, /metrics' drafted and accepted deltas equal the counts of the head's
    closed-form drafts on that sample (greedy drafts: a draft is accepted exactly when the
    sample continues with it). A bug in which layers' states vLLM collects, in ``fc``/``d2t``,
    or in the proposer's schedule moves them; measured: 80 of 80 exact."""
    spec = vllm_export.spec
    _, samples = eagle3_samples
    assert sum(s.drafted or 0 for s in samples) > len(SEEDS)
    wrong = [s for s in samples if _closed_form_counts(spec, s.text) != (s.drafted, s.accepted)]
    assert wrong == []


def test_vllm_eagle3_verification_with_the_cpu_sampler_fix_keeps_the_distribution(
    eagle3_samples: tuple[distribution.Workload, list[distribution.Sample]],
    vllm_export: HfExport,
) -> None:
    """The samples through dist's analysis: not BROKEN, no token the closed form forbids at
    top-p 0.8, and verification really ran (a share of the drafts accepted, the rest
    rejected). Stock vLLM 0.32.0's CPU sampler breaks this path (docs/vllm.md)."""
    wl, samples = eagle3_samples
    e = distribution.analyse(vllm_export.spec, wl, samples, engine="vLLM eagle3", kind="eagle3")
    assert e.verdict is not Verdict.BROKEN, e.reason
    assert e.impossible == 0
    assert e.drafted is not None and e.accepted is not None
    assert e.drafted > e.accepted > MIN_ACCEPTED_SHARE * e.drafted
