"""A plain vLLM server as the reference of a re-scored run: the processed next-token
distribution of one exact token-id prefix, from vLLM's own sampler.

Why vLLM can be a reference: started with ``--logprobs-mode processed_logprobs`` its logprobs
are the log-softmax of the logits *after* temperature, top-k and top-p (a token the sampler
removed comes back as -9999, vLLM's clamp of log 0), so the top-`support` logprobs of one
generated token (``max_tokens`` 1, the prompt as token ids) are the distribution its sampler
draws that token from; ``--max-logprobs -1`` lets it return as many candidates as the support
has. Measured on the last-token fixture: within 3e-8 of the closed form at T = 1 and 0.7.
The raw logprobs (the edge rule's, the noise floor's) are the same server asked with nothing
to process (temperature 1, top-k off, top-p 1, min-p 0): there the processed numbers are the
raw ones.

What it cannot do that llama-server does, and what stands in (`shapes`): vLLM has no slot
to pin and no ``cache_prompt`` switch, and its prefix cache keeps whole KV blocks only, so the
exact "last k tokens as one batch on a cached prefix" shapes cannot be asked for. Instead: the
prefix asked alone with a fresh ``cache_salt`` (no cached block reused), four identical
requests at once (one batch), the prefix batched with its own shorter prefixes (sequences of
several lengths in one step), and the prefix again after those (whatever whole blocks of it
vLLM cached are reused, the rest computed on top). Whether it speculates is read from
``/metrics`` (vLLM registers its ``spec_decode`` counters only when it does), not ``/slots``.

Transport only, like `specaudit.reference`: the rules about what a disagreement means are
`rescore.spread`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from specaudit import speculation
from specaudit.client import ClientError
from specaudit.fixtures import SamplerSettings
from specaudit.reference import (
    COVERAGE,
    ModelIdentity,
    NextToken,
    PrefixQuestions,
    ReferenceUnusable,
    support_size,
)
from specaudit.vllm.request import completions_body, token_id

# nothing to process: vLLM's processed logprobs are then its raw ones
NEUTRAL = SamplerSettings(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)
LOG_ZERO = -9999.0  # vLLM's clamp of a removed token's log 0
SHAPES = (1, 2, 4, 8, 16)  # shorter prefixes batched with the asked one (`shapes`)
COPIES = 4  # identical requests asked at once (`concurrent`)
_SALTS = itertools.count()
MAX_MODEL_LEN = 2048  # the started reference's context: a prompt and up to 512 tokens
STARTUP_TIMEOUT = 900.0  # a vLLM start on a busy 2-core machine (docs/vllm.md: 1.5-6.5 min)


def parse_top(body: Any) -> dict[int, float]:
    """token id -> logprob of the first generated token's candidates in a vLLM completions
    answer (``return_tokens_as_token_ids``); a one-line ReferenceUnusable when it has none."""
    try:
        top = body["choices"][0]["logprobs"]["top_logprobs"][0]
        out = {token_id(k): float(v) for k, v in top.items()}
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise ReferenceUnusable(
            "the vLLM reference answered without top_logprobs (is it a vLLM server?)"
        ) from None
    if None in out:
        raise ReferenceUnusable(
            "the vLLM reference named its candidates by text, not token id "
            "(return_tokens_as_token_ids: vLLM 0.10 or newer)"
        )
    return {int(t): v for t, v in out.items() if t is not None}


def processed_probs(logprobs: dict[int, float]) -> dict[int, float]:
    """The processed distribution from processed logprobs: the tokens the sampler kept (a
    removed token has vLLM's -9999, or -inf), as probabilities."""
    return {t: math.exp(v) for t, v in logprobs.items() if math.isfinite(v) and v > LOG_ZERO}


class VllmReference(PrefixQuestions):
    """An async client of a plain vLLM server serving the reference model: the interface
    rescore's runner asks a reference through (`specaudit.reference.Reference`'s), on
    vLLM's ``/v1/completions``.

    Answers are cached by prefix and a question in flight is not asked twice
    (`PrefixQuestions`). `raw_probs` > 0 adds the raw top log-probabilities to each answer."""

    def __init__(
        self,
        url: str,
        sampler: SamplerSettings,
        *,
        timeout: float = 60.0,
        concurrency: int = 4,
        raw_probs: int = 0,
        model: str | None = None,
    ) -> None:
        super().__init__(
            url, sampler, timeout=timeout, concurrency=concurrency, raw_probs=raw_probs,
            extra_connections=COPIES,
        )  # fmt: skip
        self.model = model

    async def prepare(self) -> ModelIdentity:
        """Refuse a server that is not vLLM, serves several models, speculates, cannot return
        the whole vocabulary (``--max-logprobs -1``) or reports raw logprobs; size the requests
        to the sampler's support. Returns the identity vLLM can give: its vocabulary."""
        try:
            models = await self._client.get("/v1/models")
            metrics = await self._client.get_text("/metrics")
        except ClientError as e:
            raise ReferenceUnusable(f"cannot reach the vLLM reference: {e}") from None
        data = models.get("data") if isinstance(models, dict) else None
        ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if len(ids) != 1 or not isinstance(ids[0], str):
            raise ReferenceUnusable(
                f"the vLLM reference {self.url} serves {len(ids)} models (one expected)"
            )
        self.model = self.model or ids[0]
        reading = speculation.parse_metrics(metrics)
        if reading.engine != "vLLM":
            raise ReferenceUnusable(f"the reference {self.url} is not a vLLM server (/metrics)")
        if reading.speculates:
            raise ReferenceUnusable(
                f"the vLLM reference {self.url} speculates (its /metrics has speculative-"
                "decoding counters); serve the same model without --speculative-config"
            )
        probe = [0]  # any one-token prompt: only the number of candidates matters
        whole = await self._top(probe, NEUTRAL, -1, "the vocabulary")
        self.n_vocab = len(whole)
        # processed, not raw: at top-k 1 a processed answer gives every other token log 0
        top1 = await self._top(probe, SamplerSettings(top_k=1, temperature=1.0), 2, "the mode")
        if len(processed_probs(top1)) != 1:
            raise ReferenceUnusable(
                f"the vLLM reference {self.url} reports raw logprobs: start it with "
                "--logprobs-mode processed_logprobs (its logprobs must be what it samples from)"
            )
        self._n_probs = support_size(self.sampler, self.n_vocab)
        return ModelIdentity(self.n_vocab, None, None, None, None, None)

    async def _post(self, body: dict[str, Any], what: str) -> Any:
        try:
            ans = await self._client.post("/v1/completions", body)
        except ClientError as e:
            hint = " (start it with --max-logprobs -1)" if "logprobs" in str(e) else ""
            raise ReferenceUnusable(f"the vLLM reference ({what}): {e}{hint}") from None
        self.requests += 1
        return ans

    async def _top(
        self, ids: Sequence[int], sampler: SamplerSettings, n: int, what: str, salt: str = ""
    ) -> dict[int, float]:
        if self.n_vocab is not None and n > self.n_vocab:
            n = self.n_vocab  # vLLM refuses more candidates than its vocabulary
        body = completions_body(
            sampler, tokens=1, ignore_eos=True, prompt_ids=ids, model=self.model, seed=0,
            logprobs=n,
        )  # fmt: skip
        if salt:
            body["cache_salt"] = salt
        return parse_top(await self._post(body, what))

    async def answer(self, ids: Sequence[int], raw_probs: int, salt: str = "") -> NextToken:
        """One uncached answer: the processed distribution over the support and the raw
        top-`raw_probs` log-probabilities (none for 0); `salt` keys vLLM's prefix cache."""
        lp = await self._top(ids, self.sampler, self._n_probs, "next token", salt)
        raw = await self._top(ids, NEUTRAL, raw_probs, "raw", salt) if raw_probs else {}
        probs = processed_probs(lp)
        total = sum(probs.values())
        if total < COVERAGE:
            raise ReferenceUnusable(
                f"the vLLM reference's distribution sums to {total:.6f} over the {len(probs)} "
                "candidates it returned: it does not cover the sampler's support"
            )
        return NextToken(probs=probs, logprobs=raw)

    async def raw(self, ids: Sequence[int], n: int) -> dict[int, float]:
        """The raw (pre-sampling) top-`n` log-probabilities after `ids`."""
        async with self._sem:
            return await self._top(ids, NEUTRAL, n, "raw")

    async def tokenize(self, text: str) -> list[int]:
        """vLLM's token ids of `text`, special tokens added as for a text prompt."""
        body = await self._client.post(
            "/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": True}
        )
        try:
            return [int(t) for t in body["tokens"]]
        except (KeyError, TypeError, ValueError):
            raise ReferenceUnusable(
                "the vLLM reference's /tokenize answered without tokens"
            ) from None

    async def detokenize(self, ids: Sequence[int]) -> str:
        body = await self._client.post("/detokenize", {"model": self.model, "tokens": list(ids)})
        try:
            return str(body["prompt"])
        except (KeyError, TypeError):
            raise ReferenceUnusable(
                "the vLLM reference's /detokenize answered without its text"
            ) from None

    async def _ask(self, key: tuple[int, ...]) -> NextToken:
        async with self._sem:
            nt = await self.answer(list(key), self.raw_probs)
        self._cache[key] = nt
        return nt

    async def generate(self, ids: Sequence[int], tokens: int) -> list[int]:
        """The reference's own `tokens`-token continuation of `ids` (seed 0, the run's
        sampler): the noise floor's longer prefix."""
        body = completions_body(
            self.sampler, tokens=tokens, ignore_eos=True, prompt_ids=ids, model=self.model, seed=0
        )
        ans = await self._post(body, "generate")
        try:
            return [int(t) for t in ans["choices"][0]["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise ReferenceUnusable(
                "the vLLM reference answered without choices[0].token_ids (vLLM 0.10.2 or newer)"
            ) from None

    async def concurrent(
        self, ids: Sequence[int], raw_probs: int, copies: int = COPIES
    ) -> list[NextToken]:
        """`copies` identical requests at once, each with its own ``cache_salt`` (no cached
        block reused): vLLM batches them into one step."""
        salts = [f"specaudit-{next(_SALTS)}" for _ in range(copies)]
        return list(await asyncio.gather(*(self.answer(ids, raw_probs, s) for s in salts)))

    async def shapes(
        self, ids: Sequence[int], raw_probs: int, ks: Sequence[int] = SHAPES
    ) -> list[NextToken]:
        """The prefix in the batch shapes vLLM lets a client cause (module doc): batched with
        its shorter prefixes ``ids[:-k]`` (k in `ks`), then asked again on what that left in
        the prefix cache. Two answers (none for a prefix of one token)."""
        shorter = [list(ids[:-k]) for k in ks if len(ids) > k]
        if not shorter:
            return []
        salt = f"specaudit-{next(_SALTS)}"
        warm = [self._top(p, NEUTRAL, 1, "batch shape", salt) for p in shorter]
        mixed, *_ = await asyncio.gather(self.answer(ids, raw_probs, salt), *warm)
        assert isinstance(mixed, NextToken)
        return [mixed, await self.answer(ids, raw_probs, salt)]


def model_len(model: Path, cap: int = MAX_MODEL_LEN) -> int:
    """The context a started reference is given: the model's own (``max_position_embeddings``
    in its config.json, or its ``text_config``'s), at most `cap`."""
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return cap
    for c in (cfg, cfg.get("text_config") if isinstance(cfg, dict) else None):
        n = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(n, int) and n > 0:
            return min(n, cap)
    return cap


@contextlib.contextmanager
def start_vllm_reference(
    model: Path, *, threads: int = 1, log_path: Path | None = None
) -> Iterator[str]:
    """A plain vLLM server (no ``--speculative-config``) on the Hugging Face folder `model`,
    from specaudit's vLLM env, reporting processed logprobs of the whole vocabulary
    (``--logprobs-mode processed_logprobs --max-logprobs -1``): yields its URL and always
    stops it."""
    from specaudit.vllm.env import ensure_env
    from specaudit.vllm.server import VllmServer

    if not (model / "config.json").is_file():
        raise ReferenceUnusable(f"--reference-vllm {model} is not a Hugging Face model folder")
    with VllmServer(
        ensure_env(), model, max_logprobs=-1, logprobs_mode="processed_logprobs",
        max_model_len=model_len(model), threads=threads, eager=True, log_path=log_path,
        startup_timeout=STARTUP_TIMEOUT,
    ) as srv:  # fmt: skip
        yield srv.url


__all__ = [
    "start_vllm_reference",
    "model_len",
    "COPIES",
    "LOG_ZERO",
    "NEUTRAL",
    "SHAPES",
    "VllmReference",
    "parse_top",
    "processed_probs",
]
