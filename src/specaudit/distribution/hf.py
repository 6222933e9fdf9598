"""The Hugging Face transformers engine: `generate()` with speculative decoding on CPU.

The fixture is loaded the way transformers users load a GGUF (`from_pretrained(dir,
gguf_file=...)`, with `gguf` and `accelerate` installed); before anything is sampled, the
model's own next-token probabilities are compared with the closed form (`Models.check_truth`,
the life cycle of `dist.inprocess`) and a difference above `TRUTH_TOLERANCE` is an error, not
a verdict.

The sampler knobs are mapped exactly. transformers applies temperature *before* top-k, top-p
and min-p; llama.cpp's chain (which the closed form models) applies it last. The two agree
when temperature is 1 or when top-p and min-p are off (top-k commutes with a positive
temperature), and then the knobs are passed as generation arguments, as a user would;
otherwise the same four transformers warpers are passed as `logits_processor` in llama.cpp's
order and the generation knobs are set neutral. No other logits processor runs.

Generators (`GENERATORS`): the assistant (draft) model, prompt lookup, early exit and DFlash,
all verified by the one-layer fixture llama. DFlash's drafter is a DFlash assistant class
(`MuseGlimmerAssistantModel`, the one transformers 5.23 ships) built tiny and randomly
initialised from a fixed seed (`dflash_assistant`): it reads the target's hidden states and
drafts through the target's own embedding and head, so a random one is a legitimate (poor)
drafter and speculative sampling must still give the target's distribution. transformers'
universal (different-tokenizer) assistant, MTP and Gemma 4 assistant generators cannot run
on a llama (`NOT_RUNNABLE` says why; `benchmarks/bench_hf_generators.py` measures the last
two on tiny models of their own classes).

Imports of torch and transformers happen on first use: a plain install stays light
(`pip install 'specaudit[transformers]'` brings them).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from specaudit import fixtures
from specaudit.distribution.inprocess import InProcessEngine, Runtime, TruthCheck, one_line
from specaudit.distribution.registry import EngineEntry, EngineOption, Register, RunContext, Unit
from specaudit.distribution.request import DistRequest
from specaudit.distribution.results import DistError, Workload

TRUTH_TOLERANCE = 1e-5  # max |transformers' probability - closed form| before sampling
PROMPT_LOOKUP_TOKENS = 3  # prompt_lookup_num_tokens
ASSISTANT_TOKENS = 3  # the assistant's num_assistant_tokens (constant schedule)
DFLASH_SEED = 20261201  # torch seed of the DFlash drafter's random weights
GENERATORS = ("assistant", "prompt-lookup", "early-exit", "dflash")
GENERATOR_HELP = {
    "assistant": "assistant_model=draft.gguf (AssistedCandidateGenerator: the draft samples, "
    "speculative sampling verifies)",
    "prompt-lookup": f"prompt_lookup_num_tokens={PROMPT_LOOKUP_TOKENS} "
    "(PromptLookupCandidateGenerator: n-grams of the context, no draft model)",
    "early-exit": "assistant_early_exit=1 (EarlyExitCandidateGenerator: the target's first "
    "layer drafts; the fixture has one layer, so the draft is the target)",
    "dflash": f"speculation_type='dflash' with a tiny random DFlash drafter (seed {DFLASH_SEED}; "
    f"DFlashTokenCandidateGenerator: {ASSISTANT_TOKENS} tokens per block from the target's "
    "hidden states, sampled)",
}
NOT_RUNNABLE = (
    (
        "transformers universal assistant",
        "UniversalSpeculativeDecodingGenerator (assistant_tokenizer) refuses an assistant with "
        "the target's vocabulary size, and the fixture's draft shares the target's tokenizer",
    ),
    (
        "transformers mtp",
        "use_mtp (MTPCandidateGenerator) needs a target whose config has num_mtp_layers and "
        "whose checkpoint holds MTP weights (MtpModel.from_pretrained); a llama has neither "
        "(benchmarks/bench_hf_generators.py runs it on a tiny Mellum: PRESERVED, certified "
        "TV <= 0.130 at 2500 seeds, T 1 and T 0.7/top-k 4)",
    ),
    (
        "transformers gemma4-assistant",
        "SinglePositionMultiTokenCandidateGenerator needs a Gemma4Assistant drafter and a "
        "Gemma 4/3n target's shared KV states (benchmarks/bench_hf_generators.py runs it on "
        "tiny Gemma 4 models: BROKEN, G-test p 1e-352 at 2500 seeds: it drafts q's argmax and "
        "verifies as if the draft were sampled from q; docs/upstream/"
        "transformers-gemma4-assistant-q.md)",
    ),
)
EXTRA_HINT = "pip install 'specaudit[transformers]'"


def versions() -> dict[str, str]:
    """torch and transformers versions (DistError naming the extra when not installed)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise DistError(
            f"--engine transformers needs torch and transformers ({EXTRA_HINT}): {e}"
        ) from None
    return {"torch": torch.__version__, "transformers": transformers.__version__}


