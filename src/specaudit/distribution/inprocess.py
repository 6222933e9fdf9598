"""The life cycle every engine `dist` runs in-process shares (transformers, OpenVINO GenAI).

Why one base: such an engine loads the fixture into a runtime of its own (a Hugging Face model,
a converted OpenVINO pipeline; next, a vLLM server process of ours), and a verdict against the
closed form means something only if that runtime computes the fixture. So, always in this
order (`Runtime.units`): load; compare the engine's *own* probabilities with the closed form
(`Runtime.check_truth`, one `TruthCheck` type, a DistError beyond its tolerance, before any
seed is sampled); one sampler per variant (a transformers candidate generator, an OpenVINO
path), each measured by the runner, with whatever the engine learns about a variant after it
(`Runtime.findings`) added to the run's notes; then `close`, however the run ended.

A sampler (`InProcessEngine`) draws one seed at a time (``generate`` is synchronous and the
model tiny: `concurrency` 1); its label is the runtime's `family` and the variant, its kind
``<engine>-<variant>``, which is also how the audit's engines table shows it (`Runtime.row`).
"""

from __future__ import annotations

import abc
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import ClassVar

from specaudit import fixtures
from specaudit.distribution.registry import RunContext, Unit
from specaudit.distribution.results import DistError, EngineResult, Sample, Workload
from specaudit.distribution.truth import encode_ids


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's text on one line (engines' runtimes raise multi-line C++ messages)."""
    return " ".join(str(e).split())[:limit]


@dataclass(frozen=True)
class TruthCheck:
    """An engine's own probabilities against the fixture's closed form, before sampling: the
    largest difference over what was compared, raw (softmax of the logits) and after the
    sampler, each within `tolerance` or the engine does not compute the fixture."""

    engine: str  # who computed the probabilities, e.g. "transformers", "OpenVINO"
    what: str  # e.g. "next-token probabilities", "probabilities (plain, f32)"
    against: str  # e.g. "the closed form", "the closed form of the F16 weights"
    compared: int  # how many contexts or tokens were compared
    unit: str  # what `compared` counts: "contexts", "tokens"
    max_raw: float  # max |raw probability - closed form|
    max_processed: float  # max |sampler's probability - closed form|
    processed: str  # how the line names the sampler's values: "after the sampler", "processed"
    tolerance: float

    @property
    def passed(self) -> bool:
        return max(self.max_raw, self.max_processed) <= self.tolerance

    def line(self) -> str:
        return (
            f"{self.engine} {self.what} vs {self.against} on {self.compared} {self.unit}: max "
            f"|diff| {self.max_raw:.1e} (raw), {self.max_processed:.1e} ({self.processed}), "
            f"tolerance {self.tolerance:g}"
        )

    def require(self) -> TruthCheck:
        """Itself when it passed; a DistError (not a verdict) when it did not."""
        if not self.passed:
            raise DistError(f"{self.line()}: {self.engine} does not compute the fixture")
        return self


class Runtime(abc.ABC):
    """One in-process engine's runtime on one fixture, loaded by the constructor. Subclasses
    say what the engine is called (`name`), its variants, what it cannot run on a fixture, its
    `family` (the label's first part), and implement `measure_truth` and `engine`."""

    name: ClassVar[str]  # the registry name; every sampler's kind is f"{name}-{variant}"
    variant_name: ClassVar[str]  # what a variant is called in errors: "generator", "path"
    variants: ClassVar[tuple[str, ...]]
    not_runnable: ClassVar[tuple[tuple[str, str], ...]] = ()
    spec: fixtures.FixtureSpec  # the closed form samples are tested against

    @staticmethod
    @abc.abstractmethod
    def family() -> str:
        """The engine and its version, e.g. "transformers 5.23.0" (its extra is installed)."""

    @abc.abstractmethod
    def measure_truth(self, workload: Workload) -> TruthCheck:
        """The engine's own probabilities against the closed form (not yet judged)."""

    @abc.abstractmethod
    def engine(self, variant: str, workload: Workload) -> InProcessEngine:
        """The sampler of one variant."""

    def findings(self, engine: InProcessEngine, workload: Workload) -> list[str]:
        """Notes on a variant once it was measured (none unless the engine has some)."""
        return []

    def close(self) -> None:
        """Release what the constructor loaded (nothing unless the engine holds something)."""
        return None

    @classmethod
    def check_variants(cls, variants: Iterable[str]) -> tuple[str, ...]:
        """`variants` once each, in order; a one-line DistError for an unknown one."""
        out = tuple(dict.fromkeys(variants))
        for v in out:
            if v not in cls.variants:
                raise DistError(
                    f"unknown {cls.name} {cls.variant_name} {v!r} (one of "
                    f"{', '.join(cls.variants)})"
                )
        return out

    def check_truth(self, workload: Workload) -> TruthCheck:
        """`measure_truth`, required to pass (DistError otherwise)."""
        return self.measure_truth(workload).require()

    def units(
        self, workload: Workload, variants: Iterable[str], ctx: RunContext
    ) -> Generator[Unit, None, None]:
        """The life cycle (module doc), as a registry `build` yields it: the truth check's line
        and what the engine cannot run go to the run's notes, then one unit per variant (every
        sampler made before the first is measured: a variant that cannot load fails first)."""
        try:
            variants = self.check_variants(variants)
            ctx.notes.append(self.check_truth(workload).line())
            ctx.not_covered.extend(self.not_runnable)
            engines = [self.engine(v, workload) for v in variants]
            for eng in engines:
                yield Unit(eng, spec=self.spec)
                ctx.notes.extend(self.findings(eng, workload))
        finally:
            self.close()

    @classmethod
    def row(cls, result: EngineResult) -> tuple[str, str]:
        """The audit's engines table: (the engine and its version, the variant)."""
        return cls.family(), result.kind.removeprefix(f"{cls.name}-")


class InProcessEngine(abc.ABC):
    """One variant of a `Runtime`: dist's `Engine`, one synchronous `draw` per seed."""

    concurrency = 1  # generate() is synchronous; the model is tiny

    def __init__(
        self, runtime: Runtime, workload: Workload, variant: str, suffix: str = ""
    ) -> None:
        runtime.check_variants((variant,))
        self.runtime = runtime
        self.workload = workload
        self.variant = variant
        self.label = f"{runtime.family()} {variant}{suffix}"
        self.kind = f"{runtime.name}-{variant}"

    @abc.abstractmethod
    def draw(self, seed: int) -> tuple[list[int], int | None, int | None]:
        """One seed's generated token ids, and its drafted and accepted counts (None: the
        engine does not report them)."""

    async def sample(self, seed: int) -> Sample:
        try:
            ids, drafted, accepted = self.draw(seed)
        except DistError:
            raise
        except Exception as e:  # the runtime failed on one seed: one line, with the seed
            raise DistError(
                f"{self.label}: generate() failed on seed {seed}: {type(e).__name__}: "
                f"{one_line(e, 200)}"
            ) from None
        text = encode_ids(ids, self.workload.tokens, self.runtime.spec)
        return Sample(seed, text, drafted, accepted)

    async def aclose(self) -> None:
        return None


__all__ = ["InProcessEngine", "Runtime", "TruthCheck", "one_line"]
