"""A re-scored run's request, checked before anything starts: the engine, the reference and
the draft (a server or a file, never both), prompts, seeds and the sampler settings.

Why apart from `runner`: `rescore --url`, `--dist-engine` and the audit build requests from
different inputs; one set of checks gives each the same one-line RescoreError (exit 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specaudit import validate
from specaudit.fixtures import REPORT_SAMPLER, SamplerSettings
from specaudit.llama.presets import DRAFT_TOP_K
from specaudit.reference import NextTokenSource
from specaudit.rescore import analysis
from specaudit.rescore.analysis import DEFAULT_ALPHA
from specaudit.rescore.certify import DEFAULT_TOLERANCE
from specaudit.rescore.records import RescoreError

ENGINES = ("server", "vllm", "openai")
DEFAULT_PROMPTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):")
MAX_TOKENS = 512
MAX_SEEDS = 10_000_000
MAX_CONCURRENCY = 256
# the arm at another temperature a run adds when its own is 1 (`default_arm`): at T = 1 the
# temperature is the identity, so a sampler that applies it wrongly (or not at all, or at the
# wrong place in its chain) is invisible; 0.7 is a common production setting
ARM_TEMPERATURE = 0.7
MAX_TEMPERATURE = 10.0


@dataclass(frozen=True)
class RescoreRequest:
    """A re-scored run, checked (`make_request`). Exactly one of `reference_url`,
    `reference_model` and `reference_vllm` is set: a running plain server (a llama-server, or
    vLLM when `reference_engine` is "vllm"), a GGUF specaudit serves as a plain llama-server,
    or a Hugging Face folder specaudit serves as a plain vLLM server."""

    url: str
    engine: str = "server"
    reference_url: str | None = None
    reference_model: Path | None = None
    reference_vllm: Path | None = None
    reference_engine: str = "server"  # what the reference speaks: "server" or "vllm"
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    prompt_ids: tuple[tuple[int, ...], ...] = ()  # given as ids: no tokenizer involved
    seeds: int = 200
    seed_start: int = 1
    tokens: int = 8
    sampler: SamplerSettings = REPORT_SAMPLER
    alpha: float = DEFAULT_ALPHA
    sequential: bool = False
    concurrency: int = 4
    timeout: float = 60.0
    label: str | None = None
    model: str = "model"  # the OpenAI model name (--engine openai)
    # the draft's processed distribution q at every prefix: a plain llama-server serving the
    # draft model (`draft_url`, or `draft_model` that specaudit serves itself), or a source
    # that needs no server (a fixture's closed form). q aims the tests at the bugs
    # speculation makes; it never enters their validity, which rests on the reference alone
    draft_url: str | None = None
    draft_model: Path | None = None
    draft: NextTokenSource | None = None
    # the draft server is asked at the draft's own chain (`presets.draft_chain`: llama.cpp's
    # probabilistic draft samples at top-k 10 and the target's temperature), the q that
    # rejection sampling weighs against p
    draft_top_k: int = DRAFT_TOP_K
    tolerance: float = DEFAULT_TOLERANCE
    # the reference sampled at the same seeds through the same test (`rescore.control`);
    # `coupling`: its same-seed divergence is a test of the family (sample-and-match engines)
    control: bool = False
    coupling: bool = False
    # no reference: each token against the engine's own reported post-sampling distribution
    self_check: bool = False
    # the same run again at this temperature, decided as a second family (each at alpha / 2)
    arm_temperature: float | None = None

    @property
    def n_prompts(self) -> int:
        return len(self.prompt_ids) or len(self.prompts)

    @property
    def vllm_model(self) -> str | None:
        """The model name a vLLM request carries: none unless one was given (vLLM then uses
        the one it serves)."""
        return None if self.model == "model" else self.model


def make_request(
    url: str,
    *,
    engine: str = "server",
    reference_url: str | None = None,
    reference_model: Path | str | None = None,
    reference_vllm: Path | str | None = None,
    reference_engine: str = "server",
    prompts: Sequence[str] = (),
    prompt_ids: Sequence[Sequence[int]] = (),
    seeds: int = 200,
    seed_start: int = 1,
    tokens: int = 8,
    sampler: SamplerSettings = REPORT_SAMPLER,
    alpha: float = DEFAULT_ALPHA,
    sequential: bool = False,
    concurrency: int = 4,
    timeout: float = 60.0,
    label: str | None = None,
    model: str = "model",
    draft_url: str | None = None,
    draft_model: Path | str | None = None,
    draft: NextTokenSource | None = None,
    draft_top_k: int = DRAFT_TOP_K,
    tolerance: float | None = None,
    control: bool = False,
    coupling: bool = False,
    self_check: bool = False,
    arm_temperature: float | None = None,
) -> RescoreRequest:
    """Check every input before anything is started (one-line RescoreError, exit 2)."""
    url = validate.url(url, "--url", RescoreError)
    if engine not in ENGINES:
        raise RescoreError(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")
    if self_check and (
        reference_url is not None or reference_model is not None or engine != "server"
    ):
        raise RescoreError("--self takes no reference and needs --engine server")
    ref_vllm, reference_engine = check_vllm_reference(
        reference_vllm, reference_engine, engine=engine, model=reference_model,
        url=reference_url,
    )  # fmt: skip
    reference_url, ref_model = check_reference(
        reference_url, reference_model, required=not self_check and ref_vllm is None
    )
    draft_url, draft_path = check_draft(
        draft_url, draft_model, closed=draft, self_check=self_check, top_k=draft_top_k
    )
    if self_check and (control or coupling):
        raise RescoreError("--self has no reference to sample as a control")
    if coupling and engine != "server":
        raise RescoreError(
            "--coupling compares a llama-server's sample with the reference's at the same seed "
            "(the same random stream): --engine server only"
        )
    tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
    if not 0 < tolerance < 1:
        raise RescoreError("--tolerance must be between 0 and 1")
    check_arm(arm_temperature, sampler, self_check=self_check)
    if prompt_ids and engine == "openai":
        raise RescoreError("prompts as token ids need --engine server or vllm")
    if engine == "vllm":
        check_vllm_order(sampler, arm_temperature)
    ids = tuple(tuple(int(t) for t in p) for p in prompt_ids)
    texts = tuple(prompts) or (() if ids else DEFAULT_PROMPTS)
    if any(not p for p in texts) or any(not p for p in ids):
        raise RescoreError("every prompt must be non-empty")
    if not 1 <= tokens <= MAX_TOKENS:
        raise RescoreError(f"--tokens must be between 1 and {MAX_TOKENS}")
    check_run(
        seeds=seeds, seed_start=seed_start, tokens=tokens, prompts=len(ids) or len(texts),
        alpha=alpha / 2 if arm_temperature is not None else alpha, concurrency=concurrency,
        sampler=sampler,
    )  # fmt: skip
    return RescoreRequest(
        url=url, engine=engine, reference_url=reference_url, reference_model=ref_model,
        reference_vllm=ref_vllm, reference_engine=reference_engine,
        prompts=texts if not ids else (), prompt_ids=ids, seeds=seeds, seed_start=seed_start,
        tokens=tokens, sampler=sampler, alpha=alpha, sequential=sequential,
        concurrency=concurrency, timeout=timeout, label=label, model=model, draft_url=draft_url,
        draft_model=draft_path, draft=draft, draft_top_k=draft_top_k, tolerance=tolerance,
        control=control, coupling=coupling, self_check=self_check, arm_temperature=arm_temperature,
    )  # fmt: skip


def default_arm(sampler: SamplerSettings) -> float | None:
    """The arm a run adds by default: `ARM_TEMPERATURE` when its own temperature is 1 (where
    temperature bugs are invisible), none when the production setting already is not 1."""
    return ARM_TEMPERATURE if sampler.temperature == 1.0 else None


def check_arm(arm: float | None, sampler: SamplerSettings, *, self_check: bool = False) -> None:
    """The temperature arm, checked (one-line RescoreError)."""
    if arm is None:
        return
    if self_check:
        raise RescoreError("--self takes no temperature arm (--arm-temperature off)")
    if not 0 < arm <= MAX_TEMPERATURE:
        raise RescoreError(f"--arm-temperature must be above 0 and at most {MAX_TEMPERATURE:g}")
    if arm == sampler.temperature:
        raise RescoreError(
            f"--arm-temperature {arm:g} is the run's own temperature: an arm must differ"
        )


def check_vllm_order(sampler: SamplerSettings, arm: float | None) -> None:
    """Refuse (one line) the settings, of the run or its temperature arm, where vLLM's sampler
    order (temperature before top-k/top-p and min-p) samples another distribution than the
    reference's llama.cpp chain (temperature last)."""
    from specaudit.distribution.vllm import ORDER, differs

    for s, what in ((sampler, ""), (dataclasses.replace(sampler, temperature=arm or 1.0), "arm ")):
        if what and arm is None:
            continue
        why = differs(s)
        if why is not None:
            fix = " (or --arm-temperature off)" if what else ""
            raise RescoreError(
                f"--engine vllm applies {ORDER} (llama.cpp: temperature last); the {what}"
                f"setting differs: {why}{fix}"
            )


