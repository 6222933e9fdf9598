"""The OpenVINO GenAI engine: `ContinuousBatchingPipeline` with speculative decoding on CPU.

OpenVINO GenAI has no OpenAI server on PyPI, so it is audited in-process, the way
`dist --engine transformers` audits `generate()`. Its GGUF reader does not take the fixture as
written, so the fixture is converted first (`fixtures.openvino.convert`: F16 weights, a
``gpt2`` tokenizer, the draft as an IR folder) and every verdict is against the closed form of
the *converted* weights (`fixtures.openvino.f16_spec`). Before anything is sampled, the plain
pipeline's log-probabilities are compared with that closed form (`Pipelines.check_truth`, the
life cycle of `dist.inprocess`).

Paths (`PATHS`): ``plain`` (no draft), ``draft`` (a draft model; with sampling, OpenVINO
verifies by its speculative-sampling rule) and ``prompt-lookup`` (n-grams of the context). One
request per seed (``rng_seed`` = the seed, the prompt as token ids); the draft path's
drafted/accepted counts are what OpenVINO's `SDPerModelsPerfMetrics` reports for that request,
prompt lookup reports none.

Precision: on a CPU with bf16 support OpenVINO infers in bf16 with a u8 KV cache by default,
which moves the fixture's probabilities by up to ~1e-3; the pipelines here are built with
``INFERENCE_PRECISION_HINT`` and ``KV_CACHE_PRECISION`` f32 (`PROPERTIES`), which reproduce the
closed form to ~1e-7 (docs/openvino.md). One inference thread (``INFERENCE_NUM_THREADS``): the
fixture is tiny, and with the CPU's threads shared with other work the draft path repeated a
seed run alone twice in only 49 of 50 seeds (a test suite running beside it).

Sampler: OpenVINO applies top-k, then temperature, then min-p and top-p; llama.cpp (the closed
form) applies temperature last. The two agree when top-p is 1 and min-p 0 (top-k commutes with
a positive temperature), the only settings `check` lets through.

Besides sampling: `fidelity` (every reported ``generated_log_probs`` value against the closed
form for its prefix) and `reproducibility` (a seed twice; a request alone and in a batch),
both run on every path `dist` measures and reported in its notes (`path_findings`).
openvino-genai is imported on first use (`pip install 'specaudit[openvino]'`).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specaudit import fixtures
from specaudit.distribution.inprocess import InProcessEngine, Runtime, TruthCheck, one_line
from specaudit.distribution.registry import EngineEntry, EngineOption, Register, RunContext, Unit
from specaudit.distribution.request import DistRequest
from specaudit.distribution.results import DistError, Workload
from specaudit.fixtures import openvino as ov_fixtures

PATHS = ("plain", "draft", "prompt-lookup")
ASSISTANT_TOKENS = 3  # num_assistant_tokens (draft and prompt lookup)
MAX_NGRAM = 2  # max_ngram_size of prompt lookup
PATH_HELP = {
    "plain": "no draft",
    "draft": f"draft_model(draft IR), num_assistant_tokens={ASSISTANT_TOKENS} (the draft "
    "samples; OpenVINO's speculative sampling verifies)",
    "prompt-lookup": f"prompt_lookup=True, num_assistant_tokens={ASSISTANT_TOKENS}, "
    f"max_ngram_size={MAX_NGRAM} (n-grams of the context, no draft model)",
}
NOT_RUNNABLE = (
    ("openvino eagle3", "EAGLE-3 needs an EAGLE-3 draft trained on the target's hidden states"),
    ("openvino dflash", "DFlash needs a DFlash draft model"),
    ("openvino gemma4-mtp", "needs a Gemma 4 target with its MTP head"),
)
# What makes OpenVINO compute the fixture exactly (the CPU default may be bf16 / u8 KV cache).
PROPERTIES: dict[str, Any] = {
    "INFERENCE_PRECISION_HINT": "f32",
    "KV_CACHE_PRECISION": "f32",
    "INFERENCE_NUM_THREADS": 1,
}
TRUTH_TOLERANCE = 1e-5  # max |OpenVINO's probability - closed form| before sampling
FIDELITY_TOLERANCE = 1e-4  # |reported log-probability - closed form| still "real and correct"
EXTRA_HINT = "pip install 'specaudit[openvino]'"


def versions() -> dict[str, str]:
    """openvino and openvino-genai versions (DistError naming the extra when not installed)."""
    try:
        import openvino
        import openvino_genai
    except ImportError as e:
        raise DistError(f"--engine openvino needs openvino-genai ({EXTRA_HINT}): {e}") from None
    return {"openvino": openvino.__version__, "openvino-genai": openvino_genai.__version__}


def check_sampler(s: fixtures.SamplerSettings) -> None:
    """Refuse sampler settings OpenVINO's chain does not sample like the closed form."""
    if s.temperature <= 0:
        raise DistError("--engine openvino samples: --temperature must be > 0")
    if s.top_p < 1.0 or s.min_p > 0.0:
        raise DistError(
            "--engine openvino applies temperature before min-p and top-p (llama.cpp after): "
            "use --top-p 1 --min-p 0"
        )


