"""The reference: the same model file served without speculation, asked for the processed
next-token distribution of one exact token-id prefix.

Why a plain llama-server: its post-sampling candidates (``n_probs`` with
``post_sampling_probs``) are exactly the distribution its sampler chain draws the next token
from, for a prompt given as token ids (no re-tokenisation), one forward pass per prefix
(``n_predict: 1``, prompt cache on). The engine under test cannot influence it: it is another
process, refused when it speculates (``/slots``) or serves another model (``/v1/models``
metadata and a probe prompt's distribution).

Transport only: what the answers mean lives with their readers, the PIT values and tests in
`specaudit.rescore`, the fidelity classes in `specaudit.fidelity`. Both import this module;
it imports neither, so `check --reference` does not load the re-scored run and `rescore` does
not load `check`.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, Protocol, Self, TypeVar, runtime_checkable

from specaudit import speculation
from specaudit.client import AsyncClient, Client, ClientError
from specaudit.distribution.engines import SAMPLER_CHAIN
from specaudit.errors import SpecauditError
from specaudit.fixtures import SamplerSettings
from specaudit.llama.build import LlamaBinaries, ensure
from specaudit.llama.server import LlamaServer

# The most candidates a reference is asked for: with top-k 0 (no top-k) on a 262k vocabulary
# the support is the whole vocabulary, which no reference returns per token.
MAX_SUPPORT = 1024
# A processed distribution that sums to less than this does not cover the sampler's support.
COVERAGE = 1.0 - 1e-4
# Seeds a one-token question is asked with while its draw is held back (`held_back`).
DRAW_SEEDS = 16


class ReferenceUnusable(SpecauditError):
    """The reference cannot be used or cannot answer (one line, exit 2): unreachable, it
    speculates, it is not a llama-server, or it cannot cover the sampler's support."""


@dataclass(frozen=True)
class NextToken:
    """The reference's answer for one prefix.

    `probs`: the processed (post-sampling) next-token distribution, token id -> probability,
    over the whole support of the sampler (it sums to 1 up to rounding; a reference that cannot
    cover the support is refused before this is built). `logprobs`: the raw (pre-sampling)
    top-n log-probabilities, when asked for (empty otherwise).
    """

    probs: Mapping[int, float]
    logprobs: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelIdentity:
    """What a llama-server says about the model it serves (``/v1/models`` ``meta``)."""

    n_vocab: int | None
    n_params: int | None
    size: int | None
    n_ctx_train: int | None
    n_embd: int | None
    vocab_type: int | None
    ftype: Any = None

    def differences(self, other: ModelIdentity) -> list[str]:
        """The fields both report and that differ, as ``name a != b``."""
        out = []
        for name in ("n_vocab", "n_params", "size", "n_ctx_train", "n_embd", "vocab_type"):
            a, b = getattr(self, name), getattr(other, name)
            if a is not None and b is not None and a != b:
                out.append(f"{name} {a} != {b}")
        return out


def identity_from_models(body: Any) -> ModelIdentity | None:
    """The first model's ``meta`` of a ``/v1/models`` answer (None: not a llama-server)."""
    try:
        meta = body["data"][0]["meta"]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(meta, dict):
        return None

    def num(k: str) -> int | None:
        v = meta.get(k)
        return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    return ModelIdentity(
        n_vocab=num("n_vocab"),
        n_params=num("n_params"),
        size=num("size"),
        n_ctx_train=num("n_ctx_train"),
        n_embd=num("n_embd"),
        vocab_type=num("vocab_type"),
        ftype=meta.get("ftype"),
    )


def support_size(sampler: SamplerSettings, n_vocab: int | None) -> int:
    """How many candidates the reference must return to cover the sampler's support, or a
    one-line ReferenceUnusable when no reference can (top-k 0 on a large vocabulary)."""
    k = sampler.top_k
    if sampler.temperature <= 0:
        return 1  # greedy: the argmax alone
    if k <= 0 or (n_vocab is not None and k >= n_vocab):
        if n_vocab is not None and n_vocab <= MAX_SUPPORT:
            return n_vocab
        vocab = f"a {n_vocab}-token vocabulary" if n_vocab else "an unknown vocabulary"
        raise ReferenceUnusable(
            f"top-k {k} on {vocab}: the sampler's support is the whole vocabulary, more than "
            f"the {MAX_SUPPORT} probabilities a reference returns per token; use top-k "
            f"between 1 and {MAX_SUPPORT}"
        )
    if k > MAX_SUPPORT:
        raise ReferenceUnusable(
            f"top-k {k} is more than the {MAX_SUPPORT} probabilities a reference returns per "
            f"token: the reported distribution cannot cover the sampler's support"
        )
    return k


