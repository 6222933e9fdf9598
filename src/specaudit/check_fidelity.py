"""`check --reference`: the logprobs a server reports, compared value by value with a plain
reference server of the same model (`specaudit.fidelity`).

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
from specaudit.client import Client, ClientError
from specaudit.errors import SpecauditError
from specaudit.fixtures import SamplerSettings
from specaudit.rescore.records import NextToken
from specaudit.rescore.reference import (
    ServerReference,
    ask_next_token,
    completion_body,
    identity_from_models,
    incremental_answers,
)

# Both modes, streamed and not: what a client of /completion can ask for.
KINDS = (
    fidelity.ProbeKind("completion", False),
    fidelity.ProbeKind("completion", True),
    fidelity.ProbeKind("completion", False, stream=True),
    fidelity.ProbeKind("completion", True, stream=True),
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

    @property
    def wrong(self) -> int:
        return self.counts.real_wrong


def measure_floor(
    reference: str,
    ref: ServerReference,
    ids: Sequence[int],
    sampler: SamplerSettings,
    *,
    tokens: int,
    timeout: float = 120.0,
) -> fidelity.NoiseFloor:
    """The reference's own spread for the prompt and for prefixes along one of its own
    samples: the same request 1, 2 and 4 at a time, the prefix in one batch (as
    `fidelity.server_noise_floor`), and the last 1-4 tokens evaluated as one batch on a cached
    prefix (`incremental_answers`), the shape of a verification batch. Every answer is asked
    for `ref.support` candidates with `ref.raw_probs` raw logprobs, as `ref` asks."""
    body = {**completion_body(ids, sampler, 1), "n_predict": tokens, "return_tokens": True}
    with Client(reference, timeout=timeout) as c:
        gen = [int(t) for t in c.post("/completion", body).get("tokens", [])]
    prefixes = [list(ids) + gen[:j] for j in range(0, len(gen) + 1, max(1, len(gen) // 3))]

    def whole(p: Sequence[int]) -> NextToken:
        return ask_next_token(
            reference, p, sampler, ref.support, raw_probs=ref.raw_probs, cache_prompt=False,
            timeout=timeout,
        )  # fmt: skip

    groups = []
    for p in prefixes:
        answers = [ref.next_token(p)]
        answers += incremental_answers(
            reference, p, sampler, ref.support, raw_probs=ref.raw_probs, timeout=timeout
        )
        for b in NOISE_BATCHES[1:]:
            with ThreadPoolExecutor(b) as ex:
                answers += list(ex.map(whole, [p] * b))
        groups.append(answers)
    return fidelity.noise_floor(groups)


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
        tol = fidelity.tolerance(
            measure_floor(reference, ref, ids, sampler, tokens=tokens, timeout=timeout)
        )
        res = fidelity.probe_server(
            url, prompt=ids, prompt_ids=ids, reference=ref, tol=tol, sampling=sampling,
            seeds=[seed], tokens=tokens, n_probs=top_k, kinds=KINDS, timeout=timeout,
        )  # fmt: skip
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
        accepted=accepted, worst=worst,
    )  # fmt: skip


__all__ = ["KINDS", "FidelityCheckError", "FidelitySummary", "run"]
