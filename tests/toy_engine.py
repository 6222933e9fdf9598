"""A toy `dist` engine, written the way docs/dist.md ("Adding an engine") says: one module with
the registry's hook, `register_engines`. It samples the fixture's closed form in memory
(`--toy-mode exact`), or always its most likely token (`--toy-mode greedy`, which a correct
test calls BROKEN). conftest's `toy` fixture installs it as a package (an entry point of the
group ``specaudit.engines``); the registry's and rescore's tests drive it through `specaudit
dist` and `specaudit rescore --dist-engine`."""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

import closed_form
from specaudit.distribution import Sample, Truth, Workload
from specaudit.distribution.registry import EngineEntry, EngineOption, Register, RunContext, Unit
from specaudit.distribution.request import DistRequest
from specaudit.fixtures import FixtureSpec

MODES = ("exact", "greedy")


class ToyEngine:
    """Samples in-process from the truth (no server): `dist.engines.Engine`."""

    kind = "toy"
    concurrency = 8

    def __init__(self, spec: FixtureSpec, workload: Workload, mode: str) -> None:
        self.label = f"toy ({mode})"
        self.truth = Truth(spec, workload)
        self.tokens = workload.tokens
        self.mode = mode

    async def sample(self, seed: int) -> Sample:
        if self.mode == "exact":
            return Sample(seed, closed_form.text(self.truth, seed))
        text = ""
        for _ in range(self.tokens):
            text += self.truth.labels[int(np.argmax(self.truth.next(text)))]
        return Sample(seed, text)

    async def aclose(self) -> None:
        return None


def build(req: DistRequest, ctx: RunContext) -> Generator[Unit, None, None]:
    mode = (req.option("toy_modes") or ("exact",))[-1]
    yield Unit(ToyEngine(req.fixture.spec, req.workload, mode))


TOY = EngineEntry(
    "toy",
    build,
    help="an in-memory sampler of the fixture's closed form",
    options=(EngineOption("--toy-mode", "toy_modes", MODES, "How the toy samples."),),
)


def register_engines(register: Register) -> None:
    """The registry's hook: what the entry point names."""
    register(TOY)
