"""The sequence that aborts a plain llama-server b11434 used as a reference, sent through
specaudit's reference code against the real stock server: a run's question being processed
on slot 0 while the batch-shape measurement (`incremental_answers`, which pins slot 0) asks
for a prompt the server's prompt cache holds. llama-server swaps the busy slot's prompt for
the cached one and aborts (``GGML_ASSERT(batch.size() > 0)``,
docs/upstream/llama-server-empty-batch-abort.md); through `reference.alone` the pinned
requests wait until the question is answered, and both get answers.

Gemma 3 270M: its sliding-window checkpoints split a prompt into several decode steps, so
the question is still mid-prompt when the pinned request comes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from specaudit.client import Client
from specaudit.fixtures import SamplerSettings
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer
from specaudit.reference import Reference, alone, completion_body, incremental_answers
from specaudit.speculation import slot_list

SAMPLER = SamplerSettings(top_k=40, top_p=1.0, min_p=0.0, temperature=1.0)
N = 600  # prompt tokens: several decode steps on one thread


@pytest.mark.gemma
def test_a_pinned_measurement_during_a_question_gets_answers_and_the_reference_lives(
    llama_bins: LlamaBinaries, gemma_path: Path
) -> None:
    cached = [60_000 + i % 97 for i in range(N)]  # C: in the prompt cache
    question = [61_000 + i % 89 for i in range(N)]  # A: the run's question, as long as C
    with LlamaServer(
        llama_bins, gemma_path, parallel=2, ctx_size=4096, extra_args=["-t", "1"],
        name="reference-pinned",
    ) as srv:  # fmt: skip
        with Client(srv.url, timeout=300) as c:
            # slot 0 holds C, then slot 1 another prompt: A goes to slot 0 (least recently
            # used) and C moves to the prompt cache
            c.post("/completion", {**completion_body(cached, SAMPLER, 1), "id_slot": 0})
            c.post("/completion", {**completion_body(question[:8], SAMPLER, 1), "id_slot": 1})

        async def go() -> tuple[int, int]:
            async with Reference(srv.url, SAMPLER, timeout=300, concurrency=2) as ref:
                await ref.prepare()
                asked = asyncio.create_task(ref.next_token(question))
                with Client(srv.url, timeout=30) as c:
                    t0 = time.monotonic()
                    while not (slot_list(c.get("/slots")) or [{}])[0].get("is_processing"):
                        assert time.monotonic() - t0 < 60, "slot 0 never took the question"
                        await asyncio.sleep(0.01)
                await asyncio.sleep(0.5)  # A's first prompt batch is being decoded
                shapes = await alone(
                    srv.url, incremental_answers, srv.url, [*cached, 107], SAMPLER, 40,
                    ks=(1,), timeout=300,
                )  # fmt: skip
                answer = await asked
                return len(shapes), len(answer.probs)

        n_shapes, n_probs = asyncio.run(go())
        assert srv.alive(), f"the reference died: {srv.log_path}"
        assert n_shapes == 1 and n_probs == 40