class Models(Runtime):
    """The fixture's target and draft loaded through transformers' GGUF loader, once: the
    transformers engine's runtime (`dist.inprocess`), one `TransformersEngine` per generator."""

    name = "transformers"
    variant_name = "generator"
    variants = GENERATORS
    not_runnable = NOT_RUNNABLE

    def __init__(self, fs: fixtures.FixtureSet) -> None:
        versions()
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        torch.set_num_threads(1)  # the model is tiny; one core per engine
        self.fs = fs
        self.spec = fs.spec
        d = str(fs.dir)
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # the GGUF loader's own tqdm bar
                self.target, self.draft, self.tokenizer = self._load(d)
        except Exception as e:  # transformers raises many kinds; one line says which
            raise DistError(
                f"transformers could not load fixture {fs.spec.name!r} from {d}: "
                f"{type(e).__name__}: {one_line(e)}"
            ) from None
        self._check_tokenizer()

    @staticmethod
    def family() -> str:
        return f"transformers {versions()['transformers']}"

    @staticmethod
    def _load(d: str) -> tuple[Any, Any, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=fixtures.TARGET_FILE, dtype=torch.float32
        ).eval()
        draft = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=fixtures.DRAFT_FILE, dtype=torch.float32
        ).eval()
        return target, draft, AutoTokenizer.from_pretrained(d, gguf_file=fixtures.TARGET_FILE)

    def dflash_assistant(self) -> Any:
        """The DFlash drafter (built once): a one-layer `MuseGlimmerAssistantModel` of the
        target's hidden size reading the target's last layer, `ASSISTANT_TOKENS + 1` positions
        per block (the last accepted token and `ASSISTANT_TOKENS` masks; the fixture's unknown
        token is the mask), weights random from `DFLASH_SEED` (the global RNG untouched)."""
        if getattr(self, "_dflash", None) is None:
            import torch
            from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

            c = self.target.config
            cfg = MuseGlimmerAssistantConfig(
                hidden_size=c.hidden_size, intermediate_size=2 * c.hidden_size,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                layer_types=["full_attention"], block_size=ASSISTANT_TOKENS + 1,
                mask_token_id=self.spec.unk_id, target_layer_ids=[c.num_hidden_layers - 1],
                bos_token_id=None, eos_token_id=None, pad_token_id=None,
            )  # fmt: skip
            with torch.random.fork_rng():
                torch.manual_seed(DFLASH_SEED)
                self._dflash = MuseGlimmerAssistantModel(cfg).eval()
        return self._dflash

    def _check_tokenizer(self) -> None:
        spec = self.fs.spec
        ids = self.tokenizer(spec.prompt, add_special_tokens=False).input_ids
        if list(ids) != spec.tokenize(spec.prompt):
            raise DistError(
                f"transformers' tokenizer maps {spec.prompt!r} to {list(ids)}, the fixture to "
                f"{spec.tokenize(spec.prompt)}"
            )

    def measure_truth(self, workload: Workload) -> TruthCheck:
        """transformers' probabilities on the prompt and every reachable generated prefix
        (`_contexts`), raw and after `generate()`'s own processors, against the closed form."""
        import torch

        spec = self.spec
        max_raw = max_sampled = 0.0
        ctxs = _contexts(spec, workload)
        for prefix in ctxs:
            ids = spec.tokenize(workload.prompt + prefix)
            with torch.no_grad():
                logits = self.target(torch.tensor([ids])).logits[0, -1].double()
            raw = np.asarray(torch.softmax(logits, dim=-1).numpy())
            want = np.array(
                list(fixtures.raw_distribution(spec, workload.prompt + prefix).values())
            )
            got = processed_distribution(self, workload, ids, logits.float())
            cond = fixtures.conditional_distribution(
                spec, workload.prompt, prefix, workload.sampler
            )
            want_s = np.array(list(cond.values()))
            max_raw = max(max_raw, float(np.abs(raw[: len(want)] - want).max()))
            max_sampled = max(max_sampled, float(np.abs(got[: len(want_s)] - want_s).max()))
        return TruthCheck(
            "transformers", "next-token probabilities", "the closed form", len(ctxs),
            "contexts", max_raw, max_sampled, "after the sampler", TRUTH_TOLERANCE,
        )  # fmt: skip

    def engine(self, variant: str, workload: Workload) -> TransformersEngine:
        return TransformersEngine(self, workload, variant)


