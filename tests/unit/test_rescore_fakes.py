"""The re-scored run's refusals and parsing on canned servers (tests/fakes.py, through the
client's transport, no socket): what a real llama-server cannot play (a server without /slots,
one that returns no ids, text that does not round-trip, an answer that does not cover the
support) is one RescoreError line, never a verdict."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from fakes import Answer, Asked, Canned, route_clients
from specaudit import reference as refmod
from specaudit.client import ClientError
from specaudit.fixtures import SamplerSettings
from specaudit.reference import NextToken, ReferenceUnusable
from specaudit.rescore import request, runner, spread
from specaudit.rescore.records import RescoreError
from specaudit.rescore.sampling import OpenAISampler, SeededGeneration, ServerSampler

SAMPLER = SamplerSettings(top_k=3, top_p=1.0, min_p=0.0, temperature=1.0)
META = {"data": [{"id": "m", "meta": {"n_vocab": 11, "n_params": 100, "size": 10}}]}


def _routes(routes: dict[str, Any]) -> Canned:
    """A fixed JSON answer per path; any other path is not supported (HTTP 501)."""

    def handler(asked: Asked) -> Answer:
        if asked.path not in routes:
            return Answer.json({"error": "not supported"}, 501)
        return Answer.json(routes[asked.path])

    return handler


def _prepare(url: str, sampler: SamplerSettings = SAMPLER) -> refmod.ModelIdentity:
    async def go() -> refmod.ModelIdentity:
        async with refmod.Reference(url, sampler) as ref:
            return await ref.prepare()

    return asyncio.run(go())


def test_a_speculating_reference_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    routes = {"/slots": [{"id": 0, "speculative": True}], "/v1/models": META}
    with pytest.raises(ReferenceUnusable, match="speculates"):
        _prepare(route_clients(monkeypatch, _routes(routes)))


def test_a_reference_without_slots_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ReferenceUnusable, match="prove the reference does not speculate"):
        _prepare(route_clients(monkeypatch, _routes({"/v1/models": META})))


def test_a_reference_that_is_not_a_llama_server_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    routes = {"/slots": [{"id": 0, "speculative": False}], "/v1/models": {"data": [{"id": "x"}]}}
    with pytest.raises(ReferenceUnusable, match="not a llama-server"):
        _prepare(route_clients(monkeypatch, _routes(routes)))


def test_top_k_beyond_what_a_reference_returns_is_refused() -> None:
    with pytest.raises(ReferenceUnusable, match="cannot cover the sampler's support"):
        refmod.support_size(SamplerSettings(top_k=5000, temperature=1.0), 262144)
    with pytest.raises(ReferenceUnusable, match="whole vocabulary"):
        refmod.support_size(SamplerSettings(top_k=0, temperature=1.0), 262144)
    assert refmod.support_size(SamplerSettings(top_k=0, temperature=1.0), 11) == 11
    assert refmod.support_size(SamplerSettings(top_k=40, temperature=1.0), 262144) == 40


def test_a_distribution_that_does_not_cover_the_support_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    routes = {
        "/slots": [{"id": 0, "speculative": False}],
        "/v1/models": META,
        "/completion": {
            "completion_probabilities": [
                {"top_probs": [{"id": 1, "prob": 0.6}, {"id": 2, "prob": 0.3}]}
            ]
        },
    }

    url = route_clients(monkeypatch, _routes(routes))

    async def go() -> None:
        async with refmod.Reference(url, SAMPLER) as ref:
            await ref.prepare()
            await ref.next_token([1, 2])

    with pytest.raises(ReferenceUnusable, match="does not cover the sampler's support"):
        asyncio.run(go())


def test_concurrent_identical_questions_reach_the_reference_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seeds that reach the same prefix at the same time share one request; another prefix is
    its own; a later question is answered from the cache."""
    asked: list[Any] = []
    answer = {
        "completion_probabilities": [
            {
                "top_probs": [
                    {"id": 1, "prob": 0.5},
                    {"id": 2, "prob": 0.3},
                    {"id": 3, "prob": 0.2},
                ]
            }
        ]
    }
    others = _routes({"/slots": [{"id": 0, "speculative": False}], "/v1/models": META})

    def handler(req: Asked) -> Answer:
        if req.path == "/completion":
            asked.append(req.json()["prompt"])
            # the first question stays in flight while the others come
            return Answer.json(answer, delay=0.05)
        return others(req)

    url = route_clients(monkeypatch, handler)

    async def go() -> list[refmod.NextToken]:
        async with refmod.Reference(url, SAMPLER, concurrency=8) as ref:
            await ref.prepare()
            got = await asyncio.gather(*(ref.next_token([4, 5]) for _ in range(6)))
            got.append(await ref.next_token([4, 6]))
            got.append(await ref.next_token([4, 5]))
            return got

    got = asyncio.run(go())
    assert len(asked) == 2 and sorted(map(tuple, asked)) == [(4, 5), (4, 6)]
    assert all(g.probs == {1: 0.5, 2: 0.3, 3: 0.2} for g in got)