def draft_model_dir(path: str | Path) -> Path:
    """An OpenVINO IR folder to use as a draft model: `path` itself, or, for a GGUF file, the
    IR folder OpenVINO GenAI writes next to it (converted now). Anything else: one line
    saying how to make one."""
    p = Path(path)
    if p.is_dir() and (p / ov_fixtures.IR_MODEL).is_file():
        return p
    if p.is_file() and p.suffix == ".gguf":
        try:
            ov_fixtures.save_draft_ir(p)
        except fixtures.FixtureError as e:
            raise DistError(str(e)) from None
        return p.parent
    raise DistError(
        f"draft {str(p)!r} is not an OpenVINO IR folder (no {ov_fixtures.IR_MODEL}): give the "
        "folder, or a GGUF to convert (LLMPipeline(path, 'CPU', enable_save_ov_model=True) "
        "writes the IR next to it)"
    )


def open_pipeline(target: str | Path, path: str, draft: str | Path | None = None) -> Any:
    """A `ContinuousBatchingPipeline` on `target` for one path (`PATHS`), f32 throughout;
    OpenVINO's own error as one DistError line (a model it cannot read, a path the installed
    build lacks)."""
    versions()
    import openvino_genai as ovg

    if path not in PATHS:
        raise DistError(f"unknown openvino path {path!r} (one of {', '.join(PATHS)})")
    if not Path(target).is_file() and not Path(target).is_dir():
        raise DistError(f"OpenVINO model {str(target)!r} does not exist")
    props: dict[str, Any] = dict(PROPERTIES)
    if path == "draft":
        if draft is None:
            raise DistError("the openvino draft path needs a draft model")
        if not hasattr(ovg, "draft_model"):
            raise DistError(
                f"this openvino-genai build ({ovg.__version__}) has no draft_model: "
                "the draft path is not available"
            )
        ir = draft_model_dir(draft)
        try:
            props["draft_model"] = ovg.draft_model(str(ir), "CPU", **PROPERTIES)
        except Exception as e:  # OpenVINO raises RuntimeError with multi-line text
            raise DistError(f"OpenVINO could not read draft {str(ir)!r}: {one_line(e)}") from None
    elif path == "prompt-lookup":
        props["prompt_lookup"] = True
    sc = ovg.SchedulerConfig()
    sc.cache_size = 1  # GB of KV cache: the fixture needs kilobytes
    try:
        return ovg.ContinuousBatchingPipeline(str(target), sc, "CPU", props)
    except Exception as e:
        what = {"plain": "", "draft": " with a draft", "prompt-lookup": " with prompt lookup"}
        raise DistError(
            f"OpenVINO could not load {str(target)!r}{what[path]}: {one_line(e)}"
        ) from None


