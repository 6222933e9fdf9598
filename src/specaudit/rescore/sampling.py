"""Drawing samples from the engine under test, as token ids.

Why token ids: the reference is asked about the exact prefix the engine sampled from, so the
prefix must never be re-derived from text unless the text provably round-trips. A
llama-server (any of its verification paths) takes the prompt as ids and returns the
generated ids (``return_tokens``); so does vLLM's ``/v1/completions`` (the prompt as ids,
``return_token_ids``); another OpenAI-compatible server returns text, which is turned into ids
by the reference's tokenizer and refused unless it round-trips exactly.

Both engine and reference are asked with ``ignore_eos``: a generation that stops early would
drop the draw of the end token and bias what is tested, so end tokens are masked on both sides
(the same processed distribution, just without them).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from specaudit.client import AsyncClient, ClientError
from specaudit.fixtures import SamplerSettings
from specaudit.reference import COVERAGE, NextToken, sampling_fields
from specaudit.rescore.flags import DraftFlag, align, parse_flags
from specaudit.rescore.records import RescoreError
from specaudit.speculation import VLLM_ACCEPTED, VLLM_DRAFTED, prometheus_counters
from specaudit.vllm.request import completions_body


@dataclass(frozen=True)
class SeededGeneration:
    """One seed's generation: the generated token ids and the engine's draft counts (None
    where it reports none)."""

    seed: int
    prompt: int
    ids: tuple[int, ...]
    drafted: int | None = None
    accepted: int | None = None
    # the engine's own post-sampling distribution per token (`ServerSampler(report_probs=)`):
    # None where it reported none that covers the sampler's support (a placeholder)
    reported: tuple[NextToken | None, ...] = ()
    # per token, what the engine's flags say its speculative loop did (`rescore.flags`): ()
    # for an engine that does not flag
    flags: tuple[DraftFlag | None, ...] = ()


class Sampler(Protocol):
    """An engine under test: one seeded generation per call. An engine that counts its drafts
    only for the whole run (vLLM's /metrics) may also carry ``run_counts``: (drafted,
    accepted) over its samples, known once it is closed (`VllmSampler`)."""

    label: str

    async def sample(
        self, prompt: int, prompt_ids: Sequence[int], seed: int
    ) -> SeededGeneration: ...

    async def aclose(self) -> None: ...


def _int(x: Any) -> int | None:
    return int(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


class ServerSampler:
    """A llama-server's native ``/completion``, prompt as token ids, ids back."""

    def __init__(
        self,
        url: str,
        sampler: SamplerSettings,
        tokens: int,
        *,
        label: str | None = None,
        timeout: float = 60.0,
        concurrency: int = 4,
        report_probs: int = 0,
    ) -> None:
        self.url = url.rstrip("/")
        self.label = label or self.url
        self.tokens = tokens
        self._client = AsyncClient(self.url, timeout=timeout, max_connections=concurrency)
        self._body: dict[str, Any] = {
            "n_predict": tokens,
            **sampling_fields(sampler),
            "return_tokens": True,
            "cache_prompt": False,
        }
        # n_probs: the engine's own processed distribution per token (`report_probs`, for
        # --self), and at least one entry per token, where a build that flags its speculated
        # tokens puts the flags (`rescore.flags`); post-sampling: the sampler's few candidates,
        # not a sort of the whole vocabulary
        self.report_probs = report_probs
        self._body.update(n_probs=max(1, report_probs), post_sampling_probs=True)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def sample(self, prompt: int, prompt_ids: Sequence[int], seed: int) -> SeededGeneration:
        body = await self._client.post(
            "/completion", {**self._body, "prompt": list(prompt_ids), "seed": seed}
        )
        try:
            ids = tuple(int(t) for t in body["tokens"])
        except (KeyError, TypeError, ValueError):
            raise RescoreError(
                f"{self.label} returned no token ids (return_tokens): use --engine openai for a "
                "server that only returns text"
            ) from None
        if len(ids) != self.tokens:
            raise RescoreError(
                f"{self.label} returned {len(ids)} tokens for seed {seed}, asked for {self.tokens}"
            )
        t = body.get("timings") if isinstance(body, dict) else None
        t = t if isinstance(t, dict) else {}
        entries = body.get("completion_probabilities") if isinstance(body, dict) else None
        entries = entries if isinstance(entries, list) else []
        reported = _reported(entries, ids) if self.report_probs else ()
        return SeededGeneration(
            seed, prompt, ids, _int(t.get("draft_n")), _int(t.get("draft_n_accepted")), reported,
            flags=parse_flags(entries, ids),
        )  # fmt: skip


