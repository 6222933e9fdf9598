"""The OpenAI-compatible engine: any server's ``/v1/completions`` that takes ``seed``,
``top_k``, ``top_p``, ``min_p`` and ``temperature`` per request (llama-server, llama-cpp-python,
vLLM, SGLang), and a fleet of identical servers sampled as one engine.

The server's model must be the fixture: its ``/v1/models`` entry must name the fixture's
``target.gguf`` (or the fixture's name, as an alias), and every response must be fixture
letters. Anything else is a `DistError`, not a verdict: a test of the wrong model proves
nothing either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Sequence
from pathlib import PurePosixPath
from typing import Any

from specaudit import fixtures
from specaudit.client import AsyncClient, Client, ClientError
from specaudit.distribution.engines import SAMPLER_CHAIN, Engine
from specaudit.distribution.registry import EngineEntry, Register, RunContext, Unit
from specaudit.distribution.request import DistRequest
from specaudit.distribution.results import DistError, Sample, Workload
from specaudit.distribution.truth import encode_text

DEFAULT_CONCURRENCY = 8  # requests in flight per server: OpenAI servers do not say their slots


def fixture_model(url: str, spec: fixtures.FixtureSpec, timeout: float = 10.0) -> str:
    """The id under which the server at `url` serves the fixture (from ``/v1/models``).

    Accepted: an id whose file name is ``target.gguf`` (how llama-server, llama-cpp-python and
    vLLM name a model given by path) or that contains the fixture's name (an alias). When the
    server reports its vocabulary size (llama-server's ``meta.n_vocab``), it must match.
    """
    try:
        with Client(url, timeout=timeout) as c:
            r = c.get("/v1/models")
    except ClientError as e:
        raise DistError(f"{url}: /v1/models: {e}") from None
    data = r.get("data") if isinstance(r, dict) else None
    if not isinstance(data, list) or not data:
        raise DistError(f"{url}: /v1/models lists no model")
    ids: list[str] = []
    for m in data:
        mid = m.get("id") if isinstance(m, dict) else None
        if not isinstance(mid, str):
            continue
        ids.append(mid)
        if PurePosixPath(mid).name == fixtures.TARGET_FILE or spec.name in mid:
            meta = m.get("meta")
            n_vocab = meta.get("n_vocab") if isinstance(meta, dict) else None
            if isinstance(n_vocab, int) and n_vocab != spec.n_vocab:
                raise DistError(
                    f"{url}: model {mid!r} has {n_vocab} tokens, the fixture "
                    f"{spec.name!r} has {spec.n_vocab}: not the fixture"
                )
            return mid
    shown = ", ".join(repr(i) for i in ids[:3]) or "none with an id"
    raise DistError(
        f"{url}: serves {shown}, not the fixture {spec.name!r} (serve its "
        f"{fixtures.TARGET_FILE}, or alias the model {spec.name!r})"
    )


class OpenAIEngine:
    """One OpenAI-compatible server, sampled on ``/v1/completions``, one request per seed.

    Every sampler knob is explicit, the penalties every such server knows are neutral
    (llama-cpp-python's server defaults to ``repeat_penalty`` 1.1), and llama-server's
    ``samplers`` order is sent too (others ignore it).
    """

    def __init__(
        self,
        url: str,
        spec: fixtures.FixtureSpec,
        workload: Workload,
        *,
        label: str | None = None,
        kind: str = "openai",
        concurrency: int | None = None,
        timeout: float = 60.0,
        model: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.spec = spec
        self.workload = workload
        self.label = label or f"openai {self.url}"
        self.kind = kind
        self.concurrency = concurrency or DEFAULT_CONCURRENCY
        self.model = model or fixture_model(self.url, spec, min(timeout, 10.0))
        self._client = AsyncClient(self.url, timeout=timeout, max_connections=self.concurrency)
        s = workload.sampler
        self._body: dict[str, Any] = {
            "model": self.model,
            "prompt": workload.prompt,
            "max_tokens": workload.tokens,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "min_p": s.min_p,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repeat_penalty": 1.0,  # llama-server, llama-cpp-python
            "repetition_penalty": 1.0,  # vLLM, SGLang
            "samplers": list(SAMPLER_CHAIN),  # llama-server
            "stream": False,
        }

    def body(self, seed: int) -> dict[str, Any]:
        """The /v1/completions request for one seed."""
        return {**self._body, "seed": seed}

    async def sample(self, seed: int) -> Sample:
        try:
            r = await self._client.post("/v1/completions", self.body(seed))
        except ClientError as e:
            raise DistError(f"{self.label}: {e}") from None
        choices = r.get("choices") if isinstance(r, dict) else None
        text = choices[0].get("text") if isinstance(choices, list) and choices else None
        if not isinstance(text, str):
            raise DistError(f"{self.label}: /v1/completions answered without choices[0].text")
        bad = sorted({ch for ch in text if ch not in self.spec.letters})
        if bad:
            raise DistError(
                f"{self.label}: seed {seed} answered {text[:40]!r}, with characters that are "
                f"not fixture letters ({''.join(bad)[:20]!r}): the server is not running the "
                f"fixture {self.spec.name!r}"
            )
        tm = r.get("timings")  # llama-server adds its native timings
        tm = tm if isinstance(tm, dict) else {}
        dn, da = tm.get("draft_n"), tm.get("draft_n_accepted")
        return Sample(
            seed,
            encode_text(text, self.workload.tokens, self.spec),
            dn if isinstance(dn, int) else None,
            da if isinstance(da, int) else None,
        )

    async def aclose(self) -> None:
        await self._client.aclose()


class FleetEngine:
    """Several identical engines sampled as one: each seed goes to the member with the fewest
    requests in flight (relative to its concurrency); the driver consumes results in seed
    order, so the result is the same as one engine's for the same seeds."""

    def __init__(self, members: Sequence[Engine], *, label: str | None = None) -> None:
        if not members:
            raise DistError("a fleet needs at least one engine")
        self.members = list(members)
        self.kind = self.members[0].kind
        self.label = label or (
            self.members[0].label
            if len(self.members) == 1
            else f"{self.members[0].label} (+{len(self.members) - 1} more)"
        )
        self.concurrency = sum(m.concurrency for m in self.members)
        self._busy = [0] * len(self.members)
        self.served = [0] * len(self.members)  # samples each member answered

    async def sample(self, seed: int) -> Sample:
        i = min(
            range(len(self.members)),
            key=lambda j: (self._busy[j] / max(1, self.members[j].concurrency), j),
        )
        self._busy[i] += 1
        try:
            s = await self.members[i].sample(seed)
        finally:
            self._busy[i] -= 1
        self.served[i] += 1
        return s

    async def aclose(self) -> None:
        await asyncio.gather(*(m.aclose() for m in self.members), return_exceptions=True)


def fleet(members: Sequence[Engine]) -> Engine:
    """One engine, or a fleet that spreads the seeds over identical servers (`--concurrency`
    is per server)."""
    return members[0] if len(members) == 1 else FleetEngine(list(members))


def url_fleet(make: Callable[..., Engine], req: DistRequest) -> Engine:
    """One engine of kind `make` per `--url` of the request, as one engine (`fleet`): the
    build of every engine that samples running servers."""
    spec, wl = req.fixture.spec, req.workload
    return fleet(
        [make(u, spec, wl, concurrency=req.concurrency, timeout=req.timeout) for u in req.urls]
    )


def _build(req: DistRequest, ctx: RunContext) -> Generator[Unit, None, None]:
    yield Unit(url_fleet(OpenAIEngine, req))


OPENAI = EngineEntry(
    "openai",
    _build,
    help="a running OpenAI-compatible server (--url, /v1/completions)",
    url=True,
)


def register_engines(register: Register) -> None:
    """The registry's hook (`dist.registry.BUILTIN`)."""
    register(OPENAI)


__all__ = [
    "DEFAULT_CONCURRENCY",
    "OPENAI",
    "FleetEngine",
    "OpenAIEngine",
    "fixture_model",
    "fleet",
    "register_engines",
    "url_fleet",
]