def test_an_engine_that_returns_no_token_ids_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    url = route_clients(monkeypatch, _routes({"/completion": {"content": "abc"}}))

    async def go() -> None:
        smp = ServerSampler(url, SAMPLER, 3)
        try:
            await smp.sample(0, [1, 2], 7)
        finally:
            await smp.aclose()

    with pytest.raises(RescoreError, match="no token ids"):
        asyncio.run(go())


class _Tokenizer:
    """Characters are tokens, except that "ab" merges into one: text ending in "a" followed
    by a completion starting with "b" does not round-trip."""

    async def tokenize(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text[i : i + 2] == "ab":
                out.append(1000)
                i += 2
            else:
                out.append(ord(text[i]))
                i += 1
        return out

    async def detokenize(self, ids: Sequence[int]) -> str:
        return "".join("ab" if t == 1000 else chr(t) for t in ids)


def _openai_sample(monkeypatch: pytest.MonkeyPatch, completion: str) -> Any:
    seen: list[dict[str, Any]] = []

    def handler(asked: Asked) -> Answer:
        seen.append(asked.json())
        return Answer.json({"choices": [{"text": completion}]})

    url = route_clients(monkeypatch, handler)

    async def go() -> Any:
        smp = OpenAISampler(url, SAMPLER, 3, _Tokenizer())
        try:
            return await smp.sample(0, [ord("x"), ord("a")], 5)
        finally:
            await smp.aclose()

    return asyncio.run(go()), seen


def test_text_that_round_trips_gives_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    sample, seen = _openai_sample(monkeypatch, "cde")
    assert sample.ids == (ord("c"), ord("d"), ord("e"))
    assert seen[0]["prompt"] == "xa" and seen[0]["seed"] == 5
    assert seen[0]["repeat_penalty"] == 1.0 and seen[0]["top_k"] == 3


def test_text_that_does_not_round_trip_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RescoreError, match="does not round-trip"):
        _openai_sample(monkeypatch, "bcd")


def test_bad_requests_are_one_line_errors() -> None:
    with pytest.raises(RescoreError, match="exactly one of"):
        request.make_request("http://127.0.0.1:9", seeds=100)
    with pytest.raises(RescoreError, match="temperature 0"):
        request.make_request(
            "http://127.0.0.1:9",
            reference_url="http://127.0.0.1:8",
            sampler=SamplerSettings(top_k=3, temperature=0.0),
        )
    with pytest.raises(RescoreError, match="too few to decide"):
        request.make_request("http://127.0.0.1:9", reference_url="http://127.0.0.1:8", seeds=2)


def test_every_prompt_draws_its_own_seeds() -> None:
    """One seed on two prompts gives both llama.cpp's same uniforms: their draws would be
    dependent, so no seed is sampled twice in a run."""
    jobs = request.seed_jobs(7, 5, 3)
    assert len(jobs) == 15 and len({s for s, _ in jobs}) == 15
    assert sorted(s for s, p in jobs if p == 0) == [7, 10, 13, 16, 19]
    assert sorted(s for s, p in jobs if p == 2) == [9, 12, 15, 18, 21]
    assert [p for _, p in jobs[:3]] == [0, 1, 2]  # prompts interleaved
    # no seed depends on N: more seeds extend a run, the same first samples in the same order
    assert request.seed_jobs(7, 8, 3)[:15] == jobs
    assert request.seed_jobs(1, 4, 1) == [(1, 0), (2, 0), (3, 0), (4, 0)]
    with pytest.raises(RescoreError, match="must fit 32 bits"):
        request.check_run(
            seeds=1000, tokens=8, alpha=0.01, concurrency=1, seed_start=2**32 - 2500,
            sampler=SamplerSettings(top_k=3, temperature=1.0), prompts=3,
        )  # fmt: skip