def generation_config(
    workload: Workload, path: str, seed: int, *, logprobs: int = 0, tokens: int | None = None
) -> Any:
    """The `GenerationConfig` of one request: the workload's sampler, ``rng_seed`` = `seed`,
    no penalties (what the closed form assumes). EOS stops a request as it would a user's: a
    short sample is an outcome the closed form gives probability 0."""
    import openvino_genai as ovg

    s = workload.sampler
    check_sampler(s)
    c = ovg.GenerationConfig()
    c.max_new_tokens = tokens if tokens is not None else workload.tokens
    c.min_new_tokens = 0
    c.do_sample = True
    c.temperature = s.temperature
    c.top_k = s.top_k if s.top_k > 0 else 0
    c.top_p = 1.0
    c.min_p = 0.0
    c.repetition_penalty = 1.0
    c.presence_penalty = 0.0
    c.frequency_penalty = 0.0
    c.num_return_sequences = 1
    c.rng_seed = seed
    c.logprobs = logprobs
    if path in ("draft", "prompt-lookup"):
        c.num_assistant_tokens = ASSISTANT_TOKENS
    if path == "prompt-lookup":
        c.max_ngram_size = MAX_NGRAM
    return c


def _ids_tensor(ids: Sequence[int]) -> Any:
    import openvino

    return openvino.Tensor(np.array([list(ids)], dtype=np.int64))


@dataclass(frozen=True)
class Output:
    """One request's output: generated ids and OpenVINO's per-token log-probabilities."""

    ids: list[int]
    logprobs: list[float]


def run_requests(pipe: Any, prompt_ids: Sequence[int], configs: Sequence[Any]) -> list[Output]:
    """Add every request at once (one batch), step until all finished, read each in full
    (`GenerationHandle.read_all`)."""
    handles = [pipe.add_request(i, _ids_tensor(prompt_ids), c) for i, c in enumerate(configs)]
    while pipe.has_non_finished_requests():
        pipe.step()
    out = []
    for h in handles:
        o = h.read_all()[0]
        out.append(Output([int(t) for t in o.generated_ids], list(o.generated_log_probs)))
    return out


class Pipelines(Runtime):
    """The converted fixture and one pipeline per path, each loaded on first use: the openvino
    engine's runtime (`dist.inprocess`), one `OpenVINOEngine` per path. `target`: another model
    file to load instead of the converted target (the fixture still gives the prompt and the
    truth). `logprobs`: the `GenerationConfig.logprobs` of the engines' requests."""

    name = "openvino"
    variant_name = "path"
    variants = PATHS
    not_runnable = NOT_RUNNABLE

    def __init__(
        self,
        fs: fixtures.FixtureSet,
        out_dir: str | Path | None = None,
        *,
        target: str | Path | None = None,
        logprobs: int = 0,
    ) -> None:
        versions()
        try:
            self.converted = ov_fixtures.convert(fs, out_dir)
        except fixtures.FixtureError as e:
            raise DistError(str(e)) from None
        self.spec = self.converted.spec
        self.target = Path(target) if target is not None else self.converted.target
        self.logprobs = logprobs
        self._pipes: dict[str, Any] = {}

    @staticmethod
    def family() -> str:
        return f"openvino-genai {versions()['openvino-genai'].split('-')[0]}"

    def get(self, path: str) -> Any:
        if path not in self._pipes:
            self._pipes[path] = open_pipeline(self.target, path, self.converted.draft)
        return self._pipes[path]

    def measure_truth(self, workload: Workload, seeds: int = 16) -> TruthCheck:
        """Sample `seeds` requests on the plain path twice (logprobs 1 and 0) and compare
        every reported value with the closed form."""
        check_sampler(workload.sampler)
        spec, pipe = self.spec, self.get("plain")
        ids = spec.tokenize(workload.prompt)
        errs = {}
        n = 0
        for lp, kind in ((1, "raw"), (0, "processed")):
            cfgs = [
                generation_config(workload, "plain", s, logprobs=lp) for s in range(1, seeds + 1)
            ]
            worst = 0.0
            for o in run_requests(pipe, ids, cfgs):
                for want, got in zip(
                    _truths(spec, workload, o.ids, kind), o.logprobs, strict=False
                ):
                    worst = max(worst, abs(math.exp(got) - want))
                    n += 1
            errs[kind] = worst
        return TruthCheck(
            "OpenVINO", "probabilities (plain, f32)", "the closed form of the F16 weights",
            n // 2, "tokens", errs["raw"], errs["processed"], "processed", TRUTH_TOLERANCE,
        )  # fmt: skip

    def engine(self, variant: str, workload: Workload) -> OpenVINOEngine:
        return OpenVINOEngine(self, workload, variant, self.logprobs)

    def findings(self, engine: InProcessEngine, workload: Workload) -> list[str]:
        """A path's logprob fidelity and reproducibility (`path_findings`), and what its
        counters said."""
        assert isinstance(engine, OpenVINOEngine)
        out = [path_findings(self, workload, engine.path)[2]]
        if engine.inconsistent:
            out.append(
                f"{engine.label}: OpenVINO's counters said accepted > drafted on "
                f"{engine.inconsistent} requests (its SDPerModelsPerfMetrics, reported as given)"
            )
        if engine.path == "prompt-lookup":
            out.append(
                f"{engine.label}: OpenVINO reports no drafted/accepted counts; its per-step "
                f"token counts (PerfMetrics) show {engine.extra_tokens} tokens beyond one per "
                f"step on {engine.multi_token_requests} requests (accepted lookups)"
            )
        return out

    def close(self) -> None:
        self._pipes.clear()  # each pipeline holds its compiled model and KV cache


