"""llama-server presets: which model, whether and how it speculates, which binaries, and the
threads/context/slots policy, in one place.

Why one place: the audit, `dist`, `ab` and the test suite all start the same few kinds of
server (the fixture or Gemma; plain, speculating, or speculating with the patched binaries).
Each used to carry its own copy of the policy (threads, context per slot, slots), so a fix in
one silently missed the others. A `Preset` names a role; `start_args` turns a role plus model
files into `LlamaServer` arguments; `server` builds the (not yet started) `LlamaServer`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specaudit.fixtures.reference import SamplerSettings
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer

MODELS = (
    "fixture", "fixture-context", "fixture-mtp", "fixture-mtp-context", "fixture-mtp-attention",
    "fixture-replay", "gemma",
)  # fmt: skip
PATCH = "spec-logprobs"  # the bundled patch the "patched" variant is built with
SPECULATIVE_FIX = "speculative-fix"  # the bundled llama-speculative fix (#29975), its own variant
REPLAY_FIX = "replay-fix"  # the bundled fix of the checkpoint replay's rewound rejection stream
DEFAULT_SPEC_TYPE = "draft-simple"
# llama.cpp's --spec-draft-sampling: greedy (its default; sample-and-match), probabilistic
# (the draft samples and reports q; the target verifies by rejection sampling, temperature > 0)
DRAFT_SAMPLING = ("greedy", "probabilistic")
# A probabilistic draft samples from its own chain, not the target's: top-k 10, then the
# target's temperature, nothing else (common/speculative.cpp, spec_retune); rejection sampling
# weighs that q against p, so a test of the verification rule needs this q
DRAFT_TOP_K = 10


def draft_chain(sampler: SamplerSettings, top_k: int = DRAFT_TOP_K) -> SamplerSettings:
    """The sampler settings llama.cpp's probabilistic draft samples with, for a request
    sampled with `sampler`."""
    return SamplerSettings(top_k=top_k, top_p=1.0, min_p=0.0, temperature=sampler.temperature)


# The verification paths a fixture server can exercise (docs/dist.md, "Verification paths"):
# no speculation; a greedy draft (sample-and-match); a probabilistic draft (rejection
# sampling); n-gram drafting from the context (ngram-mod: no draft model, sample-and-match);
# and b11434's four other n-gram drafters, one path each (same verifier, other proposers).
PATHS = (
    "plain", "greedy", "rejection", "ngram",
    "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache",
    "mtp", "mtp-rejection", "eagle3", "dflash", "dspark", "replay", "replay-rejection",
)  # fmt: skip
# The MTP paths: `--spec-type draft-mtp` with no draft model drafts with the target's own
# multi-token-prediction layer (a second, MTP-type context on the target model), greedy
# (sample-and-match) or probabilistic (rejection sampling). Only the MTP fixture
# (fixtures kind "mtp", model "fixture-mtp"; kind "mtp-context", model "fixture-mtp-context")
# has such a layer: on a model without one llama-server refuses to start. They run these and
# "plain".
MTP_PATHS = ("mtp", "mtp-rejection")
# "eagle3": `--spec-type draft-eagle3` with the fixture's EAGLE3 head as -md
# (fixtures.eagle3_draft), on the llama fixtures; argmax drafts (the draft table's greedy chain
# from the fed token), sample-and-match.
# "dflash", "dspark": `--spec-type draft-dflash` / `draft-dspark` with the fixture's DFlash or
# DSpark draft as -md (fixtures.dflash_draft), on the llama fixtures; a block of argmax drafts
# from one non-causal pass anchored on the last token (DSpark: chained by its Markov head),
# sample-and-match (at temperature > 0 too: these drafters report no q).
#: The spec-type of each block-drafter path, and whether its draft has DSpark's Markov head.
BLOCK_DRAFT_PATHS: dict[str, tuple[str, bool]] = {
    "dflash": ("draft-dflash", False),
    "dspark": ("draft-dspark", True),
}
MTP_MODEL_PATHS = ("plain", *MTP_PATHS)
# The checkpoint replay paths: the replay fixture (fixtures kind "replay", model
# "fixture-replay") has a Mamba target, whose recurrent memory cannot drop a rejected draft
# suffix, so llama-server checkpoints before verifying and, on a partial acceptance, restores
# the checkpoint and replays what was accepted (`spec_is_replay`): with the fixture's draft
# model greedy (sample-and-match, replayed by re-verifying) or probabilistic (rejection
# sampling, replayed by `server_accept_replay`). That fixture runs these and "plain".
REPLAY_PATHS = ("replay", "replay-rejection")
REPLAY_MODEL_PATHS = ("plain", *REPLAY_PATHS)
#: The paths each fixture model runs (the llama fixtures: every path but the MTP and replay ones).
MODEL_PATHS: dict[str, tuple[str, ...]] = {
    "fixture-mtp": MTP_MODEL_PATHS,
    "fixture-mtp-context": MTP_MODEL_PATHS,
    "fixture-mtp-attention": MTP_MODEL_PATHS,
    "fixture-replay": REPLAY_MODEL_PATHS,
    **{
        m: tuple(p for p in PATHS if p not in MTP_PATHS and p not in REPLAY_PATHS)
        for m in ("fixture", "fixture-context")
    },
}

# ngram-mod's defaults look up 24-token n-grams and draft nothing under 48 tokens: on the
# fixture's 5-letter prompt it would never draft. Single-token lookups make it draft whenever
# the last token appeared in the prompt (on the default fixture, 4 tokens per sample, ~0.2
# drafts per request; measured 36 drafted / 20 accepted on 200 seeds, the context fixture
# 343 / 81). llama.cpp warns that n_match < 16 is "poor quality": drafts, not correctness.
FIXTURE_NGRAM_ARGS = (
    "--spec-ngram-mod-n-match", "1",
    "--spec-ngram-mod-n-min", "1",
    "--spec-ngram-mod-n-max", "8",
)  # fmt: skip
# The other n-gram drafters of b11434 (flags: common/arg.cpp; drafters: common/speculative.cpp,
# common/ngram-map.cpp, common/ngram-cache.cpp), each with the shortest lookups its flags allow:
# their defaults (12-token keys, 48-token values) never draft on the fixture's 5-letter prompt.
# ngram-cache has no flags of its own (1- to 4-gram lookups, 8-token drafts, fixed thresholds).
# All four verify by sample-and-match. What they keep across requests (docs/dist.md):
# - ngram-simple: nothing (it searches the request's own tokens);
# - ngram-map-k/-k4v, per slot: the keys found inside the prompt, each with its last draft's
#   accepted count, which caps its next draft (a key rejected outright drafts no more there);
# - ngram-cache, per slot: an n-gram cache fed only past the longest sequence the slot has seen
#   (requests of equal length keep drafting from the slot's first request).
# None of it can change a sample: each emitted token is the target's own draw at its position,
# one RNG draw per token, as without a draft.
NGRAM_TYPE_ARGS: dict[str, tuple[str, ...]] = {
    "ngram-simple": ("--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", "2"),
    "ngram-map-k": ("--spec-ngram-map-k-size-n", "1", "--spec-ngram-map-k-size-m", "1"),
    "ngram-map-k4v": (
        "--spec-ngram-map-k4v-size-n", "1",
        "--spec-ngram-map-k4v-size-m", "1",
        "--spec-ngram-map-k4v-min-hits", "1",
    ),
    "ngram-cache": (),
}  # fmt: skip


@dataclass(frozen=True)
class Policy:
    """How a model's servers are sized."""

    parallel: int  # slots (-np)
    ctx_per_slot: int  # tokens of context each slot gets (-c is parallel x this)
    threads: int | None  # -t; None: llama-server's default
    args: tuple[str, ...] = ()  # more llama-server arguments, after -t