class _FlakySampler:
    """Fails its first `fails` calls with `error`, then draws."""

    label = "flaky"

    def __init__(self, error: ClientError, fails: int) -> None:
        self.error, self.fails, self.calls = error, fails, 0

    async def sample(self, prompt: int, prompt_ids: Sequence[int], seed: int) -> SeededGeneration:
        self.calls += 1
        if self.calls <= self.fails:
            raise self.error
        return SeededGeneration(seed, prompt, (1, 2))

    async def aclose(self) -> None:
        pass


def test_a_dropped_engine_connection_is_drawn_again_once() -> None:
    """A keep-alive connection the engine closed fails on reuse with no HTTP status: the
    seed is drawn again (its answer was never read); an HTTP error or an engine that stays
    down is not retried forever."""
    drop = ClientError("ReadError talking to http://127.0.0.1:9/completion: ")
    once = _FlakySampler(drop, 1)
    got = asyncio.run(runner._draw(once, 0, [1], 7))
    assert got.seed == 7 and once.calls == 2
    down = _FlakySampler(drop, 2)
    with pytest.raises(ClientError):
        asyncio.run(runner._draw(down, 0, [1], 7))
    http = _FlakySampler(ClientError("answered HTTP 500", 500), 1)
    with pytest.raises(ClientError, match="HTTP 500"):
        asyncio.run(runner._draw(http, 0, [1], 7))
    assert http.calls == 1


def _bodies_sent(
    monkeypatch: pytest.MonkeyPatch, make: Any, answer: dict[str, Any], path: str
) -> list[dict[str, Any]]:
    """The JSON bodies a sampler built by `make(url)` posts to `path` for one sample."""
    seen: list[dict[str, Any]] = []

    def handler(asked: Asked) -> Answer:
        if asked.path == path:
            seen.append(asked.json())
        return Answer.json(answer)

    url = route_clients(monkeypatch, handler)

    async def go() -> None:
        smp = make(url)
        try:
            await smp.sample(0, [ord("x"), ord("a")], 5)
        finally:
            await smp.aclose()

    asyncio.run(go())
    return seen


