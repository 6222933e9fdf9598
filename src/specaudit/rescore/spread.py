"""How much the reference disagrees with itself, as the re-scored run uses it: the floor under
its same-model probe (`noise_spread`, `probe_difference`), its top-k edge rule (`at_the_edge`)
and its own rate of mass leaked across the top-k edge (`edge_leak`, the outside count test's
null rate).

Why in `rescore` and not with the reference client (`specaudit.reference`): these are the
re-scored run's rules about what a disagreement means; the client only asks and parses. The
fidelity check measures its own floor (`specaudit.fidelity`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from specaudit.client import Client
from specaudit.fixtures import SamplerSettings
from specaudit.reference import (
    NextToken,
    Reference,
    alone,
    ask_next_token,
    completion_body,
    incremental_answers,
    read_next_token,
)
from specaudit.rescore import outside
from specaudit.rescore.outside import EdgeLeak, Key, leak_units
from specaudit.rescore.records import TokenDraw
from specaudit.vllm.reference import VllmReference

# the reference a run asks: a plain llama-server, or a plain vLLM server (`vllm.reference`)
AnyReference = Reference | VllmReference

EDGE_CONFIRM = 8  # tokens past the far margin whose own prefix's batch shapes are asked
FAR_FACTOR = 4.0  # "beyond any margin": this many times the run's margin below the k-th
FAR_MIN = 0.5  # ... and at least this many nats
# Probe prompt distributions of engine and reference may differ by this much (float noise of
# batch sizes and threads; the fidelity check measures the floor properly).
PROBE_TOLERANCE = 0.02


def noise_spread(
    url: str,
    ids: Sequence[int],
    sampler: SamplerSettings,
    n_probs: int,
    timeout: float = 120.0,
    extend: int = 24,
) -> tuple[float, float]:
    """How much the reference disagrees with itself across batch shapes and slots: (largest TV
    between two answers, largest spread of a raw logprob), over `ids` and `ids` extended by
    `extend` tokens of the reference's own. Answers: the prefix in one piece, its last 1-16
    tokens as one batch on a cached prefix (`incremental_answers`), and four identical
    requests at once (batched across the reference's slots). The floor under the same-model
    probe and the top-k boundary rule."""
    from concurrent.futures import ThreadPoolExecutor

    def whole(p: Sequence[int]) -> NextToken:
        return ask_next_token(
            url, p, sampler, n_probs, raw_probs=n_probs + 20, cache_prompt=False, timeout=timeout
        )

    with Client(url, timeout=timeout) as c:
        gen = c.post(
            "/completion",
            {**completion_body(ids, sampler, 1), "n_predict": extend, "return_tokens": True},
        ).get("tokens", [])
    tv, lp = 0.0, 0.0
    for p in (list(ids), [*ids, *(int(t) for t in gen)]):
        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(whole, [p] * 4))
        answers += incremental_answers(url, p, sampler, n_probs, raw_probs=n_probs + 20)
        tv = max(tv, *(probe_difference(a.probs, b.probs) for a in answers for b in answers))
        lp = max(lp, logprob_spread(answers))
    return tv, lp


async def reference_spread(
    ref: AnyReference, ids: Sequence[int], n_probs: int, timeout: float = 120.0
) -> tuple[float, float]:
    """`noise_spread` of the run's reference: a llama-server alone on its slots
    (`noise_spread`), a vLLM server in the shapes it lets a client cause (`vllm_spread`)."""
    if isinstance(ref, VllmReference):
        return await vllm_spread(ref, ids, n_probs)
    return await alone(ref.url, noise_spread, ref.url, ids, ref.sampler, n_probs, timeout)


async def vllm_spread(
    ref: VllmReference, ids: Sequence[int], n_probs: int, extend: int = 24
) -> tuple[float, float]:
    """`noise_spread` on a vLLM reference: over `ids` and `ids` extended by `extend` tokens of
    its own, the answers of four identical requests at once and of the prefix batched with its
    shorter prefixes and asked again on the prefix cache that left (`VllmReference.shapes`:
    vLLM has no slot to pin, so llama-server's k-tokens-on-a-cached-prefix shapes are not to
    be had)."""
    gen = await ref.generate(ids, extend)
    tv, lp = 0.0, 0.0
    for p in (list(ids), [*ids, *gen]):
        answers = await other_shapes(ref, p, n_probs, with_concurrent=True)
        tv = max(tv, *(probe_difference(a.probs, b.probs) for a in answers for b in answers))
        lp = max(lp, logprob_spread(answers))
    return tv, lp


async def other_shapes(
    ref: AnyReference,
    ids: Sequence[int],
    n_probs: int,
    *,
    with_concurrent: bool = False,
    raw: bool = True,
    timeout: float = 120.0,
) -> list[NextToken]:
    """The reference's answers for `ids` in the batch shapes a verification uses, as far as
    the reference lets a client cause them: llama-server's last k tokens as one batch on a
    cached prefix (`incremental_answers`, pinned slot, asked `alone`); vLLM's batched and
    prefix-cached shapes (`VllmReference.shapes`). `with_concurrent` adds four identical
    requests at once; `raw` the raw top-(`n_probs` + 20) log-probabilities."""
    raw_n = n_probs + 20 if raw else 0
    if isinstance(ref, VllmReference):
        out = await ref.concurrent(ids, raw_n) if with_concurrent else []
        return out + await ref.shapes(ids, raw_n)
    assert not with_concurrent, "llama-server's concurrent answers are noise_spread's own"
    return await alone(
        ref.url, incremental_answers, ref.url, ids, ref.sampler, n_probs,
        raw_probs=n_probs + 20, timeout=timeout,
    )  # fmt: skip


def edge_leak(
    url: str,
    prefixes: Sequence[Sequence[int]],
    wholes: Sequence[Mapping[int, float]],
    sampler: SamplerSettings,
    n_probs: int,
    delta: float,
    timeout: float = 120.0,
) -> EdgeLeak:
    """The reference's own leak across its top-k edge (`outside.leak_units`) at each of
    `prefixes`, against `wholes` (its whole-prefix answers, which the run already has): asked
    as four identical requests at once (batched across its slots) and with the last 1, 2, 4,
    8, 16 tokens as one batch on a cached prefix (`incremental_answers`), the shapes a
    verification uses. Cost: 4 + 4 x 5 = 24 one-token requests per prefix (fewer for prefixes
    shorter than 17 tokens), 384 for the default 16 prefixes, whatever the run's length."""
    from concurrent.futures import ThreadPoolExecutor

    def batched(p: Sequence[int]) -> dict[int, float]:
        with Client(url, timeout=timeout) as c:
            body = completion_body(p, sampler, n_probs, cache_prompt=False)
            return read_next_token(c, body, post=True)

    leaks = []
    for p, whole in zip(prefixes, wholes, strict=True):
        with ThreadPoolExecutor(4) as ex:
            shapes = list(ex.map(batched, [p] * 4))
        inc = incremental_answers(url, p, sampler, n_probs, timeout=timeout)
        leaks.append(leak_units(whole, [*shapes, *(a.probs for a in inc)]))
    return EdgeLeak(tuple(leaks), delta)


async def measure_edge_leak(
    ref: AnyReference,
    prompts: Sequence[Sequence[int]],
    draws: Sequence[TokenDraw],
    n_probs: int,
    alpha: float,
    timeout: float = 120.0,
) -> EdgeLeak | None:
    """`edge_leak` at `outside.EDGE_PREFIXES` of the run's prefixes drawn with replacement
    (`outside.sample_draws`), reusing the run's whole-prefix answers; its bound at alpha x
    `outside.BOUND_SHARE`. None with no draws."""
    picked = [draws[i] for i in outside.sample_draws(len(draws))]
    if not picked:
        return None
    prefixes = [[*prompts[d.prompt], *outside.generated_ids(d)] for d in picked]
    if isinstance(ref, VllmReference):
        leaks = []
        for p, d in zip(prefixes, picked, strict=True):
            shapes = await other_shapes(ref, p, n_probs, with_concurrent=True, raw=False)
            leaks.append(leak_units(d.ref.probs, [a.probs for a in shapes]))
        return EdgeLeak(tuple(leaks), alpha * outside.BOUND_SHARE)
    return await alone(
        ref.url, edge_leak, ref.url, prefixes, [d.ref.probs for d in picked], ref.sampler,
        n_probs, alpha * outside.BOUND_SHARE, timeout,
    )  # fmt: skip


class OutsideSorter:
    """Sorts the sampled tokens outside the reference's whole-prefix top-k, as they are
    re-scored: at the edge (`near`: counted by the outside test against the reference's own
    rate) or impossible in every batch shape (`far`: the outside test rejects on one).

    Far: the token's raw logprob at its prefix is more than `FAR_FACTOR` times the run's
    margin (at least `FAR_MIN` nats) below the k-th token's, or not among the top k + 20 at
    all; and, for the first `EDGE_CONFIRM` such tokens, it is outside the top-k and beyond
    twice the spread in every batch shape a verification uses, asked at its own prefix
    (`incremental_answers`; the margin comes from the first prompt, and the spread differs
    from prefix to prefix). Cost: one request per token outside the support, 20 more for each
    of at most `EDGE_CONFIRM` of them."""

    def __init__(
        self,
        ref: AnyReference,
        prompts: Sequence[Sequence[int]],
        n_probs: int,
        margin: float,
        timeout: float,
    ) -> None:
        self.ref, self.prompts, self.n_probs = ref, prompts, n_probs
        self.margin, self.timeout = margin, timeout
        self.far: set[Key] = set()
        self.near = 0
        self.confirmed = 0

    @staticmethod
    async def sort(sorter: OutsideSorter | None, draws: Sequence[TokenDraw]) -> None:
        """`sorter.classify(draws)`, nothing without a sorter."""
        if sorter is not None:
            await sorter.classify(draws)

    async def classify(self, draws: Sequence[TokenDraw]) -> None:
        for d in draws:
            if outside.is_outside(d):
                if await self._far(d):
                    self.far.add(outside.key_of(d))
                else:
                    self.near += 1

    async def _far(self, d: TokenDraw) -> bool:
        prefix = [*self.prompts[d.prompt], *outside.generated_ids(d)]
        whole = NextToken(probs=d.ref.probs, logprobs=await self.ref.raw(prefix, self.n_probs + 20))
        support = [whole.logprobs[t] for t in d.ref.probs if t in whole.logprobs]
        if at_the_edge(d.token, [whole], self.margin):
            return False
        gap = min(support) - whole.logprobs[d.token] if d.token in whole.logprobs else math.inf
        if support and gap <= max(FAR_FACTOR * self.margin, FAR_MIN):
            return False
        if self.confirmed >= EDGE_CONFIRM:
            return True
        self.confirmed += 1
        answers = await other_shapes(self.ref, prefix, self.n_probs, timeout=self.timeout)
        return not at_the_edge(d.token, [whole, *answers], self.margin)


def logprob_spread(answers: Sequence[NextToken]) -> float:
    """The largest spread of one token's raw logprob across `answers` (tokens every answer
    reports); 0 for fewer than two answers."""
    if len(answers) < 2:
        return 0.0
    common = set.intersection(*(set(a.logprobs) for a in answers))
    return max(
        (max(a.logprobs[t] for a in answers) - min(a.logprobs[t] for a in answers) for t in common),
        default=0.0,
    )


def at_the_edge(token: int, answers: Sequence[NextToken], margin: float) -> bool:
    """Whether `token`, outside one answer's top-k, is inside it in another batch shape, or
    within the margin of the k-th token's raw logprob in one of them: the larger of `margin`
    and twice the spread measured among these answers (answers for one prefix)."""
    m = max(margin, 2 * logprob_spread(answers))
    for a in answers:
        if token in a.probs:
            return True
        support = [a.logprobs[t] for t in a.probs if t in a.logprobs]
        if token in a.logprobs and support and a.logprobs[token] >= min(support) - m:
            return True
    return False


def probe_difference(a: Mapping[int, float], b: Mapping[int, float]) -> float:
    """Total-variation distance between two next-token distributions (token id -> prob)."""
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


__all__ = [
    "AnyReference",
    "EDGE_CONFIRM",
    "FAR_FACTOR",
    "FAR_MIN",
    "PROBE_TOLERANCE",
    "OutsideSorter",
    "at_the_edge",
    "edge_leak",
    "measure_edge_leak",
    "logprob_spread",
    "noise_spread",
    "other_shapes",
    "probe_difference",
    "reference_spread",
    "vllm_spread",
]
