"""`check --reference`: the logprobs a server reports, compared value by value with a plain
reference server of the same model (`specaudit.fidelity`, asked by
`specaudit.check.fidelity_probe`).

Why apart from `check`: `check` tells placeholders from numbers with one request per endpoint
and needs nothing but the server; this asks a reference about every token's exact prefix and
measures the reference's own noise floor first, so it only runs when a reference is given.
Native ``/completion`` only: the prompt goes as the reference's token ids, so every prefix is
known exactly (a chat template would have to be re-applied and re-tokenised).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specaudit import fidelity
from specaudit.check import fidelity_probe
from specaudit.client import Client, ClientError
from specaudit.errors import SpecauditError
from specaudit.fixtures import SamplerSettings
from specaudit.logprobs import utf8_complete
from specaudit.reference import (
    NextToken,
    ServerReference,
    ask_next_token,
    completion_body,
    identity_from_models,
    incremental_answers,
)

# Both modes, streamed and not: what a client of /completion can ask for.
KINDS = (
    fidelity_probe.ProbeKind("completion", False),
    fidelity_probe.ProbeKind("completion", True),
    fidelity_probe.ProbeKind("completion", False, stream=True),
    fidelity_probe.ProbeKind("completion", True, stream=True),
)
SAMPLER_TOP_K = 40  # the sampler's top-k for these probes (llama-server's default)
NOISE_BATCHES = (1, 2, 4)


class FidelityCheckError(SpecauditError):
    """`check --reference` cannot decide (one line, exit 2)."""


@dataclass
class FidelitySummary:
    """Every reported token of the probes, classified against the reference."""

    reference: str
    counts: fidelity.FidelityCounts
    by_kind: dict[str, fidelity.FidelityCounts]
    tolerance_prob: float
    tolerance_logprob: float
    drafted: int
    accepted: int
    worst: list[str] = field(default_factory=list)  # up to 5 "kind token i: what" lines
    uncompared: int = 0  # tokens after an unsent one (`fidelity.FidelityResult.uncompared`)

    @property
    def wrong(self) -> int:
        return self.counts.real_wrong


def prefix_answers(
    reference: str,
    ref: ServerReference,
    prefix: Sequence[int],
    sampler: SamplerSettings,
    *,
    timeout: float = 120.0,
) -> list[NextToken]:
    """The reference's answers for one prefix in every shape its noise floor is measured over:
    `ref`'s own answer, the same request 2 and 4 at a time with the prefix in one batch (as
    `fidelity_probe.server_noise_floor`), and its last 1-16 tokens as one batch on a cached prefix
    (`incremental_answers`), the shape of a verification batch. Every answer is asked for
    `ref.support` candidates with `ref.raw_probs` raw logprobs, as `ref` asks."""

    def whole(p: Sequence[int]) -> NextToken:
        return ask_next_token(
            reference, p, sampler, ref.support, raw_probs=ref.raw_probs, cache_prompt=False,
            timeout=timeout,
        )  # fmt: skip

    answers = [ref.next_token(prefix)]
    answers += incremental_answers(
        reference, prefix, sampler, ref.support, raw_probs=ref.raw_probs, timeout=timeout
    )
    for b in NOISE_BATCHES[1:]:
        with ThreadPoolExecutor(b) as ex:
            answers += list(ex.map(whole, [prefix] * b))
    return answers


def measure_floor(
    reference: str,
    ref: ServerReference,
    ids: Sequence[int],
    sampler: SamplerSettings,
    *,
    tokens: int,
    timeout: float = 120.0,
) -> fidelity.NoiseFloor:
    """The reference's own spread (`prefix_answers`) for about four prefixes along one of its
    own samples, the prompt first.

    Only prefixes after which the sample's next token is whole UTF-8 by itself: before a token
    that starts a character it splits into bytes (supplementary-plane CJK on Gemma 3), nearly
    every draw is held back and the reference has no probabilities to give
    (`specaudit.reference.held_back`)."""
    body = {**completion_body(ids, sampler, 1), "n_predict": tokens, "return_tokens": True}
    with Client(reference, timeout=timeout) as c:
        gen = [int(t) for t in c.post("/completion", body).get("tokens", [])]
    pieces = ref.pieces(gen) if gen else {}
    cuts = [j for j, t in enumerate(gen) if utf8_complete(pieces[t])]
    if len(cuts) == len(gen):
        cuts.append(len(gen))  # no split character in the sample: its end as well
    prefixes = [list(ids) + gen[:j] for j in (cuts or [0])[:: max(1, len(gen) // 3)]]
    return fidelity.noise_floor(
        prefix_answers(reference, ref, p, sampler, timeout=timeout) for p in prefixes
    )


def confirm_wrong(
    result: fidelity_probe.FidelityRun,
    reference: str,
    ref: ServerReference,
    prompt_ids: Sequence[int],
    sampler: SamplerSettings,
    floor: fidelity.NoiseFloor,
    *,
    limit: int = 4,
    timeout: float = 120.0,
) -> tuple[fidelity_probe.FidelityRun, fidelity.NoiseFloor]:
    """Before a token is called real but wrong, the reference's spread is measured at its own
    prefix: the prefixes of the (at most `limit`) wrong tokens closest to their bound are
    measured (`prefix_answers`), the floor becomes the largest spread over those and `floor`,
    and every token is classified again with that tolerance.

    Why: the floor measured along the reference's own sample misses prefixes where the
    reference's arithmetic moves more with the batch shape (on Gemma 3 270M the prob spread
    differs tenfold between prefixes); a call closest to its bound is the one such a prefix can
    explain. A deviation still beyond twice the spread measured at its own prefix stays wrong."""
    wrong = sorted(result.wrong(), key=lambda pt: pt[1].worst.score if pt[1].worst else 0.0)
    prefixes: list[tuple[int, ...]] = []
    for probe, tok in wrong:
        before = [r.token_id for r in probe.records[: tok.index]]
        if any(t is None for t in before):
            continue  # a token without an id: its prefix is not known exactly
        prefix = tuple(prompt_ids) + tuple(int(t) for t in before if t is not None)
        if prefix not in prefixes:
            prefixes.append(prefix)
        if len(prefixes) >= limit:
            break
    if not prefixes:
        return result, floor
    local = fidelity.noise_floor(
        prefix_answers(reference, ref, p, sampler, timeout=timeout) for p in prefixes
    )
    wider = fidelity.widest(floor, local)
    return fidelity_probe.reclassify(result, prompt_ids, ref, fidelity.tolerance(wider)), wider


def run(
    url: str,
    reference: str,
    *,
    prompt: str,
    seed: int,
    tokens: int,
    top_k: int,
    temperature: float,
    timeout: float = 120.0,
    api_key: str | None = None,
) -> FidelitySummary:
    """Probe `url` on every /completion kind and classify each token against `reference`."""
    sampler = SamplerSettings(
        top_k=SAMPLER_TOP_K, top_p=1.0, min_p=0.0, temperature=max(temperature, 1e-6)
    )
    try:
        ref = ServerReference(reference, sampler, raw_probs=max(top_k, 20), timeout=timeout)
        with Client(url, timeout=timeout, api_key=api_key) as c:
            ident = identity_from_models(c.get("/v1/models"))
    except ClientError as e:
        raise FidelityCheckError(f"--reference: {e}") from None
    if ident is not None and ref.identity is not None:
        diff = ref.identity.differences(ident)
        if diff:
            raise FidelityCheckError(
                f"the server and --reference do not serve the same model: {', '.join(diff)}"
            )
    ids = ref.tokenize(prompt)
    sampling = sampler.request_fields()
    try:
        floor = measure_floor(reference, ref, ids, sampler, tokens=tokens, timeout=timeout)
        res = fidelity_probe.probe_server(
            url, prompt=ids, prompt_ids=ids, reference=ref, tol=fidelity.tolerance(floor),
            sampling=sampling, seeds=[seed], tokens=tokens, n_probs=top_k, kinds=KINDS,
            pieces=ref.pieces, timeout=timeout,
        )  # fmt: skip
        res, floor = confirm_wrong(res, reference, ref, ids, sampler, floor, timeout=timeout)
        tol = fidelity.tolerance(floor)
    except ClientError as e:
        raise FidelityCheckError(f"fidelity probes: {e}") from None
    worst = [
        f"{p.kind.label} token {t.index}: {t.worst}" if t.worst else f"{p.kind.label}"
        for p, t in res.wrong()[:5]
    ]
    drafted, accepted = res.drafted
    return FidelitySummary(
        reference=reference, counts=res.counts, by_kind=res.counts_by_kind(),
        tolerance_prob=tol.prob, tolerance_logprob=tol.logprob, drafted=drafted,
        accepted=accepted, worst=worst, uncompared=res.uncompared,
    )  # fmt: skip


__all__ = [
    "KINDS",
    "FidelityCheckError",
    "FidelitySummary",
    "confirm_wrong",
    "measure_floor",
    "prefix_answers",
    "run",
]
