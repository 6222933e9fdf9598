"""Logprob fidelity on Gemma 3 270M (served as its own draft): the five logprob mutants are real
but wrong against a plain Gemma reference server, while `specaudit.check` calls them real.

Every /completion token (pre- and post-sampling, streamed and not: `with_reference.KINDS`) is
classified against the reference's answer for its exact prefix
(`reference.ServerReference`), within the tolerance measured from the reference's own
spread on the same sampler settings (`with_reference.measure_floor`: batch sizes 1, 2, 4 and
the last 1-16 tokens as one batch on a cached prefix), and every wrong call confirmed against
the spread at its own prefix (`with_reference.confirm_wrong`). The reference and the greedy
spec-logprobs control are the session's servers; each mutant is its own build (an incremental
rebuild) served once (`shared_servers`: lp-no-temperature's is test_check_reference's too).

Each mutant runs where its bug shows on this model (docs/mutants.md, "Logprob mutants"; the
settings in `WORKLOADS`), next to the spec-logprobs build on the same settings and path as the
control (all real-correct). The tolerance is Gemma's own: its measured prob floor was 0.10 at
T = 0.7 and 0.013 at T = 1 (the same prompt, the reference's own sample), so the settings are
chosen for a deviation well above it, not just above zero:

- lp-no-temperature: temperature 0.7 (at T = 1 it is exactly the fix);
- lp-topk-renorm, lp-neighbour-position: top-k 40 at T = 1 with 2 candidates: the 40
  survivors keep mass the 2-3 kept candidates do not (the mutant renormalises over those), and
  most drafts are accepted (the neighbour's values are the next position's);
- lp-pre-as-post: top-k 5 at T = 1.5: the raw softmax keeps the mass beyond the 5 survivors
  (the fix truncates it) and is taken at T = 1. At top-k 40, T = 1 that mass is small on this
  model's confident continuation (2 of 48 tokens beyond the bound, by 10 %; at top-k 5, T = 1
  still 2, by 5 %); at T = 1.5 it is 20 of 48, 3.7 times the bound;
- lp-draft-probs: the same sampler on the rejection-sampling path (`--spec-draft-sampling
  probabilistic`), the only one with a draft distribution q. Gemma drafts for itself, so q = p
  unless the two samplers differ: llama.cpp's draft sampler is top-k 10 at the target's
  temperature (common/speculative.cpp), so against the target's top-k 40 the reported q
  renormalises over 10 tokens what the target spreads over 40.

`python -m pytest tests/integration/test_gemma_logprob_mutants.py -s` prints the table of
docs/fidelity.md ("Results on Gemma 3 270M").
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shared_servers import SharedServers
from specaudit import check, fidelity, llama
from specaudit.check import fidelity_probe, with_reference
from specaudit.check.fidelity_probe import FidelityRun
from specaudit.fixtures import SamplerSettings
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import resolve
from specaudit.reference import ServerReference
from specaudit.report import md_table

# a test may build its mutant (an incremental rebuild, minutes on 2 busy cores, after waiting
# for the build lock) and measure a noise floor before it probes anything
pytestmark = pytest.mark.timeout(2400)

PROMPT = "Once upon a time"
TOKENS = 12
SEEDS = (3,)


@dataclass(frozen=True)
class Workload:
    """The sampler settings, candidates asked for and draft sampling a mutant's bug shows under."""

    name: str
    sampler: SamplerSettings
    n_probs: int
    draft_sampling: str = "greedy"  # presets.DRAFT_SAMPLING: greedy or probabilistic

    @property
    def path(self) -> str:
        return "rejection" if self.draft_sampling == "probabilistic" else "greedy"

    @property
    def label(self) -> str:
        s = self.sampler
        parts = [f"top-k {s.top_k}"]
        if s.top_p < 1.0:
            parts.append(f"top-p {s.top_p:g}")
        if s.min_p > 0.0:
            parts.append(f"min-p {s.min_p:g}")
        return ", ".join([*parts, f"T {s.temperature:g}", f"{self.n_probs} candidates"])


