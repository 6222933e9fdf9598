"""The life cycle every in-process engine shares (`dist.inprocess`), on a runtime that draws
from the fixture's closed form in memory (no torch, no OpenVINO): the engine's own
probabilities are checked against the closed form before any seed is sampled, and a failed
check is an error, not a verdict; one sampler per variant, each measured, with its findings
after it; the runtime closed however the run ended; a seed the runtime fails on is one line;
the audit shows each result as the engine's entry says."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest

from specaudit import distribution, fixtures
from specaudit.audit.sections import engines as engines_section
from specaudit.distribution import hf, openvino, registry
from specaudit.distribution.inprocess import InProcessEngine, Runtime, TruthCheck
from specaudit.distribution.request import DistRequest
from specaudit.stats import Verdict


class _Runtime(Runtime):
    """Draws from the closed form; `off`: how far its "own" probabilities are from it."""

    name = "memory"
    variant_name = "mode"
    variants = ("exact", "argmax")
    not_runnable: ClassVar[tuple[tuple[str, str], ...]] = (("memory gpu", "no GPU here"),)
    log: ClassVar[list[str]] = []
    off = 0.0

    def __init__(self, fs: fixtures.FixtureSet) -> None:
        self.spec = fs.spec
        self.log.append("load")

    @staticmethod
    def family() -> str:
        return "memory 1.0"

    def measure_truth(self, workload: distribution.Workload) -> TruthCheck:
        self.log.append("truth")
        return TruthCheck(
            "memory", "probabilities", "the closed form", 3, "contexts", self.off, 0.0,
            "after the sampler", 1e-5,
        )  # fmt: skip

    def engine(self, variant: str, workload: distribution.Workload) -> _Engine:
        self.log.append(f"engine {variant}")
        return _Engine(self, workload, variant)

    def findings(self, engine: InProcessEngine, workload: distribution.Workload) -> list[str]:
        self.log.append(f"findings {engine.variant}")
        return [f"{engine.label}: measured"]

    def close(self) -> None:
        self.log.append("close")


class _Engine(InProcessEngine):
    def draw(self, seed: int) -> tuple[list[int], int | None, int | None]:
        if seed < 0:
            raise RuntimeError("device lost\nat step 3")
        rng = np.random.default_rng(seed)
        spec, wl = self.runtime.spec, self.workload
        ids: list[int] = []
        for _ in range(wl.tokens):
            prefix = "".join(spec.tokens[i] for i in ids)
            p = np.array(
                list(
                    fixtures.conditional_distribution(spec, wl.prompt, prefix, wl.sampler).values()
                )
            )
            ids.append(
                int(np.argmax(p)) if self.variant == "argmax" else int(rng.choice(len(p), p=p))
            )
        return ids, None, None


def _build(req: DistRequest, ctx: registry.RunContext) -> Generator[registry.Unit, None, None]:
    modes = req.option("memory_modes") or _Runtime.variants
    yield from _Runtime(req.fixture).units(req.workload, modes, ctx)


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[fixtures.FixtureSet]:
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path))
    _Runtime.log.clear()
    entry = registry.EngineEntry(
        "memory", _build, row=_Runtime.row, audit=True,
        options=(registry.EngineOption("--memory-mode", "memory_modes", _Runtime.variants, ""),),
    )  # fmt: skip
    registry.register(entry)
    yield fixtures.build(tmp_path / "fx")
    registry.unregister("memory")


def _request(fs: fixtures.FixtureSet, **kw: Any) -> DistRequest:
    return distribution.make_request(
        ["memory"], fixture=fs, tokens=3, positions=2, joint=2, tolerance=0.2,
        sequential=True, seeds=3000, **kw,
    )  # fmt: skip


def test_the_truth_is_checked_before_any_seed_and_the_runtime_closed_after(
    memory: fixtures.FixtureSet,
) -> None:
    res = distribution.run(_request(memory, memory_modes=["exact", "argmax", "exact"]))
    assert [e.kind for e in res.engines] == ["memory-exact", "memory-argmax"]
    assert [e.engine for e in res.engines] == ["memory 1.0 exact", "memory 1.0 argmax"]
    exact, argmax = res.engines
    assert exact.verdict is not Verdict.BROKEN and argmax.verdict is Verdict.BROKEN
    assert _Runtime.log == [
        "load", "truth", "engine exact", "engine argmax", "findings exact", "findings argmax",
        "close",
    ]  # fmt: skip
    assert res.notes == [
        "memory probabilities vs the closed form on 3 contexts: max |diff| 0.0e+00 (raw), "
        "0.0e+00 (after the sampler), tolerance 1e-05",
        "memory 1.0 exact: measured",
        "memory 1.0 argmax: measured",
    ]
    assert res.not_covered == [("memory gpu", "no GPU here")]


def test_an_engine_that_does_not_compute_the_fixture_is_an_error_not_a_verdict(
    memory: fixtures.FixtureSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Runtime, "off", 2e-3)
    with pytest.raises(distribution.DistError) as ei:
        distribution.run(_request(memory))
    assert str(ei.value) == (
        "memory probabilities vs the closed form on 3 contexts: max |diff| 2.0e-03 (raw), "
        "0.0e+00 (after the sampler), tolerance 1e-05: memory does not compute the fixture"
    )
    assert _Runtime.log == ["load", "truth", "close"]  # no sampler made, nothing sampled


def test_the_runtime_is_closed_when_measuring_fails(
    memory: fixtures.FixtureSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specaudit.distribution import runner

    def fail(*a: object, **k: object) -> None:
        raise distribution.DistError("stopped")

    monkeypatch.setattr(runner, "measure", fail)
    with pytest.raises(distribution.DistError, match="stopped"):
        distribution.run(_request(memory))
    assert _Runtime.log[-1] == "close" and not any(x.startswith("findings") for x in _Runtime.log)


def test_an_unknown_variant_and_a_failed_seed_are_one_line(memory: fixtures.FixtureSet) -> None:
    import asyncio

    rt = _Runtime(memory)
    with pytest.raises(distribution.DistError, match=r"^unknown memory mode 'beam' \(one of"):
        rt.check_variants(["exact", "beam"])
    wl = distribution.make_workload(memory.spec, tokens=3)
    eng = rt.engine("exact", wl)
    with pytest.raises(distribution.DistError) as ei:
        asyncio.run(eng.sample(-1))
    assert str(ei.value) == (
        "memory 1.0 exact: generate() failed on seed -1: RuntimeError: device lost at step 3"
    )
    sample = asyncio.run(eng.sample(7))
    assert sample.seed == 7 and len(sample.text) == 3


def _result(engine: str, kind: str) -> Any:
    return SimpleNamespace(
        engine=engine, kind=kind, verdict=Verdict.PRESERVED, n_samples=1000, drafted=None,
        accepted=5, tv_bound=0.0812, samples_per_s=21.4,
    )  # fmt: skip


def test_the_audit_shows_each_engine_as_its_entry_says(
    memory: fixtures.FixtureSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engines table's rows, as before the entries said how: in-process engines by their
    family and variant, the others by their label and the generator the section names."""
    monkeypatch.setattr(hf.Models, "family", staticmethod(lambda: "transformers 5.23.0"))
    monkeypatch.setattr(
        openvino.Pipelines, "family", staticmethod(lambda: "openvino-genai 2026.4.1")
    )
    results = [
        ("transformers", "", [_result("transformers 5.23.0 assistant", "transformers-assistant")]),
        ("openvino", "", [_result("openvino-genai 2026.4.1 draft, logprobs=1", "openvino-draft")]),
        ("openai", "llama-server draft-simple", [_result("llama-server (openai)", "openai")]),
        ("memory", "", [_result("memory 1.0 argmax", "memory-argmax")]),
    ]
    dist_results: Any = [
        (name, gen, SimpleNamespace(fixture="last-token", engines=res))
        for name, gen, res in results
    ]
    tail = ("last-token", "PRESERVED", 1000, "-", 5, "0.081", "21")
    assert engines_section.rows(dist_results) == [
        ("transformers 5.23.0", "assistant", *tail),
        ("openvino-genai 2026.4.1", "draft", *tail),
        ("llama-server (openai)", "llama-server draft-simple", *tail),
        ("memory 1.0", "argmax", *tail),
    ]
    audited = [e.name for e in registry.entries() if e.audit]
    assert audited == ["transformers", "openvino", "memory"]
