"""`rescore --engine vllm` for real: vLLM's CPU build sampled with the prompt and its tokens as
ids, every token re-scored against a plain llama-server, a reference vLLM cannot influence.

On the fixture, the session's stock n-gram server (tests/integration/conftest.py) against the
plain fixture llama-server: BROKEN, its drafts counted from /metrics, the same-model probe
within float32 noise, and the server still alive (the probe never enters vLLM's crashing
top-k path). On Gemma 3 270M (the audit's vLLM section, `audit.sections.vllm.run_gemma`):
specaudit's fixed n-gram server drafting on prompts that repeat themselves, against
llama-server serving the same weights as a float32 GGUF (`model_export`): not BROKEN, no
token the reference forbids, drafts counted, and the two sides within 1e-3 TV of each other
on the first prompt (a Q4_K_M llama-server was 0.019 away: docs/vllm.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from specaudit import audit, fixtures

if TYPE_CHECKING:
    from specaudit.vllm.server import VllmServer

CliFn = Callable[..., tuple[int, str, str]]
# a vLLM start takes minutes on a busy 2-core machine; Gemma's float32 tokens come at a few
# per second there
pytestmark = pytest.mark.timeout(3600)
PROBE_FLOAT32 = 1e-3  # TV, vLLM float32 vs llama-server float32, same weights (measured 3e-4)


def test_rescore_engine_vllm_sees_the_stock_ngram_server_break(
    vllm_ngram: VllmServer,
    server: Callable[[str], Any],
    fixture_set: fixtures.FixtureSet,
    cli: CliFn,
) -> None:
    code, out, err = cli(
        "rescore", "--engine", "vllm", "--url", vllm_ngram.url,
        "--reference-url", server("fixture-plain").url, "--prompt", fixture_set.spec.prompt,
        "--seeds", "100", "--tokens", "8", "--top-k", "0", "--top-p", "0.8", "--min-p", "0",
        "--temperature", "1", "--arm-temperature", "off", "--json",
    )  # fmt: skip
    assert code == 1 and out, err[-800:]
    r = json.loads(out)
    assert r["verdict"] == "BROKEN", r["stats"]["reason"][:500]
    assert r["rescored"] == r["sampled_tokens"] == 800
    assert r["drafted"] > 0 and 0 <= r["accepted"] <= r["drafted"]
    assert r["probe_tv"] is not None and r["probe_tv"] < 1e-4
    assert vllm_ngram.alive()


def test_gemma_on_fixed_vllm_is_rescored_against_the_same_float32_weights(
    audit_ctx: audit.AuditContext,
) -> None:
    from specaudit.audit.sections import vllm as av

    (run,) = av.run_gemma(audit_ctx, seeds=8, tokens=6, fixed=(True,), concurrency=4)
    res = run.result
    assert res is not None and res.error is None, run.why
    assert run.server == "ngram + cpu-sampler fix" and run.verdict != "BROKEN", run.verdict
    assert res.rescored == len(res.samples) * 6 == 8 * 3 * 6
    assert res.drafted is not None and res.drafted > 0 and res.accepted is not None
    assert res.probe_tv is not None and res.probe_tv < PROBE_FLOAT32
    assert all(d.ref.probs.get(d.token, 0.0) > 0.0 for d in res.draws)
    assert run.plot is not None and run.plot.stat().st_size > 0