def sampling_fields(sampler: SamplerSettings | Mapping[str, float | int]) -> dict[str, Any]:
    """The request fields that fix the processed next-token distribution, for the reference and
    the engine under test alike: the sampler chain (top-k, top-p, min-p, temperature, in
    llama.cpp's order), its settings, and end-of-generation tokens masked (``ignore_eos``).

    Why ``ignore_eos`` on both sides: it removes the end tokens from the post-sampling
    distribution (their logit becomes -inf), so a side asked without it puts the EOS token's mass
    back and every other probability moves by that much; raw (pre-sampling) logprobs are the
    logits' softmax and do not change. `sampler` is a `SamplerSettings` or its
    ``request_fields()``."""
    fields = sampler.request_fields() if isinstance(sampler, SamplerSettings) else dict(sampler)
    return {"samplers": list(SAMPLER_CHAIN), **fields, "ignore_eos": True}


def completion_body(
    ids: Sequence[int],
    sampler: SamplerSettings | Mapping[str, float | int],
    n_probs: int,
    *,
    post: bool = True,
    cache_prompt: bool = True,
) -> dict[str, Any]:
    """The ``/completion`` request for the next-token distribution after exactly `ids`: one
    token, `n_probs` candidates, post-sampling (the processed distribution) or raw
    (``post=False``: the logits' top-`n_probs` log-softmax). ``cache_prompt=False`` evaluates
    the whole prefix as one batch."""
    return {
        "prompt": list(ids),
        "n_predict": 1,
        "n_probs": n_probs,
        "post_sampling_probs": post,
        **sampling_fields(sampler),
        "seed": 0,
        "cache_prompt": cache_prompt,
    }


def ask_next_token(
    url: str,
    ids: Sequence[int],
    sampler: SamplerSettings | Mapping[str, float | int],
    n_probs: int,
    *,
    raw_probs: int | None = None,
    cache_prompt: bool = True,
    timeout: float = 120.0,
) -> NextToken:
    """A plain llama-server's answer for one prefix (`completion_body`, asked twice): the
    processed distribution over `n_probs` candidates (must cover the sampler's support) and the
    raw top-`raw_probs` log-probabilities (default `n_probs`)."""
    post_body = completion_body(ids, sampler, n_probs, cache_prompt=cache_prompt)
    raw_n = n_probs if raw_probs is None else raw_probs
    raw_body = completion_body(ids, sampler, raw_n, post=False, cache_prompt=cache_prompt)
    with Client(url, timeout=timeout) as c:
        post = read_next_token(c, post_body, post=True)
        raw = read_next_token(c, raw_body, post=False)
    return NextToken(probs=post, logprobs=raw)


def parse_next_token(body: Any, *, post: bool) -> dict[int, float]:
    """token id -> probability (post) or log-probability (raw) of the first generated token's
    candidates; a ReferenceUnusable when the answer carries none."""
    if held_back(body):
        raise ReferenceUnusable(
            f"the server drew a token that ends inside a UTF-8 character at this prefix with "
            f"each of {DRAW_SEEDS} seeds, and llama-server reports no probabilities for such a "
            "token"
        )
    try:
        entry = body["completion_probabilities"][0]
        cands = entry["top_probs" if post else "top_logprobs"]
        key = "prob" if post else "logprob"
        out = {int(c["id"]): float(c[key]) for c in cands}
    except (KeyError, IndexError, TypeError, ValueError):
        raise ReferenceUnusable(
            "the reference answered without next-token probabilities (is it a llama-server?)"
        ) from None
    if not out or any(not math.isfinite(v) for v in out.values() if post):
        raise ReferenceUnusable("the reference returned no usable next-token probabilities")
    return out