def _truths(
    spec: fixtures.FixtureSpec, workload: Workload, ids: list[int], kind: str
) -> list[float]:
    """The closed-form probability of each generated token given its prefix: raw (softmax of
    the logits, the whole vocabulary) or processed (the sampler's distribution)."""
    out = []
    prefix = ""
    for t in ids:
        if not 0 <= t < spec.n_vocab:
            break  # after a special token the fixture defines no prefix
        tok = spec.tokens[t]
        if kind == "raw":
            p = fixtures.raw_distribution(spec, workload.prompt + prefix)[tok]
        else:
            p = fixtures.conditional_distribution(spec, workload.prompt, prefix, workload.sampler)[
                tok
            ]
        out.append(p)
        if tok in fixtures.SPECIAL_TOKENS:
            break  # scored (the closed form gives it its probability), nothing after it is
        prefix += tok
    return out


class OpenVINOEngine(InProcessEngine):
    """One path of OpenVINO GenAI, one request per seed (``rng_seed`` = seed) through
    `ContinuousBatchingPipeline.generate`, which also returns the request's speculative
    decoding metrics."""

    def __init__(self, pipes: Pipelines, workload: Workload, path: str, logprobs: int = 0) -> None:
        super().__init__(pipes, workload, path, ", logprobs=1" if logprobs else "")
        self.pipes = pipes
        self.path = path
        self.logprobs = logprobs
        self.pipe = pipes.get(path)
        self._ids = pipes.spec.tokenize(workload.prompt)
        self.inconsistent = 0  # requests whose counters say accepted > drafted
        # steps that produced more than one token (an accepted draft), and the extra tokens:
        # prompt lookup's only trace, from the per-step counts of its PerfMetrics
        self.multi_token_requests = 0
        self.extra_tokens = 0

    def draw(self, seed: int) -> tuple[list[int], int | None, int | None]:
        """Generated ids and (drafted, accepted) as OpenVINO reports them (None: not reported)."""
        cfg = generation_config(self.workload, self.path, seed, logprobs=self.logprobs)
        r = self.pipe.generate([_ids_tensor(self._ids)], [cfg])[0]
        ids = [int(t) for t in r.m_generation_ids[0]]
        steps = [int(b) for b in r.perf_metrics.raw_metrics.m_batch_sizes]
        if any(b > 1 for b in steps):
            self.multi_token_requests += 1
            self.extra_tokens += sum(b - 1 for b in steps if b > 1)
        em = r.extended_perf_metrics
        if self.path != "draft" or em is None:
            return ids, None, None
        drafted, accepted = int(em.get_num_draft_tokens()), int(em.get_num_accepted_tokens())
        if accepted > drafted:
            self.inconsistent += 1
        return ids, drafted, accepted


# --------------------------------------------------------------------------- fidelity

CLASSES = ("real-correct", "real-wrong", "placeholder", "missing")