# One thread per server: a tiny model gains nothing from more, and with several servers on
# few cores extra threads cost 2-6x throughput (llama.cpp's idle workers spin). Gemma too:
# its servers work in pairs (engine and reference, plain and speculating), and at one thread
# each a re-scored Gemma run took 31 s where two threads each took 76 s (polling off: 164 s).
# The fixture's context is 256 tokens (fixtures.FixtureConfig.context_length); the server caps
# a slot there anyway.
# The context fixture (fixtures.context_spec) sees its whole context through attention: an f32
# KV cache keeps llama.cpp's logits within float32 rounding of the closed form whether flash
# attention is on (the default on CPU; K and V are cast to f16, exact for that fixture) or off
# (then an f16 V cache would round the attention weights 1/n, moving probabilities ~1e-4).
POLICIES = {
    "fixture": Policy(parallel=4, ctx_per_slot=256, threads=1),
    "fixture-context": Policy(
        parallel=4, ctx_per_slot=256, threads=1, args=("-ctk", "f32", "-ctv", "f32")
    ),
    "fixture-mtp": Policy(parallel=4, ctx_per_slot=256, threads=1),
    # the mtp-context fixture's trunk is the context fixture's attention: the same f32 KV cache
    "fixture-mtp-context": Policy(
        parallel=4, ctx_per_slot=256, threads=1, args=("-ctk", "f32", "-ctv", "f32")
    ),
    # the mtp-attention fixture's MTP layer attends over its own cache (casts to f16 there
    # with flash attention, as fixtures.reference.mtp_attention_head models)
    "fixture-mtp-attention": Policy(
        parallel=4, ctx_per_slot=256, threads=1, args=("-ctk", "f32", "-ctv", "f32")
    ),
    "fixture-replay": Policy(parallel=4, ctx_per_slot=256, threads=1),
    "gemma": Policy(parallel=2, ctx_per_slot=2048, threads=1),
}


def cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (not Linux)
        return os.cpu_count() or 1


def shared_threads(servers: int) -> int:
    """Threads (-t) for each of `servers` llama-servers that work at once on this machine:
    the cores split among them, at least one. At llama-server's default each takes every
    core, and on 2 cores two Gemma servers spun against each other (a 6-token prompt took
    4.0-4.3 s instead of about 50 ms)."""
    return max(1, cores() // max(1, servers))


def uses_draft(spec_type: str | None) -> bool:
    """Whether a --spec-type list needs a draft model (the draft-* types but MTP)."""
    if not spec_type:
        return False
    return any(t.startswith("draft-") and t != "draft-mtp" for t in spec_type.split(","))


@dataclass(frozen=True)
class Preset:
    """A named server role."""

    name: str
    model: str  # "fixture", "fixture-context" or "gemma" (a POLICIES key)
    speculative: bool
    variant: str = "stock"  # or "patched"
    spec_type: str = DEFAULT_SPEC_TYPE
    draft_sampling: str = "greedy"  # a DRAFT_SAMPLING value (with a draft model only)
    args: tuple[str, ...] = ()  # more llama-server arguments, after the policy's

    def __post_init__(self) -> None:
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"{self.name}: draft_sampling {self.draft_sampling!r}")
        if self.draft_sampling != "greedy" and not (self.uses_draft or self.uses_mtp):
            raise ValueError(f"{self.name}: draft_sampling needs a draft model or MTP")

    @property
    def uses_mtp(self) -> bool:
        """Drafts with the target's own MTP layer (no draft model)."""
        return self.speculative and self.spec_type == "draft-mtp"

    @property
    def uses_draft(self) -> bool:
        return self.speculative and uses_draft(self.spec_type)

    @property
    def extra_args(self) -> tuple[str, ...]:
        """What the role adds to the policy: the draft sampling (greedy: llama.cpp's default,
        no flag), then `args`."""
        sampling = ("--spec-draft-sampling", self.draft_sampling)
        return (*(sampling if self.draft_sampling != "greedy" else ()), *self.args)

    @property
    def patches(self) -> tuple[str, ...]:
        return (PATCH,) if self.variant == "patched" else ()

    @property
    def policy(self) -> Policy:
        return POLICIES[self.model]


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("fixture-plain", "fixture", False),
        Preset("fixture-spec", "fixture", True),
        Preset("fixture-context-plain", "fixture-context", False),
        Preset("fixture-context-spec", "fixture-context", True),
        # the other verification paths (PATHS), on both fixtures: `fixture_role`
        Preset("fixture-spec-rejection", "fixture", True, draft_sampling="probabilistic"),
        Preset("fixture-ngram", "fixture", True, spec_type="ngram-mod", args=FIXTURE_NGRAM_ARGS),
        Preset(
            "fixture-context-spec-rejection",
            "fixture-context",
            True,
            draft_sampling="probabilistic",
        ),
        Preset(
            "fixture-context-ngram",
            "fixture-context",
            True,
            spec_type="ngram-mod",
            args=FIXTURE_NGRAM_ARGS,
        ),
        *(
            Preset(f"{model}-{t}", model, True, spec_type=t, args=a)
            for model in ("fixture", "fixture-context")
            for t, a in NGRAM_TYPE_ARGS.items()
        ),
        # EAGLE3: -md is the fixture's EAGLE3 head (fixtures.eagle3_draft), not draft.gguf
        *(
            Preset(f"{model}-eagle3", model, True, spec_type="draft-eagle3")
            for model in ("fixture", "fixture-context")
        ),
        # DFlash, DSpark: -md is the fixture's block draft (fixtures.dflash_draft)
        *(
            Preset(f"{model}-{p}", model, True, spec_type=t)
            for model in ("fixture", "fixture-context")
            for p, (t, _) in BLOCK_DRAFT_PATHS.items()
        ),
        # the n-gram types with the spec-logprobs patch (`check`, the patch-equality tests)
        *(
            Preset(f"fixture-{t}-patched", "fixture", True, "patched", spec_type=t, args=a)
            for t, a in NGRAM_TYPE_ARGS.items()
        ),
        *(
            p
            for model in ("fixture-mtp", "fixture-mtp-context", "fixture-mtp-attention")
            for p in (
                Preset(f"{model}-plain", model, False),
                Preset(f"{model}-mtp", model, True, spec_type="draft-mtp"),
                Preset(
                    f"{model}-mtp-rejection",
                    model,
                    True,
                    spec_type="draft-mtp",
                    draft_sampling="probabilistic",
                ),
            )
        ),
        Preset("fixture-replay-plain", "fixture-replay", False),
        Preset("fixture-replay-spec", "fixture-replay", True),
        Preset(
            "fixture-replay-spec-rejection",
            "fixture-replay",
            True,
            draft_sampling="probabilistic",
        ),
        Preset("gemma-plain", "gemma", False),
        Preset("gemma-spec", "gemma", True),
        Preset("fixture-spec-patched", "fixture", True, "patched"),
        Preset("gemma-spec-patched", "gemma", True, "patched"),
        Preset("gemma-ngram", "gemma", True, spec_type="ngram-mod"),
    )
}


