"""An engine that runs converted weights (OpenVINO's F16 copy) is tested against the closed
form of what it runs: `Unit.spec` replaces the request's fixture in the runner. Shown with an
in-memory engine that samples another fixture's closed form exactly."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

import closed_form
from specaudit import distribution, fixtures
from specaudit.distribution import Sample, Truth, Workload
from specaudit.distribution.registry import EngineEntry, RunContext, Unit, register, unregister
from specaudit.distribution.request import DistRequest
from specaudit.stats import Verdict


class _Exact:
    """Samples `spec`'s closed form (a stand-in for an engine running converted weights)."""

    kind = "exact-other"
    label = "exact sampler of another fixture"
    concurrency = 8

    def __init__(self, spec: fixtures.FixtureSpec, workload: Workload) -> None:
        self.truth = Truth(spec, workload)

    async def sample(self, seed: int) -> Sample:
        return Sample(seed, closed_form.text(self.truth, seed))

    async def aclose(self) -> None:
        return None


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, bool]]:
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path))
    use_spec = {"on": True}
    other = fixtures.other_spec()

    def build(req: DistRequest, ctx: RunContext) -> Generator[Unit, None, None]:
        eng = _Exact(other, req.workload)
        yield Unit(eng, spec=other if use_spec["on"] else None)

    register(EngineEntry("exact-other", build))
    yield use_spec
    unregister("exact-other")


def test_units_spec_is_the_truth_the_samples_are_tested_against(
    engine: dict[str, bool], tmp_path: Path
) -> None:
    fs = fixtures.build(tmp_path / "fx")
    req = distribution.make_request(["exact-other"], fixture=fs, seeds=400)
    (e,) = distribution.run(req).engines
    assert e.verdict is not Verdict.BROKEN, e.reason
    engine["on"] = False  # the request's own fixture: another distribution
    (e,) = distribution.run(req).engines
    assert e.verdict is Verdict.BROKEN
