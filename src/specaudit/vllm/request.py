"""The body of one vLLM ``/v1/completions`` request, for every part of specaudit that asks vLLM
(`dist`'s sampler, its logprobs probe, `rescore`'s sampler and its vLLM reference).

Why one builder: what a vLLM request means is decided by the fields it carries, and a field
one copy forgot changes the distribution sampled (a penalty left at vLLM's default, the
folder's generation config) or the answer's shape (ids as text). So the prompt goes as token
ids, every sampler knob is explicit, the penalties are neutral, the generated ids come back
(``return_token_ids``, vLLM 0.10.2 or newer) and so do the candidates' ids when logprobs are
asked (``return_tokens_as_token_ids``: ``"token_id:17"``), so no text is ever re-tokenised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specaudit.fixtures import SamplerSettings

TOKEN_ID_PREFIX = "token_id:"  # a candidate's name under ``return_tokens_as_token_ids``


def completions_body(
    sampler: SamplerSettings,
    *,
    tokens: int,
    ignore_eos: bool,
    prompt_ids: Sequence[int] | None = None,
    model: str | None = None,
    seed: int | None = None,
    logprobs: int | None = None,
) -> dict[str, Any]:
    """A ``/v1/completions`` body: `tokens` tokens under `sampler` (top-k 0 is off, as in
    llama.cpp), penalties neutral, the generated ids returned. `prompt_ids`, `model` and
    `seed` are left out when None (a caller that adds them per request). `logprobs`: the
    top-`logprobs` candidates of every generated token, named by id (-1: the whole
    vocabulary, on a server started with ``--max-logprobs -1``). `ignore_eos`: vLLM keeps
    sampling past an end token (it does not mask it: the end token keeps its probability)."""
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    if prompt_ids is not None:
        body["prompt"] = [int(t) for t in prompt_ids]
    body.update(
        max_tokens=tokens,
        temperature=sampler.temperature,
        top_k=sampler.top_k,
        top_p=sampler.top_p,
        min_p=sampler.min_p,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        return_token_ids=True,
        stream=False,
    )
    if ignore_eos:
        body["ignore_eos"] = True
    if seed is not None:
        body["seed"] = seed
    if logprobs is not None:
        body["logprobs"] = logprobs
        body["return_tokens_as_token_ids"] = True
    return body


def token_id(name: Any) -> int | None:
    """The id of a candidate named ``"token_id:17"`` (`TOKEN_ID_PREFIX`), None otherwise."""
    if isinstance(name, str) and name.startswith(TOKEN_ID_PREFIX):
        try:
            return int(name[len(TOKEN_ID_PREFIX) :])
        except ValueError:
            return None
    return None


__all__ = ["TOKEN_ID_PREFIX", "completions_body", "token_id"]