@dataclass
class Fidelity:
    """Every `generated_log_probs` value of one path against the closed form for its prefix.

    `mode`: what the values are compared with, "raw" (``logprobs=1``: OpenVINO then reports
    log-softmax of the raw logits) or "processed" (``logprobs=0``: the sampler's distribution).
    A value within `FIDELITY_TOLERANCE` is real and correct; 0.0 where the truth is below 1 a
    placeholder; no value at all (fewer values than tokens, NaN) missing; anything else real
    but wrong (`wrong` keeps a few: seed, position, token, reported, expected).
    """

    path: str
    mode: str
    requests: int
    counts: dict[str, int]
    max_error_correct: float  # the largest |error| among the real-and-correct values
    wrong: list[tuple[int, int, str, float, float]] = field(default_factory=list)
    unscored: int = 0  # tokens after a special token (EOS...): the fixture defines no prefix

    @property
    def tokens(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        c = self.counts
        return (
            f"{c['real-correct']}/{self.tokens} real and correct, {c['real-wrong']} real but "
            f"wrong, {c['placeholder']} placeholder, {c['missing']} missing ({self.mode})"
        )


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


def classify(reported: float | None, expected: float) -> str:
    """One token's class (`CLASSES`): `reported` a log-probability (None: none given),
    `expected` the closed-form probability."""
    if reported is None or math.isnan(reported):
        return "missing"
    if reported == 0.0 and expected < 1.0:
        return "placeholder"
    if expected > 0 and abs(reported - math.log(expected)) <= FIDELITY_TOLERANCE:
        return "real-correct"
    return "real-wrong"


def score_outputs(
    spec: fixtures.FixtureSpec,
    workload: Workload,
    outputs: Sequence[Output],
    seeds: Sequence[int],
    path: str,
    mode: str,
) -> Fidelity:
    """Classify every generated token of `outputs` (one per seed) against the closed form."""
    counts = dict.fromkeys(CLASSES, 0)
    worst = 0.0
    wrong: list[tuple[int, int, str, float, float]] = []
    for seed, o in zip(seeds, outputs, strict=True):
        want = _truths(spec, workload, o.ids, mode)
        for i, p in enumerate(want):
            got = o.logprobs[i] if i < len(o.logprobs) else None
            c = classify(got, p)
            counts[c] += 1
            if c == "real-correct" and got is not None:
                worst = max(worst, abs(got - math.log(p)))
            elif c == "real-wrong" and got is not None and len(wrong) < 20:
                wrong.append((seed, i + 1, spec.tokens[o.ids[i]], got, _log(p)))
    unscored = sum(len(o.ids) for o in outputs) - sum(counts.values())
    return Fidelity(path, mode, len(outputs), counts, worst, wrong, unscored)


def fidelity(
    pipes: Pipelines, workload: Workload, path: str, seeds: Sequence[int], *, logprobs: int = 1
) -> Fidelity:
    """Sample `seeds` on `path` (one batch, `run_requests`) and classify every reported
    log-probability: raw values with ``logprobs=1``, processed with ``logprobs=0``."""
    ids = pipes.spec.tokenize(workload.prompt)
    cfgs = [generation_config(workload, path, s, logprobs=logprobs) for s in seeds]
    outputs = run_requests(pipes.get(path), ids, cfgs)
    mode = "raw" if logprobs else "processed"
    return score_outputs(pipes.spec, workload, outputs, seeds, path, mode)


# ---------------------------------------------------------------------- reproducibility


@dataclass
class Reproducibility:
    """Does a seed give the same sample again? `twice`: seeds whose two requests (one after
    the other, alone) differed; `batch`: seeds whose request alone differed from the same
    request among `batch_size` others; `batch_twice`: seeds whose sample differed between two
    identical batches. A path with any of them non-empty is not reproducible."""

    path: str
    seeds: int
    batch_size: int
    twice: list[int]
    batch: list[int]
    batch_twice: list[int]

    @property
    def reproducible(self) -> bool:
        return not self.twice and not self.batch and not self.batch_twice

    def summary(self) -> str:
        n = self.seeds
        return (
            f"alone twice: {n - len(self.twice)}/{n} equal; alone vs in a batch of "
            f"{self.batch_size}: {n - len(self.batch)}/{n} equal; the same batch twice: "
            f"{n - len(self.batch_twice)}/{n} equal"
        )


def reproducibility(
    pipes: Pipelines, workload: Workload, path: str, seeds: Sequence[int]
) -> Reproducibility:
    """Each seed alone twice, then all seeds in one batch twice (`run_requests`)."""
    pipe = pipes.get(path)
    ids = pipes.spec.tokenize(workload.prompt)

    def alone(seed: int) -> list[int]:
        return run_requests(pipe, ids, [generation_config(workload, path, seed)])[0].ids

    def batch() -> list[list[int]]:
        cfgs = [generation_config(workload, path, s) for s in seeds]
        return [o.ids for o in run_requests(pipe, ids, cfgs)]

    first = [alone(s) for s in seeds]
    second = [alone(s) for s in seeds]
    b1, b2 = batch(), batch()

    def differ(a: list[list[int]], b: list[list[int]]) -> list[int]:
        return [s for s, x, y in zip(seeds, a, b, strict=True) if x != y]

    return Reproducibility(
        path, len(seeds), len(seeds), differ(first, second), differ(first, b1), differ(b1, b2)
    )


# ------------------------------------------------------------------------ registration


def check(req: DistRequest) -> None:
    """Called once by `make_request`: settings the closed form covers, the extra installed."""
    check_sampler(req.workload.sampler)
    versions()


FINDING_SEEDS = 50  # seeds of the fidelity and reproducibility checks `dist` adds per path


def path_findings(
    pipes: Pipelines, workload: Workload, path: str, seeds: int = FINDING_SEEDS
) -> tuple[Fidelity, Reproducibility, str]:
    """One path's logprob fidelity (raw values, ``logprobs=1``) and reproducibility on seeds
    1..`seeds`, and the line that reports both."""
    fid = fidelity(pipes, workload, path, range(1, seeds + 1), logprobs=1)
    rep = reproducibility(pipes, workload, path, range(1, seeds + 1))
    flag = "" if rep.reproducible else " (NOT reproducible)"
    line = f"OpenVINO {path}, seeds 1..{seeds}: logprobs {fid.summary()}; {rep.summary()}{flag}"
    return fid, rep, line


def build(req: DistRequest, ctx: RunContext) -> Generator[Unit, None, None]:
    paths = Pipelines.check_variants(req.option("ov_paths") or PATHS)
    logprobs = int((req.option("ov_logprobs") or ("0",))[-1])
    yield from Pipelines(req.fixture, logprobs=logprobs).units(req.workload, paths, ctx)


OPENVINO = EngineEntry(
    "openvino",
    build,
    help="OpenVINO GenAI's ContinuousBatchingPipeline on CPU, on the fixture converted to "
    "F16 (--ov-path; needs specaudit[openvino])",
    extra="openvino",
    options=(
        EngineOption(
            "--ov-path",
            "ov_paths",
            PATHS,
            "Path(s) of --engine openvino, repeatable [default: all]: "
            + "; ".join(f"{p}: {h}" for p, h in PATH_HELP.items())
            + ".",
        ),
        EngineOption(
            "--ov-logprobs",
            "ov_logprobs",
            ("0", "1"),
            "GenerationConfig.logprobs of --engine openvino's requests [default: 0]; 1 "
            "makes OpenVINO keep raw log-probabilities, which its speculative sampling "
            "then uses.",
        ),
    ),
    check=check,
    audit=True,
    row=Pipelines.row,
)


def register_engines(register: Register) -> None:
    """The registry's hook (`dist.registry.BUILTIN`)."""
    register(OPENVINO)


__all__ = [
    "ASSISTANT_TOKENS",
    "CLASSES",
    "FIDELITY_TOLERANCE",
    "MAX_NGRAM",
    "NOT_RUNNABLE",
    "OPENVINO",
    "PATHS",
    "FINDING_SEEDS",
    "PATH_HELP",
    "PROPERTIES",
    "Fidelity",
    "OpenVINOEngine",
    "Output",
    "Pipelines",
    "Reproducibility",
    "check",
    "check_sampler",
    "classify",
    "draft_model_dir",
    "fidelity",
    "generation_config",
    "open_pipeline",
    "path_findings",
    "register_engines",
    "reproducibility",
    "run_requests",
    "score_outputs",
    "versions",
]