def test_the_samplers_send_the_sampler_chain_with_end_tokens_masked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bodies the engine under test is asked with: the same sampler chain and settings as
    the reference's, `ignore_eos` on (an early stop would drop the end token's draw), and one
    post-sampling probability per token (where a build that flags its speculated tokens puts
    the flags; `report_probs` asks for more)."""
    chain = {
        "samplers": ["top_k", "top_p", "min_p", "temperature"],
        "top_k": 3, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0, "ignore_eos": True,
    }  # fmt: skip
    ids = {"tokens": [ord("c"), ord("d"), ord("e")]}
    sent = _bodies_sent(monkeypatch, lambda u: ServerSampler(u, SAMPLER, 3), ids, "/completion")
    assert sent == [
        {
            "n_predict": 3,
            **chain,
            "return_tokens": True,
            "cache_prompt": False,
            "n_probs": 1,
            "post_sampling_probs": True,
            "prompt": [ord("x"), ord("a")],
            "seed": 5,
        }
    ]
    reporting = _bodies_sent(
        monkeypatch, lambda u: ServerSampler(u, SAMPLER, 3, report_probs=4), ids, "/completion"
    )
    assert reporting == [
        {
            "n_predict": 3,
            **chain,
            "return_tokens": True,
            "cache_prompt": False,
            "n_probs": 4,
            "post_sampling_probs": True,
            "prompt": [ord("x"), ord("a")],
            "seed": 5,
        }
    ]
    text = {"choices": [{"text": "cde"}]}
    openai = lambda u: OpenAISampler(u, SAMPLER, 3, _Tokenizer(), model="m")  # noqa: E731
    assert _bodies_sent(monkeypatch, openai, text, "/v1/completions") == [
        {
            "model": "m",
            "max_tokens": 3,
            **chain,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repeat_penalty": 1.0,
            "repetition_penalty": 1.0,
            "prompt": "xa",
            "seed": 5,
        }
    ]


def test_a_token_past_the_margin_is_at_the_edge_only_if_its_own_prefix_says_so() -> None:
    whole = NextToken(
        probs={1: 0.5, 2: 0.3, 3: 0.2}, logprobs={1: -1.0, 2: -1.5, 3: -2.0, 4: -2.3, 5: -4.0}
    )
    swapped = NextToken(
        probs={1: 0.5, 2: 0.3, 4: 0.2}, logprobs={1: -1.0, 2: -1.5, 3: -2.02, 4: -2.01, 5: -4.0}
    )
    wobble = NextToken(
        probs={1: 0.5, 2: 0.3, 3: 0.2}, logprobs={1: -1.2, 2: -1.5, 3: -2.0, 4: -2.3}
    )
    assert not spread.at_the_edge(4, [whole], 1e-3)  # 0.3 nats past the 3rd, no other shape
    assert spread.at_the_edge(4, [whole, swapped], 1e-3)  # in the top 3 of another batch shape
    assert spread.logprob_spread([whole, wobble]) == pytest.approx(0.2)
    assert spread.at_the_edge(4, [whole, wobble], 1e-3)  # 0.3 past, within twice a 0.2 spread
    assert not spread.at_the_edge(5, [whole, swapped, wobble], 1e-3)  # 2 nats past: impossible
    assert spread.at_the_edge(5, [whole], 2.5)  # the run's own margin still applies


def _utf8_server(held_seeds: int, seeds: list[int]) -> Canned:
    """A /completion whose draw is a byte token (held back, no probabilities) for seeds below
    `held_seeds`, as llama-server answers when its one drawn token ends inside a character."""
    probs = [{"id": 1, "prob": 0.5}, {"id": 2, "prob": 0.3}, {"id": 3, "prob": 0.2}]
    answer = {"content": "x", "tokens_predicted": 1, "completion_probabilities": [
        {"top_probs": probs, "top_logprobs": [{"id": 1, "logprob": -0.7}]}
    ]}  # fmt: skip
    held = {"content": "\ufffd", "tokens": [], "tokens_predicted": 1, "stop_type": "limit"}
    routes = {"/slots": [{"id": 0, "speculative": False}], "/v1/models": META}

    others = _routes(routes)

    def handler(asked: Asked) -> Answer:
        if asked.path == "/completion":
            seeds.append(asked.json()["seed"])
            return Answer.json(held if seeds[-1] < held_seeds else answer)
        return others(asked)

    return handler


def test_a_draw_held_back_inside_a_utf8_character_is_asked_again_with_another_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seeds: list[int] = []
    url = route_clients(monkeypatch, _utf8_server(2, seeds))
    nt = refmod.ask_next_token(url, [4, 5], SAMPLER, 3)
    assert nt.probs == {1: 0.5, 2: 0.3, 3: 0.2} and nt.logprobs == {1: -0.7}
    assert seeds == [0, 1, 2, 0, 1, 2]  # the processed question, then the raw one

    url = route_clients(monkeypatch, _utf8_server(3, seeds))

    async def go() -> tuple[refmod.NextToken, int]:
        async with refmod.Reference(url, SAMPLER) as ref:
            await ref.prepare()
            return await ref.next_token([4, 6]), ref.requests

    seeds.clear()
    nt, requests = asyncio.run(go())
    assert nt.probs == {1: 0.5, 2: 0.3, 3: 0.2} and seeds == [0, 1, 2, 3]
    assert requests == len(seeds)  # every request counted, the held-back ones too


def test_a_prefix_whose_every_draw_is_held_back_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seeds: list[int] = []
    url = route_clients(monkeypatch, _utf8_server(10**6, seeds))
    with pytest.raises(ReferenceUnusable, match="ends inside a UTF-8 character"):
        refmod.ask_next_token(url, [4, 5], SAMPLER, 3)
    assert seeds == list(range(refmod.DRAW_SEEDS))
