"""A request pinned to a reference slot (``id_slot``: `incremental_answers`, the batch shapes
of the edge rule and the noise floor) never meets another request in flight on the same
server (`reference.SlotGate`): llama-server b11434 swaps a busy pinned slot's prompt for a
cached one and aborts, hangs or answers from the wrong cells
(docs/upstream/llama-server-empty-batch-abort.md). Canned answers through the client's
transport, with delays so that requests really overlap."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import httpx
import pytest

from fakes import Answer, Asked, CannedTransport, _asked
from specaudit import client
from specaudit import reference as refmod
from specaudit.fixtures import SamplerSettings
from specaudit.reference import NextToken
from specaudit.rescore import spread
from specaudit.rescore.records import TokenDraw

SAMPLER = SamplerSettings(top_k=3, top_p=1.0, min_p=0.0, temperature=1.0)
META = {"data": [{"id": "m", "meta": {"n_vocab": 11, "n_params": 100, "size": 10}}]}
POST_PROBS = {1: 0.5, 2: 0.3, 3: 0.2}
POST = {"completion_probabilities": [
    {"top_probs": [{"id": t, "prob": p} for t, p in POST_PROBS.items()]}]}  # fmt: skip
RAW = {"completion_probabilities": [
    {"top_logprobs": [{"id": t, "logprob": lp} for t, lp in ((1, -0.7), (2, -1.2), (3, -1.6))]}
]}  # fmt: skip
URL = "http://reference.test"


class Overlaps(CannedTransport):
    """Records, at each ``/completion`` arrival, whether it is pinned and what was in flight."""

    def __init__(self) -> None:
        super().__init__(self._canned)
        self._lock = threading.Lock()
        self.in_flight = 0
        self.pinned_in_flight = 0
        self.arrivals: list[tuple[bool, int, int]] = []  # (pinned, in flight, pinned in flight)

    @staticmethod
    def _canned(asked: Asked) -> Answer:
        if asked.path == "/slots":
            return Answer.json([{"id": 0, "speculative": False}])
        if asked.path == "/v1/models":
            return Answer.json(META)
        if asked.path != "/completion":
            return Answer.json({"error": "not supported"}, 501)
        return Answer.json(POST if asked.json()["post_sampling_probs"] else RAW, delay=0.01)

    def _enter(self, request: httpx.Request) -> bool:
        asked = _asked(request)
        pinned = asked.path == "/completion" and "id_slot" in asked.json()
        with self._lock:
            if asked.path == "/completion":
                self.arrivals.append((pinned, self.in_flight, self.pinned_in_flight))
            self.in_flight += 1
            self.pinned_in_flight += pinned
        return pinned

    def _leave(self, pinned: bool) -> None:
        with self._lock:
            self.in_flight -= 1
            self.pinned_in_flight -= pinned

    def _answer(self, request: httpx.Request) -> httpx.Response:
        pinned = self._enter(request)
        try:
            return super()._answer(request)
        finally:
            self._leave(pinned)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        pinned = self._enter(request)
        try:
            return await super().handle_async_request(request)
        finally:
            self._leave(pinned)


def _far_draw(seed: int) -> TokenDraw:
    """A sampled token (9) outside the top-k and absent from the raw top log-probabilities:
    the edge rule confirms it in every batch shape (`incremental_answers`, pinned)."""
    return TokenDraw(seed, 0, 2, f"0:{seed % 7},{seed % 5}", 9, NextToken(probs=POST_PROBS))


def _run(monkeypatch: pytest.MonkeyPatch, far: int) -> Overlaps:
    """The run's questions (40 prefixes, 4 at a time) while `far` far tokens are confirmed
    by the edge rule, on one server."""
    tr = Overlaps()
    monkeypatch.setattr(client, "default_transport", tr)

    async def go() -> None:
        async with refmod.Reference(URL, SAMPLER, concurrency=4) as ref:
            await ref.prepare()
            sorter = spread.OutsideSorter(ref, [[4, 5, 6, 7, 8, 9, 10]], 3, 0.1, 10.0)
            questions = [ref.next_token([4, 5, 6, i % 11, i // 11]) for i in range(40)]
            edges = [sorter.classify([_far_draw(s)]) for s in range(far)]
            await asyncio.gather(*questions, *edges)
            assert sorter.confirmed == far and len(sorter.far) == far

    asyncio.run(go())
    return tr


def test_pinned_requests_never_overlap_another_request_on_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tr = _run(monkeypatch, far=3)
    pinned = [a for a in tr.arrivals if a[0]]
    # 3 far tokens x 4 batch shapes of a 9-token prefix (1, 2, 4, 8) x (warm, post, warm, raw)
    assert len(pinned) == 3 * 4 * 4
    # the run's questions did overlap each other (4 at a time): the server was shared
    assert max(n for p, n, _ in tr.arrivals if not p) > 0
    assert all(n == 0 for p, n, _ in tr.arrivals if p), "a pinned request met another"
    assert all(pn == 0 for _, _, pn in tr.arrivals), "a request met a pinned one in flight"


def test_the_run_questions_carry_no_slot() -> None:
    """Only the batch-shape measurements pin a slot; a run's questions go to any free slot."""
    body: dict[str, Any] = refmod.completion_body([1, 2, 3], SAMPLER, 40)
    assert "id_slot" not in body and body["cache_prompt"] is True


def test_a_waiting_pinned_caller_holds_new_questions_back() -> None:
    """An exclusive caller waiting for the questions in flight is not starved by new ones:
    questions that arrive after it wait for it."""
    order: list[str] = []

    async def go() -> None:
        gate = refmod.slot_gate(URL)

        async def question(name: str, hold: float) -> None:
            async with gate.shared():
                order.append(f"{name}+")
                await asyncio.sleep(hold)
                order.append(f"{name}-")

        first = asyncio.create_task(question("q1", 0.05))
        await asyncio.sleep(0.01)

        def measure() -> str:
            order.append("pinned")
            return "done"

        pinned = asyncio.create_task(refmod.alone(URL, measure))
        await asyncio.sleep(0.01)
        later = asyncio.create_task(question("q2", 0.0))
        assert await pinned == "done"
        await asyncio.gather(first, later)

    asyncio.run(go())
    assert order == ["q1+", "q1-", "pinned", "q2+", "q2-"]


def test_closing_the_reference_ends_questions_whose_callers_were_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupted run cancels the seeds' tasks, but their questions are shielded (other
    callers may share them): leaving the reference must end them, not close the client under
    them (each would fail unobserved and asyncio print its traceback at exit)."""
    tr = Overlaps()
    monkeypatch.setattr(client, "default_transport", tr)
    unobserved: list[dict[str, Any]] = []

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, c: unobserved.append(c))
        async with refmod.Reference(URL, SAMPLER, concurrency=4) as ref:
            await ref.prepare()
            callers = [asyncio.ensure_future(ref.next_token([4, i])) for i in range(8)]
            await asyncio.sleep(0.005)  # the first questions are in flight, the rest wait
            for c in callers:
                c.cancel()
            await asyncio.gather(*callers, return_exceptions=True)
            asking = list(ref._asking.values())
            assert asking, "no question was left in flight: the test shows nothing"
        assert all(f.done() for f in asking)
        await asyncio.sleep(0.05)  # a question still running would fail here, unobserved

    asyncio.run(go())
    gc.collect()
    assert not unobserved, unobserved