_PATH_ROLES = {
    "plain": "plain",
    "greedy": "spec",
    "rejection": "spec-rejection",
    "ngram": "ngram",
    **{t: t for t in NGRAM_TYPE_ARGS},
    **{p: p for p in MTP_PATHS},
    "eagle3": "eagle3",
    **{p: p for p in BLOCK_DRAFT_PATHS},
    "replay": "spec",
    "replay-rejection": "spec-rejection",
}


def fixture_role(model: str, path: str) -> str:
    """The `PRESETS` name of a fixture server (`model` "fixture", "fixture-context",
    "fixture-mtp", "fixture-mtp-context", "fixture-mtp-attention" or "fixture-replay") on a
    verification path (a `PATHS` value; each model runs its `MODEL_PATHS`: the MTP fixtures
    `MTP_MODEL_PATHS`, the replay fixture `REPLAY_MODEL_PATHS`, the others every other path)."""
    if model not in MODEL_PATHS:
        raise ValueError(f"not a fixture model: {model!r}")
    if path not in _PATH_ROLES:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if path not in MODEL_PATHS[model]:
        raise ValueError(f"path {path!r} does not run on the {model!r} model")
    return f"{model}-{_PATH_ROLES[path]}"


def path_of(preset: Preset) -> str:
    """The verification path a role exercises (a `PATHS` value)."""
    if not preset.speculative:
        return "plain"
    if preset.uses_mtp:
        return "mtp-rejection" if preset.draft_sampling == "probabilistic" else "mtp"
    if preset.spec_type == "draft-eagle3":
        return "eagle3"
    for p, (t, _) in BLOCK_DRAFT_PATHS.items():
        if preset.spec_type == t:
            return p
    if preset.model == "fixture-replay":
        return "replay-rejection" if preset.draft_sampling == "probabilistic" else "replay"
    if not preset.uses_draft:
        # the n-gram types: ngram-mod is "ngram", the others are named by their type
        return preset.spec_type if preset.spec_type in NGRAM_TYPE_ARGS else "ngram"
    return "rejection" if preset.draft_sampling == "probabilistic" else "greedy"