def _native(s: fixtures.SamplerSettings) -> bool:
    """True when transformers' own order (temperature first) gives llama.cpp's distribution."""
    return s.temperature == 1.0 or (s.top_p >= 1.0 and s.min_p <= 0.0)


def generation_kwargs(workload: Workload) -> dict[str, Any]:
    """The sampler part of `generate()`'s arguments for `workload` (see the module doc)."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    s = workload.sampler
    if s.temperature <= 0:
        raise DistError("--engine transformers samples: --temperature must be > 0")
    kw: dict[str, Any] = {
        "do_sample": True,
        "repetition_penalty": None,
        "typical_p": None,
        "epsilon_cutoff": None,
        "eta_cutoff": None,
        "top_h": None,
        "renormalize_logits": False,
    }
    if _native(s):
        kw |= {
            "temperature": s.temperature,
            "top_k": s.top_k,  # 0: off (transformers' default would be 50)
            "top_p": s.top_p,
            "min_p": s.min_p if s.min_p > 0 else None,
        }
        return kw
    procs: list[Any] = []
    if s.top_k > 0:
        procs.append(TopKLogitsWarper(top_k=s.top_k))
    if s.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=s.top_p))
    if s.min_p > 0:
        procs.append(MinPLogitsWarper(min_p=s.min_p))
    procs.append(TemperatureLogitsWarper(s.temperature))
    kw |= {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None}
    kw["logits_processor"] = LogitsProcessorList(procs)
    return kw


def processed_distribution(
    models: Models, workload: Workload, ids: list[int], logits: Any
) -> np.ndarray:
    """What `generate()` samples from after `ids`: its own processors on `logits`, softmaxed."""
    import torch

    kw = generation_kwargs(workload)
    if "logits_processor" in kw:
        procs = kw["logits_processor"]
    else:
        from transformers import GenerationConfig

        cfg = GenerationConfig(**{k: v for k, v in kw.items() if k != "logits_processor"})
        procs = models.target._get_logits_processor(
            cfg, input_ids_seq_length=len(ids), logits_processor=None, device="cpu"
        )
    x = torch.tensor([ids])
    z = procs(x, logits.unsqueeze(0).clone())
    return np.asarray(torch.softmax(z.double(), dim=-1)[0].numpy())


def _contexts(spec: fixtures.FixtureSpec, workload: Workload) -> list[str]:
    """The prompt and the generated prefixes of positive probability, up to `positions - 1`
    letters (at most a few hundred on the built-in fixtures)."""
    out = [""]
    frontier = [""]
    for _ in range(workload.positions - 1):
        nxt = []
        for prefix in frontier:
            d = fixtures.conditional_distribution(spec, workload.prompt, prefix, workload.sampler)
            nxt += [prefix + ch for ch in spec.letters if d[ch] > 0]
        frontier = nxt[:200]
        out += frontier
    return out


class TransformersEngine(InProcessEngine):
    """`generate()` with one candidate generator (`GENERATORS`), one sample per seed
    (`torch.manual_seed(seed)` first), counting drafted and accepted tokens from the
    candidate generator's own calls."""

    def __init__(self, models: Models, workload: Workload, generator: str) -> None:
        super().__init__(models, workload, generator)
        self.models = models
        self.generator = generator
        self.drafted = 0
        self.accepted = 0
        self._ids = models.fs.spec.tokenize(workload.prompt)
        self._kw = generation_kwargs(workload) | self._generator_kwargs()
        self._count_candidates(models.target)

    def _generator_kwargs(self) -> dict[str, Any]:
        m = self.models
        g = self.generator
        if g == "assistant":
            m.draft.generation_config.num_assistant_tokens = ASSISTANT_TOKENS
            m.draft.generation_config.num_assistant_tokens_schedule = "constant"
            m.draft.generation_config.assistant_confidence_threshold = 0.0
            return {"assistant_model": m.draft}
        if g == "prompt-lookup":
            return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
        if g == "dflash":
            return {"assistant_model": m.dflash_assistant(), "speculation_type": "dflash"}
        return {"assistant_early_exit": 1, "num_assistant_tokens": ASSISTANT_TOKENS}

    @staticmethod
    def _count_candidates(model: Any) -> None:
        """Count drafted and accepted tokens into the engine now generating
        (`model._specaudit_engine`)."""

        def drafted(input_ids: Any, ids: Any, logits: Any) -> None:
            model._specaudit_engine.drafted += int(ids.shape[1] - input_ids.shape[1])

        def verified(scores: Any, num_matches: int) -> None:
            model._specaudit_engine.accepted += num_matches

        watch_candidates(model, drafted, verified)

    def generate(self, seed: int) -> list[int]:
        """The generated token ids for one seed."""
        import torch

        torch.manual_seed(seed)
        self.models.target._specaudit_engine = self
        x = torch.tensor([self._ids])
        spec = self.models.fs.spec
        with torch.no_grad():
            out = self.models.target.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=self.workload.tokens,
                min_new_tokens=0,
                pad_token_id=spec.eos_id,
                **self._kw,
            )
        return [int(t) for t in out[0, len(self._ids) :]]

    def draw(self, seed: int) -> tuple[list[int], int | None, int | None]:
        d0, a0 = self.drafted, self.accepted
        ids = self.generate(seed)
        return ids, self.drafted - d0, self.accepted - a0