def held_back(body: Any) -> bool:
    """Whether a one-token answer came without probabilities because its draw was held back:
    llama-server keeps a token whose text ends inside a UTF-8 character (a byte token) until
    the character completes, and records its probabilities only then; at ``n_predict: 1`` it
    never completes, so the answer has none. The distribution does not depend on the draw, so
    another seed's answer is as good (`read_next_token`)."""
    return (
        isinstance(body, dict)
        and not body.get("completion_probabilities")
        and body.get("tokens_predicted") == 1
    )


def read_next_token(c: Client, body: Mapping[str, Any], *, post: bool) -> dict[int, float]:
    """`parse_next_token` of ``/completion`` with `body`, asked with seeds 0, 1, ... while the
    draw is held back (`held_back`), at most `DRAW_SEEDS` times."""
    ans: Any = None
    for seed in range(DRAW_SEEDS):
        ans = c.post("/completion", {**body, "seed": seed})
        if not held_back(ans):
            break
    return parse_next_token(ans, post=post)


async def aread_next_token(
    c: AsyncClient, body: Mapping[str, Any], *, post: bool
) -> tuple[dict[int, float], int]:
    """`read_next_token` on an async client; also returns the requests it made."""
    ans: Any = None
    n = 0
    for seed in range(DRAW_SEEDS):
        ans = await c.post("/completion", {**body, "seed": seed})
        n += 1
        if not held_back(ans):
            break
    return parse_next_token(ans, post=post), n


class SlotGate:
    """Who may talk to one reference server at a time: any number of ordinary questions
    (`shared`), or one caller that pins a slot (``id_slot``, `incremental_answers`) alone
    (`exclusive`, which waits for the questions in flight and holds new ones back).

    Why: llama-server (b11434) runs its prompt-cache update on a pinned slot even while that
    slot is busy, before it defers the pinned request: the busy slot's prompt and KV cells
    are swapped for the cached prompt that best matches the deferred request. The running
    request then aborts the server (``GGML_ASSERT(batch.size() > 0)`` in ``pre_decode``,
    when the swapped-in prompt is as long as its own), hangs (longer), or is answered from
    another prompt's cells (shorter). A pinned request that only ever finds its slot idle
    never triggers it (docs/upstream/llama-server-empty-batch-abort.md)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive callers waiting: new shared holds queue behind them

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            async with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and self._shared == 0)
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            async with self._cond:
                self._exclusive = False
                self._cond.notify_all()


_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, SlotGate]] = (
    weakref.WeakKeyDictionary()
)


def slot_gate(url: str) -> SlotGate:
    """The `SlotGate` of the server at `url` in the running event loop: every `Reference` on
    one server (the reference and a draft served by the same process) shares it."""
    gates = _GATES.setdefault(asyncio.get_running_loop(), {})
    return gates.setdefault(url.rstrip("/"), SlotGate())


_P = ParamSpec("_P")
_T = TypeVar("_T")


async def alone(url: str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` in a worker thread with no other question in flight on the
    server at `url` (`SlotGate.exclusive`): for the synchronous callers that pin a slot
    (`incremental_answers` and the measurements built on it)."""
    async with slot_gate(url).exclusive():
        return await asyncio.to_thread(fn, *args, **kwargs)


class NextTokenSource(Protocol):
    """Anything that answers a prefix's processed next-token distribution: the reference
    (`Reference`), a draft model served as one, a fixture's closed form
    (`rescore.fixture.FixtureDraft`). Re-scoring asks the reference for p and, where the
    draft is known, the draft for q through this one interface."""

    async def next_token(self, ids: Sequence[int]) -> NextToken: ...


@runtime_checkable
class SamplerBoundSource(NextTokenSource, Protocol):
    """A source that answers under given sampler settings and can answer under others (a
    closed form): a run's arm at another temperature asks it `at` the arm's settings."""

    def at(self, sampler: SamplerSettings) -> NextTokenSource: ...