def check_reference(
    reference_url: str | None, reference_model: Path | str | None, *, required: bool
) -> tuple[str | None, Path | None]:
    """The reference of a re-scored run, checked (one-line RescoreError): a parseable
    `reference_url` or an existing `reference_model` file, never both. `required`: exactly
    one (`rescore --url`); otherwise at most one (`--dist-engine` serves the fixture's GGUF
    itself when neither is given, `--self` has none)."""
    if required and (reference_url is None) == (reference_model is None):
        raise RescoreError("give exactly one of --reference-url and --reference-model (or --self)")
    return _server_or_file(reference_url, reference_model, "reference")


REFERENCE_ENGINES = ("server", "vllm")


def check_vllm_reference(
    reference_vllm: Path | str | None,
    reference_engine: str,
    *,
    engine: str,
    model: Path | str | None,
    url: str | None,
) -> tuple[Path | None, str]:
    """A vLLM reference, checked (one-line RescoreError): `reference_vllm` a Hugging Face
    folder (and then no other reference), or `reference_engine` "vllm" with a
    `url`; either only for ``--engine vllm``. Returns the folder and the reference's engine.

    Why only vLLM against vLLM: vLLM's ``ignore_eos`` keeps sampling past an end token but
    leaves it its probability, where llama-server's masks it; and vLLM's sampler order is not
    llama.cpp's. A vLLM engine and a vLLM reference agree on both."""
    if reference_engine not in REFERENCE_ENGINES:
        raise RescoreError(
            f"unknown --reference-engine {reference_engine!r} (one of "
            f"{', '.join(REFERENCE_ENGINES)})"
        )
    path = Path(reference_vllm) if reference_vllm is not None else None
    if path is None and reference_engine != "vllm":
        return None, reference_engine
    if path is not None and (url is not None or model is not None):
        raise RescoreError(
            "give one reference: --reference-vllm, --reference-url or --reference-model"
        )
    if path is None and model is not None:
        raise RescoreError(
            "--reference-model is a GGUF for llama-server; a vLLM reference is a folder "
            "(--reference-vllm DIR) or a running server (--reference-url)"
        )
    if path is None and url is None:
        raise RescoreError("--reference-engine vllm needs --reference-url (or --reference-vllm)")
    if path is not None and not (path / "config.json").is_file():
        raise RescoreError(f"--reference-vllm {path} is not a Hugging Face model folder")
    if engine != "vllm":
        raise RescoreError(
            "a vLLM reference re-scores --engine vllm only (vLLM's ignore_eos leaves the end "
            "token its probability, llama-server's masks it; their sampler orders differ)"
        )
    return path, "vllm"