def _reported(entries: Sequence[object], ids: Sequence[int]) -> tuple[NextToken | None, ...]:
    """Each token's reported post-sampling distribution (None: none, or not covering the
    sampler's support: what a placeholder is), its entry found by id (`flags.align`)."""
    out: list[NextToken | None] = []
    for e in align(entries, ids):
        probs: dict[int, float] = {}
        top: Any = e.get("top_probs") if e is not None else None
        try:
            for c in top if isinstance(top, list) else ():
                probs[int(c["id"])] = float(c["prob"])
        except (KeyError, TypeError, ValueError):
            probs = {}
        out.append(NextToken(probs=probs) if sum(probs.values()) >= COVERAGE else None)
    return tuple(out)


class Tokenizer(Protocol):
    async def tokenize(self, text: str) -> list[int]: ...

    async def detokenize(self, ids: Sequence[int]) -> str: ...


class OpenAISampler:
    """An OpenAI-compatible ``/v1/completions`` that returns text only (llama-cpp-python, a
    hosted API): the prompt is sent as the text that its ids detokenize to, and the completion
    is turned into ids by the reference's tokenizer, refused unless both round-trip exactly."""

    def __init__(
        self,
        url: str,
        sampler: SamplerSettings,
        tokens: int,
        tokenizer: Tokenizer,
        *,
        model: str = "model",
        label: str | None = None,
        timeout: float = 60.0,
        concurrency: int = 4,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.label = label or self.url
        self.tokens = tokens
        self.tokenizer = tokenizer
        self._client = AsyncClient(
            self.url, timeout=timeout, max_connections=concurrency, api_key=api_key
        )
        self._body: dict[str, Any] = {
            "model": model,
            "max_tokens": tokens,
            **sampling_fields(sampler),  # "samplers": llama-server's chain
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repeat_penalty": 1.0,  # llama-server, llama-cpp-python
            "repetition_penalty": 1.0,  # vLLM, SGLang
        }
        self._texts: dict[int, str] = {}

    async def aclose(self) -> None:
        await self._client.aclose()

    async def sample(self, prompt: int, prompt_ids: Sequence[int], seed: int) -> SeededGeneration:
        text = self._texts.get(prompt)
        if text is None:
            text = await self.tokenizer.detokenize(prompt_ids)
            self._texts[prompt] = text
        try:
            body = await self._client.post(
                "/v1/completions", {**self._body, "prompt": text, "seed": seed}
            )
            completion = str(body["choices"][0]["text"])
        except (KeyError, IndexError, TypeError):
            raise RescoreError(f"{self.label} answered without choices[0].text") from None
        except ClientError:
            raise
        ids = await self.tokenizer.tokenize(text + completion)
        n = len(prompt_ids)
        gen = tuple(ids[n:])
        if (
            tuple(ids[:n]) != tuple(prompt_ids)
            or len(gen) != self.tokens
            or await self.tokenizer.detokenize(gen) != completion
        ):
            raise RescoreError(
                f"{self.label}'s completion for seed {seed} does not round-trip through the "
                f"reference's tokenizer exactly ({len(gen)} tokens for {self.tokens} generated): "
                "its token ids cannot be recovered from text; use an engine that returns ids"
            )
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict) and _int(usage.get("completion_tokens")) not in (
            None,
            self.tokens,
        ):
            raise RescoreError(
                f"{self.label} says it generated {usage.get('completion_tokens')} tokens for "
                f"seed {seed}; the text re-tokenises to {self.tokens}: not round-trip exact"
            )
        return SeededGeneration(seed, prompt, gen)