class PrefixQuestions:
    """Next-token answers of a reference server, cached by prefix: every seed's first token
    shares the prompt's prefix, and a question already in flight is not asked twice
    (concurrent seeds reach the same prefixes at once: the prompt, and on a small vocabulary
    most short continuations); at most `concurrency` requests are in flight. Subclasses speak
    a server's API in `_ask` (`Reference`: llama-server; `vllm.reference.VllmReference`)."""

    def __init__(
        self,
        url: str,
        sampler: SamplerSettings,
        *,
        timeout: float,
        concurrency: int,
        raw_probs: int,
        extra_connections: int = 0,
    ) -> None:
        self.url = url.rstrip("/")
        self.sampler = sampler
        self.raw_probs = raw_probs
        self.n_vocab: int | None = None  # the served model's vocabulary, once prepared
        self.requests = 0
        self._client = AsyncClient(
            self.url, timeout=timeout, max_connections=concurrency + extra_connections
        )
        self._sem = asyncio.Semaphore(concurrency)
        self._cache: dict[tuple[int, ...], NextToken] = {}
        self._asking: dict[tuple[int, ...], asyncio.Future[NextToken]] = {}
        self._n_probs = 0  # set by the subclass's prepare()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # questions still in flight are shielded from their callers' cancellation (an
        # interrupted run): end them before the client closes under them, or each would fail
        # unobserved and asyncio would print its traceback at exit
        pending = list(self._asking.values())
        for f in pending:
            f.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._client.aclose()

    async def next_token(self, ids: Sequence[int]) -> NextToken:
        """The processed next-token distribution after `ids` (and the raw top log-probs when
        asked for); a ReferenceUnusable when it does not cover the sampler's support."""
        key = tuple(ids)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if not self._n_probs:
            raise ReferenceUnusable(f"{type(self).__name__}.prepare() must run before next_token()")
        asking = self._asking.get(key)
        if asking is None:
            asking = asyncio.ensure_future(self._ask(key))
            self._asking[key] = asking
            asking.add_done_callback(lambda _: self._asking.pop(key, None))
        # shielded: one caller cancelled (a seed's task torn down) must not cancel the others
        return await asyncio.shield(asking)

    async def _ask(self, key: tuple[int, ...]) -> NextToken:
        raise NotImplementedError


class Reference(PrefixQuestions):
    """An async client of a plain llama-server serving the reference model (`PrefixQuestions`:
    at most `concurrency` requests in flight, the reference's parallel slots)."""

    def __init__(
        self,
        url: str,
        sampler: SamplerSettings,
        *,
        timeout: float = 60.0,
        concurrency: int = 4,
        raw_probs: int = 0,
    ) -> None:
        super().__init__(
            url, sampler, timeout=timeout, concurrency=concurrency, raw_probs=raw_probs
        )

    async def prepare(self) -> ModelIdentity:
        """Refuse a reference that speculates or is not a llama-server; size the requests to
        the sampler's support. Returns the reference's model identity."""
        try:
            info = await speculation.aread(self._client)
        except ClientError as e:
            raise ReferenceUnusable(f"cannot reach the reference: {e}") from None
        if info.slots.total is None:
            raise ReferenceUnusable(
                f"cannot read the reference's /slots ({info.slots.note}): specaudit needs it "
                "to prove the reference does not speculate (start it without --no-slots)"
            )
        if info.speculates:
            raise ReferenceUnusable(
                f"the reference {self.url} speculates (/slots says {info.slots.speculative} of "
                f"{info.slots.total} slots speculate); serve the same model without a draft or "
                "--spec-type"
            )
        try:
            ident = identity_from_models(await self._client.get("/v1/models"))
        except ClientError as e:
            raise ReferenceUnusable(f"cannot read the reference's /v1/models: {e}") from None
        if ident is None:
            raise ReferenceUnusable(
                f"the reference {self.url} is not a llama-server (no model meta)"
            )
        self._n_probs = support_size(self.sampler, ident.n_vocab)
        self.n_vocab = ident.n_vocab
        return ident

    async def raw(self, ids: Sequence[int], n: int) -> dict[int, float]:
        """The raw (pre-sampling) top-`n` log-probabilities after `ids`."""
        async with self._sem, slot_gate(self.url).shared():
            raw, asked = await aread_next_token(
                self._client, completion_body(ids, self.sampler, n, post=False), post=False
            )
            self.requests += asked
        return raw

    async def tokenize(self, text: str) -> list[int]:
        """The reference's token ids of `text` (special tokens parsed, BOS added as the
        server adds it to a text prompt)."""
        body = await self._client.post(
            "/tokenize", {"content": text, "add_special": True, "parse_special": True}
        )
        try:
            return [int(t) for t in body["tokens"]]
        except (KeyError, TypeError, ValueError):
            raise ReferenceUnusable("the reference's /tokenize answered without tokens") from None

    async def detokenize(self, ids: Sequence[int]) -> str:
        body = await self._client.post("/detokenize", {"tokens": list(ids)})
        try:
            return str(body["content"])
        except (KeyError, TypeError):
            raise ReferenceUnusable(
                "the reference's /detokenize answered without content"
            ) from None

    async def _ask(self, key: tuple[int, ...]) -> NextToken:
        ids = list(key)
        async with self._sem, slot_gate(self.url).shared():
            probs, asked = await aread_next_token(
                self._client, completion_body(ids, self.sampler, self._n_probs), post=True
            )
            self.requests += asked
            raw: dict[int, float] = {}
            if self.raw_probs:
                raw, asked = await aread_next_token(
                    self._client,
                    completion_body(ids, self.sampler, self.raw_probs, post=False),
                    post=False,
                )
                self.requests += asked
        total = sum(probs.values())
        if total < COVERAGE:
            raise ReferenceUnusable(
                f"the reference's distribution sums to {total:.6f} over the {len(probs)} "
                f"candidates it returned: it does not cover the sampler's support"
            )
        nt = NextToken(probs=probs, logprobs=raw)
        self._cache[key] = nt
        return nt