WORKLOADS = {
    w.name: w
    for w in (
        Workload("T 0.7", SamplerSettings(40, 1.0, 0.0, 0.7), 5),
        Workload("T 1", SamplerSettings(40, 1.0, 0.0, 1.0), 2),
        Workload("top-k 5, T 1.5", SamplerSettings(5, 1.0, 0.0, 1.5), 2),
        Workload("T 1, rejection", SamplerSettings(40, 1.0, 0.0, 1.0), 2, "probabilistic"),
    )
}
# mutant -> (workload, the modes whose values it breaks)
MUTANTS: dict[str, tuple[str, frozenset[str]]] = {
    "lp-neighbour-position": ("T 1", frozenset({"pre", "post"})),
    "lp-pre-as-post": ("top-k 5, T 1.5", frozenset({"post"})),
    "lp-no-temperature": ("T 0.7", frozenset({"post"})),
    "lp-topk-renorm": ("T 1", frozenset({"post"})),
    "lp-draft-probs": ("T 1, rejection", frozenset({"post"})),
}
HEADERS = [
    "build", "path", "settings", "tokens", "real-correct", "real-wrong", "placeholder",
    "missing", "check says", "wrong in (largest error / bound)", "drafted/accepted",
]  # fmt: skip


def _progress(pct: float, msg: str) -> None:
    print(f"[specaudit] building a mutant: {pct:3.0f}% {msg[-60:]}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Measured:
    """A reference for one workload's sampler and the tolerance measured on it."""

    url: str
    ref: ServerReference
    floor: fidelity.NoiseFloor
    ids: list[int]


@pytest.fixture(scope="module")
def reference_url(server: Callable[[str], Any]) -> str:
    return str(server("gemma-plain").url)


@pytest.fixture(scope="module")
def measured(reference_url: str) -> Callable[[Workload], Measured]:
    """Per sampler: the reference client and the tolerance from its measured noise floor."""
    cache: dict[SamplerSettings, Measured] = {}

    def get(w: Workload) -> Measured:
        if w.sampler not in cache:
            ref = ServerReference(reference_url, w.sampler, raw_probs=max(w.n_probs, 20))
            ids = ref.tokenize(PROMPT)
            floor = with_reference.measure_floor(reference_url, ref, ids, w.sampler, tokens=TOKENS)
            print(f"{w.name}: noise floor {floor}", file=sys.stderr)
            cache[w.sampler] = Measured(reference_url, ref, floor, ids)
        return cache[w.sampler]

    return get


@pytest.fixture(scope="module")
def table() -> Iterator[list[list[str]]]:
    """The rows of the Gemma fidelity table, printed when the module is done (-s shows it)."""
    rows: list[list[str]] = []
    yield rows
    if rows:
        print("\n" + md_table(HEADERS, rows), file=sys.stderr)


def _probe(url: str, m: Measured, w: Workload) -> FidelityRun:
    """Every /completion kind on `url`, classified; a wrong call is confirmed against the
    reference's spread at its own prefix (`with_reference.confirm_wrong`), as `check
    --reference` does."""
    run = fidelity_probe.probe_server(
        url,
        prompt=m.ids,
        prompt_ids=m.ids,
        reference=m.ref,
        tol=fidelity.tolerance(m.floor),
        sampling=w.sampler.request_fields(),
        seeds=SEEDS,
        tokens=TOKENS,
        n_probs=w.n_probs,
        kinds=with_reference.KINDS,
    )
    run, floor = with_reference.confirm_wrong(run, m.url, m.ref, m.ids, w.sampler, m.floor)
    print(
        f"{url} ({w.name}): {run.counts}; drafted/accepted {run.drafted}; floor {floor}",
        file=sys.stderr,
    )
    return run


def _largest(tokens: list[fidelity.TokenFidelity]) -> str:
    """The largest deviation (by error over bound) of some tokens, as "error / bound"."""
    top = max((t.worst for t in tokens if t.worst is not None), key=lambda d: d.score, default=None)
    return "-" if top is None else f"{top.error:.3g} / {top.limit:.3g}"


def _row(build: str, w: Workload, run: FidelityRun) -> list[str]:
    c, k = run.counts, run.check_counts
    wrong = [t for _, t in run.wrong()]
    if wrong:
        where = ", ".join(
            f"{mode} ({_largest([t for t in wrong if t.mode == mode])})"
            for mode in sorted({t.mode for t in wrong})
        )
    else:
        where = f"none (largest {_largest([t for p in run.probes for t in p.result.tokens])})"
    drafted, accepted = run.drafted
    return [
        build, w.path, w.label, str(c.total), str(c.real_correct), str(c.real_wrong),
        str(c.placeholder), str(c.missing), f"{k.real} real, {k.placeholder} placeholder",
        where, f"{drafted}/{accepted}",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def controls(
    server: Callable[[str], Any],
    shared_servers: SharedServers,
    patched_bins: LlamaBinaries,
    gemma_path: Path,
    measured: Callable[[Workload], Measured],
    table: list[list[str]],
) -> Callable[[Workload], FidelityRun]:
    """spec-logprobs on a workload's settings and path, run once per workload: the session's
    "gemma-spec-patched" (greedy drafts), or the same build drafting probabilistically."""
    cache: dict[str, FidelityRun] = {}

    def get(w: Workload) -> FidelityRun:
        if w.name not in cache:
            if w.draft_sampling == "greedy":
                url = str(server("gemma-spec-patched").url)
            else:
                url = shared_servers.gemma_spec(patched_bins, gemma_path, w.draft_sampling).url
            cache[w.name] = _probe(url, measured(w), w)
            table.append(_row("spec-logprobs", w, cache[w.name]))
        return cache[w.name]

    return get


def test_stock_speculative_tokens_are_placeholders_on_gemma(
    server: Callable[[str], Any],
    measured: Callable[[Workload], Measured],
    table: list[list[str]],
) -> None:
    w = WORKLOADS["T 1"]
    run = _probe(server("gemma-spec").url, measured(w), w)
    table.append(_row("stock", w, run))
    c = run.counts
    assert c.placeholder > 0 and c.missing > 0, run.counts_by_kind()
    assert c.real_wrong == 0, run.wrong()[:3]
    assert run.check_counts.placeholder == c.placeholder + c.missing


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_fidelity_catches_a_logprob_mutant_on_gemma_that_check_calls_real(
    mutant: str,
    gemma_path: Path,
    shared_servers: SharedServers,
    measured: Callable[[Workload], Measured],
    controls: Callable[[Workload], FidelityRun],
    table: list[list[str]],
) -> None:
    name, modes = MUTANTS[mutant]
    w = WORKLOADS[name]
    # the control: the fix itself on the same settings and path, every token right
    good = controls(w)
    assert good.counts.real_correct == good.counts.total > 0, [
        (p.kind.label, t) for p, t in good.wrong()[:5]
    ]
    assert good.drafted[1] > 0  # speculative tokens were among them

    bins = llama.ensure(patches=(resolve(f"mutants/{mutant}"),), progress=_progress)
    assert bins.variant.startswith(f"mutant-{mutant}-")
    srv = shared_servers.gemma_spec(bins, gemma_path, w.draft_sampling)
    run = _probe(srv.url, measured(w), w)
    verdict = check.run(
        srv.url, prompt=PROMPT, tokens=TOKENS, top_k=w.n_probs,
        temperature=w.sampler.temperature, endpoint="native", probe_switch=False,
    )  # fmt: skip
    table.append(_row(mutant, w, run))
    # check: every token real, no placeholder anywhere
    assert verdict.verdict == "real" and verdict.placeholders == 0, verdict.reason
    assert run.check_counts.placeholder == 0
    assert run.counts.placeholder == 0 and run.counts.missing == 0
    # fidelity: wrong tokens, in the broken modes only, each from the speculative loop
    wrong = run.wrong()
    assert wrong, run.counts_by_kind()
    assert {t.mode for _, t in wrong} == modes, run.counts_by_kind()
    assert all(t.index > 0 for _, t in wrong)
    for kind in with_reference.KINDS:
        if ("post" if kind.post else "pre") not in modes:
            assert run.counts_by_kind()[kind.label].real_wrong == 0, kind.label