# ------------------------------------------------------------------------ registration


def _check(req: DistRequest) -> None:
    if req.workload.sampler.temperature <= 0:
        raise DistError("--engine transformers samples: --temperature must be > 0")
    versions()  # the extra is installed, or a one-line error now


def _build(req: DistRequest, ctx: RunContext) -> Generator[Unit, None, None]:
    generators = Models.check_variants(req.option("generators") or GENERATORS)
    yield from Models(req.fixture).units(req.workload, generators, ctx)


TRANSFORMERS = EngineEntry(
    "transformers",
    _build,
    help="Hugging Face generate() with speculative decoding on CPU (--generator; needs "
    "specaudit[transformers])",
    extra="transformers",
    options=(
        EngineOption(
            "--generator",
            "generators",
            GENERATORS,
            "Candidate generator(s) of --engine transformers, repeatable [default: all]: "
            + "; ".join(f"{g}: {h}" for g, h in GENERATOR_HELP.items())
            + ".",
        ),
    ),
    check=_check,
    audit=True,
    row=Models.row,
)


def register_engines(register: Register) -> None:
    """The registry's hook (`dist.registry.BUILTIN`)."""
    register(TRANSFORMERS)


def watch_candidates(
    model: Any,
    on_draft: Callable[[Any, Any, Any], None],
    on_verify: Callable[[Any, int], None],
) -> None:
    """Wrap `model`'s candidate generators, once, so that every draft (the input ids, the
    candidate ids, the candidate logits or None) reaches `on_draft` and every verification (the
    target's scores, the number of matches) reaches `on_verify`. On the instance: the class,
    which `generate()` checks, is unchanged. The engine counts with it; benchmarks also read
    the q a generator returned."""
    if getattr(model, "_specaudit_watched", False):
        return
    orig = type(model)._get_candidate_generator

    def make(*args: Any, **kwargs: Any) -> Any:
        cg = orig(model, *args, **kwargs)
        get, update = cg.get_candidates, cg.update_candidate_strategy

        def get_candidates(input_ids: Any, **kw: Any) -> Any:
            out = get(input_ids, **kw)
            on_draft(input_ids, out[0], out[1])
            return out

        def update_candidate_strategy(input_ids: Any, scores: Any, num_matches: int) -> Any:
            on_verify(scores, int(num_matches))
            return update(input_ids, scores, num_matches)

        cg.get_candidates = get_candidates
        cg.update_candidate_strategy = update_candidate_strategy
        return cg

    model._get_candidate_generator = make
    model._specaudit_watched = True


__all__ = [
    "DFLASH_SEED",
    "GENERATORS",
    "GENERATOR_HELP",
    "NOT_RUNNABLE",
    "TRANSFORMERS",
    "TRUTH_TOLERANCE",
    "Models",
    "TransformersEngine",
    "generation_kwargs",
    "register_engines",
    "versions",
    "watch_candidates",
]