class VllmSampler:
    """vLLM's ``/v1/completions``: the prompt as token ids, the generated ids back
    (``return_token_ids``), so no text is re-tokenised. vLLM applies temperature before
    top-k/top-p and min-p (`distribution.vllm.differs`): settings where that changes the
    distribution are refused before the run (`request.make_request`).

    Drafts: vLLM counts them only per process (``vllm:spec_decode_*`` on /metrics), so the
    counters are read before the first sample and when the sampler closes; their growth is the
    run's (`run_counts`), exact when nothing else uses the server meanwhile. Requests overlap
    (vLLM batches them), as a production server's do."""

    def __init__(
        self,
        url: str,
        sampler: SamplerSettings,
        tokens: int,
        *,
        model: str | None = None,
        label: str | None = None,
        timeout: float = 60.0,
        concurrency: int = 4,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.label = label or self.url
        self.tokens = tokens
        self.model = model
        self._client = AsyncClient(
            self.url, timeout=timeout, max_connections=concurrency, api_key=api_key
        )
        # the model is added per request (`_model`: the one the server serves unless given)
        self.sampler = sampler
        self._body = completions_body(sampler, tokens=tokens, ignore_eos=True)
        self._start: asyncio.Future[dict[str, float]] | None = None
        self._closed = False
        self.run_counts: tuple[int, int] | None = None

    async def _counters(self) -> dict[str, float]:
        try:
            return prometheus_counters(
                await self._client.get_text("/metrics"), (VLLM_DRAFTED, VLLM_ACCEPTED)
            )
        except ClientError:
            return {}  # no /metrics: no counts, never a failed run

    async def _model(self) -> str:
        if self.model is None:
            body = await self._client.get("/v1/models")
            try:
                self.model = str(body["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise RescoreError(f"{self.label}: /v1/models names no model") from None
        return self.model

    async def top_logprobs(self, ids: Sequence[int], k: int) -> dict[int, float]:
        """One token after `ids` at this sampler's settings: its top-`k` logprobs by token id
        (as the server's ``--logprobs-mode`` reports them)."""
        body = await self._client.post(
            "/v1/completions",
            completions_body(
                self.sampler, tokens=1, ignore_eos=True, prompt_ids=ids,
                model=await self._model(), seed=0, logprobs=k,
            ),
        )  # fmt: skip
        try:
            top = body["choices"][0]["logprobs"]["top_logprobs"][0]
            return {int(str(t).removeprefix("token_id:")): float(v) for t, v in top.items()}
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise RescoreError(f"{self.label} answered without top_logprobs") from None

    async def sample(self, prompt: int, prompt_ids: Sequence[int], seed: int) -> SeededGeneration:
        if self._start is None:  # the first caller reads the counters; the rest wait for it
            self._start = asyncio.ensure_future(self._counters())
        await asyncio.shield(self._start)
        body = await self._client.post(
            "/v1/completions",
            {**self._body, "model": await self._model(), "prompt": list(prompt_ids), "seed": seed},
        )
        try:
            ids = tuple(int(t) for t in body["choices"][0]["token_ids"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise RescoreError(
                f"{self.label} answered without choices[0].token_ids (return_token_ids: vLLM "
                "0.10.2 or newer)"
            ) from None
        if len(ids) != self.tokens:
            raise RescoreError(
                f"{self.label} returned {len(ids)} tokens for seed {seed}, asked for {self.tokens}"
            )
        return SeededGeneration(seed, prompt, ids)

    async def aclose(self) -> None:
        if self._closed:  # the runner may close an engine twice
            return
        self._closed = True
        try:
            if self._start is not None:
                before = await self._start
                after = await self._counters()
                if VLLM_DRAFTED in after:
                    self.run_counts = (
                        round(after[VLLM_DRAFTED] - before.get(VLLM_DRAFTED, 0.0)),
                        round(after.get(VLLM_ACCEPTED, 0.0) - before.get(VLLM_ACCEPTED, 0.0)),
                    )
        finally:
            await self._client.aclose()


# the most candidates the same-model probe asks vLLM for: its default --max-logprobs
VLLM_PROBE_TOP = 20


async def vllm_top(
    url: str, ids: Sequence[int], k: int, *, model: str | None = None, timeout: float = 60.0
) -> dict[int, float]:
    """vLLM's next-token distribution after `ids` at top-k `k`, temperature 1: its `k` most
    likely tokens' logprobs, asked with every sampler stage off (temperature 1, top-k 0, top-p
    1, min-p 0) and renormalised here. With nothing to process, vLLM's raw and processed
    logprobs are the same numbers, so the answer does not depend on the server's
    ``--logprobs-mode``; and a request without top-k never enters the top-k path that crashes
    a stock speculating vLLM 0.32 CPU server (docs/vllm.md), so the same-model probe cannot
    kill the server it probes."""
    s = VllmSampler(url, SamplerSettings(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0), 1,
                    model=model, timeout=timeout, concurrency=1)  # fmt: skip
    try:
        lps = await s.top_logprobs(ids, k)
    finally:
        await s.aclose()
    kept = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
    exp = {t: math.exp(v) for t, v in kept if math.isfinite(v)}
    total = sum(exp.values())
    if total <= 0.0:
        raise RescoreError(f"{s.label} gave no finite logprob after the prompt")
    return {t: v / total for t, v in exp.items()}


__all__ = [
    "VLLM_PROBE_TOP",
    "OpenAISampler",
    "Sampler",
    "SeededGeneration",
    "ServerSampler",
    "Tokenizer",
    "VllmSampler",
    "vllm_top",
]