class ServerReference:
    """A plain llama-server as a synchronous reference (a `fidelity.NextTokenSource`): for
    each prefix, the processed distribution over the sampler's support (`support` candidates)
    and the raw top-`raw_probs` log-probabilities (`ask_next_token`), cached per prefix.
    Refuses a speculating server like `Reference`."""

    support: int  # candidates asked for: the sampler's support (`support_size`)

    def __init__(
        self, url: str, sampler: SamplerSettings, *, raw_probs: int = 20, timeout: float = 120.0
    ) -> None:
        self.url = url.rstrip("/")
        self.sampler = sampler
        self.raw_probs = raw_probs
        self.timeout = timeout
        self._cache: dict[tuple[int, ...], NextToken] = {}
        self.identity = asyncio.run(self._prepare())

    async def _prepare(self) -> ModelIdentity:
        async with Reference(self.url, self.sampler, timeout=self.timeout) as ref:
            ident = await ref.prepare()
        self.support = support_size(self.sampler, ident.n_vocab)
        return ident

    def next_token(self, ids: Sequence[int]) -> NextToken:
        key = tuple(ids)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        nt = ask_next_token(
            self.url, ids, self.sampler, self.support, raw_probs=self.raw_probs,
            timeout=self.timeout,
        )  # fmt: skip
        if sum(nt.probs.values()) < COVERAGE:
            raise ReferenceUnusable(
                "the reference's distribution does not cover the sampler's support"
            )
        self._cache[key] = nt
        return nt

    def pieces(self, ids: Sequence[int]) -> dict[int, bytes]:
        """token id -> the bytes of its text, for the distinct `ids` (`token_pieces`)."""
        return token_pieces(self.url, ids, timeout=self.timeout)

    def tokenize(self, text: str) -> list[int]:
        with Client(self.url, timeout=self.timeout) as c:
            body = c.post(
                "/tokenize", {"content": text, "add_special": True, "parse_special": True}
            )
        try:
            return [int(t) for t in body["tokens"]]
        except (KeyError, TypeError, ValueError):
            raise ReferenceUnusable("the reference's /tokenize answered without tokens") from None