def check_draft(
    draft_url: str | None,
    draft_model: Path | str | None,
    *,
    closed: NextTokenSource | None = None,
    self_check: bool = False,
    top_k: int = DRAFT_TOP_K,
) -> tuple[str | None, Path | None]:
    """The draft of a re-scored run, checked (one-line RescoreError): at most one of a
    parseable `draft_url`, an existing `draft_model` file and a `closed` form; none with
    `self_check`; a draft top-k of at least 1."""
    url, path = _server_or_file(draft_url, draft_model, "draft")
    if closed is not None and (url or path):
        raise RescoreError("give one draft: a server, a model file or a closed form")
    if self_check and (url or path or closed):
        raise RescoreError("--self takes no draft")
    if not 1 <= top_k <= 1 << 20:
        raise RescoreError("--draft-top-k must be between 1 and 1048576")
    return url, path


def _server_or_file(
    url: str | None, model: Path | str | None, role: str
) -> tuple[str | None, Path | None]:
    """At most one of --ROLE-url (parseable) and --ROLE-model (an existing file)."""
    if url is not None and model is not None:
        raise RescoreError(f"give at most one of --{role}-url and --{role}-model")
    if url is not None:
        url = validate.url(url, f"--{role}-url", RescoreError)
    path = Path(model) if model is not None else None
    if path is not None and not path.is_file():
        raise RescoreError(f"--{role}-model {path} is not a file")
    return url, path


