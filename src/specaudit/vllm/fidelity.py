"""Logprob fidelity of a vLLM server: the logprobs its OpenAI completions endpoint returns,
classified token by token against a reference (`specaudit.fidelity`'s four classes). Used by
`dist --engine vllm`; it imports no command (`check`, `rescore`), so none loads another.

Why apart from `fidelity_probe`: vLLM speaks neither llama-server's ``/completion`` nor its
``post_sampling_probs``. What its numbers mean is a server setting, ``--logprobs-mode``:
``raw_logprobs`` (its default) are the model's log-softmax before temperature, top-k and top-p,
compared like llama-server's pre-sampling ``n_probs``; ``processed_logprobs`` are after them
(a token the sampler removed has log(0)), compared like post-sampling probabilities. The mode
of a server someone else started cannot be asked, so `probe` classifies under a given mode
and `best_mode` under both, keeping the one the numbers agree with.

Token ids come from the response itself (``return_token_ids`` for the sampled tokens,
``return_tokens_as_token_ids`` for the candidates: ``"token_id:17"``), so a prefix is never
rebuilt from text.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from specaudit.fidelity import (
    Fidelity,
    FidelityCounts,
    FidelityError,
    FidelityResult,
    NextTokenSource,
    TokenFidelity,
    Tolerance,
    classify,
    count,
    merge,
)
from specaudit.fixtures import SamplerSettings
from specaudit.logprobs import TokenRecord, from_entries
from specaudit.vllm.request import TOKEN_ID_PREFIX, completions_body, token_id

RAW = "raw_logprobs"
PROCESSED = "processed_logprobs"
MODES = (RAW, PROCESSED)
_PREFIX = TOKEN_ID_PREFIX


def request_body(
    model: str,
    prompt_ids: Sequence[int],
    sampler: SamplerSettings,
    seed: int,
    tokens: int,
    n: int,
) -> dict[str, Any]:
    """One sampled completion with the top-`n` logprobs of every generated token, ids for
    tokens and candidates, the sampler as given and nothing else (no penalties, no stop):
    `vllm.request.completions_body`."""
    return completions_body(
        sampler, tokens=tokens, ignore_eos=True, prompt_ids=prompt_ids, model=model, seed=seed,
        logprobs=n,
    )  # fmt: skip


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _prob(lp: float | None) -> float | None:
    return None if lp is None else (0.0 if lp == -math.inf else math.exp(lp))


def records(body: Mapping[str, Any], n: int, mode: str) -> list[TokenRecord]:
    """One record per generated token of a vLLM completions answer, in order, read in `mode`:
    pre-sampling logprobs (raw) or post-sampling probabilities (processed). A token whose
    logprob is null is a missing record, never dropped (later prefixes stay aligned)."""
    if mode not in MODES:
        raise FidelityError(f"unknown vLLM logprobs mode {mode!r} (one of {', '.join(MODES)})")
    choices = body.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        raise FidelityError("the vLLM answer has no choices")
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise FidelityError("the vLLM answer has no choices[0].token_ids (return_token_ids)")
    lp = choice.get("logprobs")
    lp = lp if isinstance(lp, dict) else {}
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    entries: list[dict[str, Any]] = []
    for i, tid in enumerate(ids):
        value = _num(values[i]) if i < len(values) else None
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        cands = [(k, token_id(k), _num(v)) for k, v in top.items()]
        if mode == RAW:
            entries.append({
                "token": f"{_PREFIX}{tid}", "id": tid, "logprob": value,
                "top_logprobs": [{"token": k, "id": c, "logprob": v} for k, c, v in cands],
            })  # fmt: skip
        else:
            entries.append({
                "token": f"{_PREFIX}{tid}", "id": tid, "prob": _prob(value),
                "top_probs": [{"token": k, "id": c, "prob": _prob(v)} for k, c, v in cands],
            })  # fmt: skip
    return from_entries(entries, n)


@dataclass(frozen=True)
class VllmFidelity:
    """Every probed token of one server, classified in one logprobs mode."""

    mode: str
    result: FidelityResult
    requests: int
    refused: tuple[str, ...] = ()  # one line per request the server answered with an error

    @property
    def counts(self) -> FidelityCounts:
        return count(self.result.tokens)

    @property
    def wrong(self) -> list[TokenFidelity]:
        return self.result.wrong()

    def line(self, label: str) -> str:
        """One line for people: the classes, and the worst wrong value when there is one."""
        c = self.counts
        parts = [f"{c.of(k)} {k.value}" for k in Fidelity if c.of(k)]
        text = (
            f"{label} logprobs ({self.mode}, {self.requests} requests, {c.total} tokens, "
            f"against the closed form): {', '.join(parts) or 'nothing compared'}"
        )
        if self.refused:
            text += f"; {len(self.refused)} of {self.requests} requests refused ({self.refused[0]})"
        if self.result.uncompared:
            text += (
                f"; {self.result.uncompared} uncompared (after a token the reference cannot "
                "continue from)"
            )
        worst = max(
            (t.worst for t in self.wrong if t.worst is not None),
            key=lambda d: d.score,
            default=None,
        )
        if worst is not None:
            text += (
                f"; worst: token {worst.token_id} ({worst.where}) reported {_g(worst.reported)}, "
                f"expected {_g(worst.expected)}"
            )
        return text


def _g(x: float | None) -> str:
    return "nothing" if x is None else f"{x:.6g}"


def probe(
    url: str,
    model: str,
    prompt_ids: Sequence[int],
    reference: NextTokenSource,
    tol: Tolerance,
    sampler: SamplerSettings,
    seeds: Iterable[int],
    *,
    tokens: int,
    n: int,
    modes: Sequence[str] = (RAW,),
    timeout: float = 60.0,
    answerable: Callable[[int], bool] | None = None,
    transport: httpx.BaseTransport | None = None,
) -> list[VllmFidelity]:
    """Sample `tokens` tokens per seed with the top-`n` logprobs and classify every token in
    each of `modes` (the same answers read each way). `answerable`: the token ids after which
    the reference can still answer (a fixture's letters); the tokens after one it cannot are
    counted as uncompared. `transport`: the unit tests' seam."""
    answers: list[dict[str, Any]] = []
    refused: list[str] = []
    asked = 0
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout, transport=transport) as c:
        for seed in seeds:
            asked += 1
            body = request_body(model, prompt_ids, sampler, seed, tokens, n)
            r = c.post("/v1/completions", json=body)
            if r.status_code != 200:  # the server's own answer: a finding, not our failure
                why = " ".join(r.text.split())[:200]
                refused.append(f"seed {seed}: HTTP {r.status_code}: {why}")
                continue
            answers.append(r.json())
    if not asked:
        raise FidelityError("no seeds to probe")
    out = []
    for mode in modes:
        results = []
        for a in answers:
            recs, cut = _until_unanswerable(records(a, n, mode), answerable)
            res = classify(recs, prompt_ids, reference, tol)
            results.append(FidelityResult(res.tokens, res.tolerance, res.uncompared + cut))
        merged = merge(results) if results else FidelityResult((), tol)
        out.append(VllmFidelity(mode, merged, asked, tuple(refused)))
    return out


def _until_unanswerable(
    recs: list[TokenRecord], answerable: Callable[[int], bool] | None
) -> tuple[list[TokenRecord], int]:
    """The records up to and with the first token the reference cannot continue after, and
    how many were cut (the token itself is still compared: its own prefix is known)."""
    if answerable is None:
        return recs, 0
    for i, r in enumerate(recs):
        if r.token_id is not None and not answerable(r.token_id):
            return recs[: i + 1], len(recs) - i - 1
    return recs, 0


def best_mode(results: Sequence[VllmFidelity]) -> VllmFidelity:
    """The reading the numbers agree with most (fewest real-but-wrong tokens; the first on a
    tie): for a server whose ``--logprobs-mode`` is not known."""
    if not results:
        raise FidelityError("no fidelity results to choose from")
    return min(results, key=lambda r: r.counts.of(Fidelity.REAL_WRONG))


__all__ = [
    "MODES",
    "PROCESSED",
    "RAW",
    "VllmFidelity",
    "best_mode",
    "probe",
    "records",
    "request_body",
]