def token_pieces(url: str, ids: Sequence[int], *, timeout: float = 120.0) -> dict[int, bytes]:
    """token id -> the bytes of its text, from a llama-server's ``/tokenize`` given the ids
    themselves (``with_pieces``: a piece that is not whole UTF-8 comes as its byte values).

    Why: which generated token gets a probability entry depends on where its bytes end inside a
    UTF-8 character (`specaudit.logprobs.held_back`); the reference serves the same model, so
    its vocabulary is the engine's."""
    distinct = sorted(set(int(t) for t in ids))
    if not distinct:
        return {}
    with Client(url, timeout=timeout) as c:
        body = c.post("/tokenize", {"content": distinct, "with_pieces": True})
    try:
        out: dict[int, bytes] = {}
        for t in body["tokens"]:
            piece = t["piece"]
            out[int(t["id"])] = (
                piece.encode("utf-8") if isinstance(piece, str) else bytes(int(b) for b in piece)
            )
    except (KeyError, TypeError, ValueError):
        raise ReferenceUnusable("the reference's /tokenize answered without token pieces") from None
    if set(out) != set(distinct):
        raise ReferenceUnusable("the reference's /tokenize did not return the pieces asked for")
    return out


def incremental_answers(
    url: str,
    ids: Sequence[int],
    sampler: SamplerSettings,
    n_probs: int,
    *,
    raw_probs: int = 20,
    ks: Sequence[int] = (1, 2, 4, 8, 16),
    timeout: float = 120.0,
) -> list[NextToken]:
    """The reference's answers for `ids` when its last k tokens are evaluated as one batch on
    top of a cached prefix (k in `ks`), as a speculating server's verification batch is (up to
    the draft length, 16 by default).

    Why: on a quantised model the logits move with the batch shape (which kernels run, how the
    sums are split); a server that reports exactly what it sampled from still differs from a
    reference that evaluated the prefix in one piece. This spread is part of the noise floor
    the fidelity tolerance and the same-model probe are measured from. Slot 0 is pinned so the
    prefix cache is the one just filled; an async caller that shares the server runs this
    through `alone` (a pinned request must never find its slot busy: `SlotGate`).
    """
    out: list[NextToken] = []
    with Client(url, timeout=timeout) as c:
        for k in ks:
            if len(ids) <= k:
                continue
            warm = {**completion_body(ids[:-k], sampler, 1), "id_slot": 0}
            c.post("/completion", warm)
            post = read_next_token(
                c, {**completion_body(ids, sampler, n_probs), "id_slot": 0}, post=True
            )
            c.post("/completion", warm)
            raw = read_next_token(
                c, {**completion_body(ids, sampler, raw_probs, post=False), "id_slot": 0},
                post=False,
            )  # fmt: skip
            out.append(NextToken(probs=post, logprobs=raw))
    return out


def reference_server(
    model: Path,
    *,
    parallel: int = 4,
    ctx_size: int = 4096,
    threads: int | None = None,
    timeout: float = 120.0,
    binaries: LlamaBinaries | None = None,
) -> LlamaServer:
    """A plain llama-server (no draft, no --spec-type) on `model`, not started, from
    `binaries` (default: the cached b11434 build); `threads` its -t (None: llama-server's
    default)."""
    if not model.is_file():
        raise ReferenceUnusable(f"reference model {model} is not a file")
    return LlamaServer(
        binaries or ensure(),
        model,
        parallel=parallel,
        ctx_size=ctx_size * parallel,
        extra_args=["-t", str(threads)] if threads else [],
        startup_timeout=timeout,
        name="reference",
    )  # fmt: skip


@contextmanager
def start_reference(
    model: Path,
    *,
    parallel: int = 4,
    ctx_size: int = 4096,
    threads: int | None = None,
    timeout: float = 120.0,
) -> Iterator[str]:
    """`reference_server` started: yields its URL and always stops it."""
    with reference_server(
        model, parallel=parallel, ctx_size=ctx_size, threads=threads, timeout=timeout
    ) as srv:
        yield srv.url


__all__ = [
    "COVERAGE",
    "DRAW_SEEDS",
    "MAX_SUPPORT",
    "ModelIdentity",
    "NextToken",
    "NextTokenSource",
    "PrefixQuestions",
    "SamplerBoundSource",
    "Reference",
    "ReferenceUnusable",
    "SlotGate",
    "ServerReference",
    "ask_next_token",
    "alone",
    "aread_next_token",
    "completion_body",
    "held_back",
    "identity_from_models",
    "incremental_answers",
    "parse_next_token",
    "read_next_token",
    "sampling_fields",
    "slot_gate",
    "start_reference",
    "support_size",
    "token_pieces",
]