def server(
    binaries: LlamaBinaries,
    model: Path,
    *,
    kind: str,
    draft: Path | None = None,
    spec_type: str | None = None,
    parallel: int | None = None,
    ctx_per_slot: int | None = None,
    log_path: Path | None = None,
    name: str = "llama-server",
    extra_args: Sequence[str] = (),
) -> LlamaServer:
    """A `LlamaServer` (not started) sized by the `kind` (a `POLICIES` key: "fixture",
    "fixture-context", "gemma") policy; `parallel` and `ctx_per_slot` override it for
    workloads that need other sizes; `extra_args` are appended after the policy's own
    arguments."""
    pol = POLICIES[kind]
    n_par = parallel or pol.parallel
    per_slot = ctx_per_slot or pol.ctx_per_slot
    return LlamaServer(
        binaries,
        model,
        draft=draft if spec_type and uses_draft(spec_type) else None,
        spec_type=spec_type or None,
        parallel=n_par,
        ctx_size=n_par * per_slot,
        extra_args=[*(["-t", str(pol.threads)] if pol.threads else []), *pol.args, *extra_args],
        log_path=log_path,
        name=name,
    )


def for_preset(
    preset: Preset,
    binaries: LlamaBinaries,
    model: Path,
    draft: Path | None,
    *,
    log_path: Path | None = None,
    parallel: int | None = None,
    ctx_per_slot: int | None = None,
    name: str | None = None,
) -> LlamaServer:
    """The `LlamaServer` (not started) of a named role (`name`: the server's, default the
    role's)."""
    if preset.spec_type == "draft-eagle3":
        # b11434's backend draft sampling (on by default) hands the EAGLE3 drafter wrong
        # candidates with several slots busy: drafts off the closed form, and now and then an
        # abort in common_batch::get_sub_batch ("failed to add token <a logit's float bits>",
        # docs/upstream/llama-server-eagle3-backend-sampling.md). One slot keeps it measurable.
        parallel = 1
    return server(
        binaries,
        model,
        kind=preset.model,
        draft=draft if preset.uses_draft else None,
        spec_type=preset.spec_type if preset.speculative else None,
        parallel=parallel,
        ctx_per_slot=ctx_per_slot,
        log_path=log_path,
        name=name or preset.name,
        extra_args=preset.extra_args,
    )


__all__ = [
    "BLOCK_DRAFT_PATHS",
    "DRAFT_SAMPLING",
    "FIXTURE_NGRAM_ARGS",
    "MODELS",
    "MTP_MODEL_PATHS",
    "MTP_PATHS",
    "NGRAM_TYPE_ARGS",
    "PATCH",
    "PATHS",
    "POLICIES",
    "PRESETS",
    "Policy",
    "Preset",
    "fixture_role",
    "for_preset",
    "path_of",
    "server",
    "uses_draft",
]