def check_run(
    *,
    seeds: int,
    tokens: int,
    alpha: float,
    concurrency: int,
    sampler: SamplerSettings,
    prompts: int = 1,
    seed_start: int | None = None,
) -> None:
    """What every re-scored run needs, checked before anything starts (one-line RescoreError):
    the seed count (and, given `seed_start`, that the seeds fit llama.cpp's 32-bit seed; a
    `dist` request checks its own range), alpha, concurrency, a temperature above 0, and
    enough sampled tokens (`seeds * tokens * prompts`) to decide."""
    if seed_start is None:
        if not 1 <= seeds <= MAX_SEEDS:
            raise RescoreError(f"--seeds must be between 1 and {MAX_SEEDS}")
    elif (
        not 1 <= seeds <= MAX_SEEDS
        or seed_start < 0
        or seed_start + seeds * prompts > validate.MAX_SEED
    ):
        raise RescoreError(
            "--seeds must be at least 1 and every prompt's seed range must fit 32 bits"
        )
    if not 0 < alpha < 0.5:
        raise RescoreError("--alpha must be between 0 and 0.5")
    if not 1 <= concurrency <= MAX_CONCURRENCY:
        raise RescoreError(f"--concurrency must be between 1 and {MAX_CONCURRENCY}")
    if sampler.temperature <= 0:
        raise RescoreError(
            "temperature 0 is greedy decoding: there is no distribution to test (use T > 0)"
        )
    analysis.check_enough(seeds * tokens * prompts, alpha)


def seed_jobs(seed_start: int, seeds: int, prompts: int) -> list[tuple[int, int]]:
    """Every (seed, prompt) to sample, in sampling order: the i-th sample of prompt p has seed
    seed_start + i * prompts + p, so every prompt draws its own seeds.

    Why not seeds 1..N on every prompt: llama.cpp's sampler draws its uniforms from a
    generator seeded by the seed alone, so one seed on two prompts gives both the same
    uniforms, and their tokens' PIT values and favourite hits are dependent. The tests assume
    independent draws; shared seeds made a plain Gemma server fail the directed test. Why
    interleaved rather than one block per prompt: no seed depends on N, so a run with more
    seeds extends one with fewer (the same first samples, in the same order), and an
    anytime-valid e-process over it continues where the shorter run stopped."""
    return [(seed_start + i * prompts + p, p) for i in range(seeds) for p in range(prompts)]
