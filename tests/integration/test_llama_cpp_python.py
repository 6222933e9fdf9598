"""llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`, built from PyPI's
sdist once and cached: `specaudit.llama_cpp_python`) on the fixture, speculating with
``--draft_model prompt-lookup-decoding``: `dist --engine openai` on it, and `check` (real
logprobs, no /slots: no false alarm, and the answer for a server that speculates silently)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specaudit import check, distribution, fixtures
from specaudit import llama_cpp_python as lcp
from specaudit.outcome import Outcome
from specaudit.stats import Verdict


@pytest.fixture(scope="module")
def lcp_server(
    fixture_set: fixtures.FixtureSet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[lcp.LlamaCppPythonServer]:
    lcp.install()  # the cached wheel (./run test installed it already: a no-op then)
    log = tmp_path_factory.mktemp("lcp") / "llama-cpp-python.log"
    with lcp.LlamaCppPythonServer(Path(fixture_set.target), log_path=log) as srv:
        yield srv


def test_server_is_the_pinned_build(lcp_server: lcp.LlamaCppPythonServer) -> None:
    assert lcp.installed_version() == lcp.VERSION
    assert lcp.cached_wheel() is not None
    assert "--draft_model" in lcp_server.argv() and lcp.PROMPT_LOOKUP in lcp_server.argv()


def test_dist_openai_on_llama_cpp_python(
    lcp_server: lcp.LlamaCppPythonServer, fixture_set: fixtures.FixtureSet
) -> None:
    req = distribution.make_request(["openai"], fixture=fixture_set, url=lcp_server.url, seeds=1000)
    res = distribution.run(req)
    (e,) = res.engines
    assert e.verdict is Verdict.PRESERVED, e.reason
    assert e.drafted is None  # it does not say what it drafted


def test_dist_openai_on_llama_cpp_python_context_fixture(
    tmp_path: Path,
) -> None:
    # the context fixture: a stale KV-cache entry after a rejected draft would show here
    cfs = distribution.load_fixture(None, kind="context")
    srv = lcp.LlamaCppPythonServer(
        Path(cfs.target), log_path=tmp_path / "lcp-context.log", f32_cache=True
    )
    with srv:
        res = distribution.run(
            distribution.make_request(["openai"], fixture=cfs, url=srv.url, seeds=1000)
        )
    (e,) = res.engines
    assert e.verdict is Verdict.PRESERVED, e.reason


def test_check_on_llama_cpp_python(lcp_server: lcp.LlamaCppPythonServer) -> None:
    res = check.run(lcp_server.url, prompt="bcdbc", tokens=8, endpoint="completions")
    assert res.outcome is Outcome.OK, res.reason  # no false alarm: every logprob is real
    assert res.real > 0 and res.placeholders == 0
    assert res.speculation.state == "unknown"
    assert res.speculation.slots_note == "no /slots endpoint"
    assert "speculate without saying so" in res.speculation.summary


def test_cli_check_on_llama_cpp_python(cli: Callable, lcp_server: lcp.LlamaCppPythonServer) -> None:
    code, out, err = cli(
        "check", lcp_server.url, "--prompt", "bcdbc", "--tokens", "8", "--endpoint",
        "completions", "--json",
    )  # fmt: skip
    assert code == 0, err
    assert '"verdict": "real"' in out


def test_prompt_lookup_drafts_on_the_fixture_prompt(fixture_set: fixtures.FixtureSet) -> None:
    """The server's draft model proposes tokens here (its responses do not say): the prompt
    `bcdbc` ends in `bc`, seen at its start, so prompt lookup drafts what followed."""
    import numpy as np
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    spec = fixture_set.spec
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lcp.DEFAULT_PRED_TOKENS)
    got = draft(np.array(spec.tokenize(spec.prompt), dtype=np.intc))
    assert [spec.tokens[int(t)] for t in got][:3] == list("dbc")


def test_rescore_openai_engine_on_llama_cpp_python(
    lcp_server: lcp.LlamaCppPythonServer,
    fixture_set: fixtures.FixtureSet,
    server: Callable[..., Any],
) -> None:
    """`rescore --engine openai`: llama-cpp-python returns text only; the fixture's
    characters round-trip through the reference's tokenizer, so its samples are re-scored
    against a plain llama-server of the same file, prompt lookup drafting and all."""
    from specaudit.fixtures import REPORT_SAMPLER
    from specaudit.rescore import fixture as fixture_ref
    from specaudit.rescore import request, runner

    spec = fixture_set.spec
    models = httpx.get(lcp_server.url + "/v1/models", timeout=30).json()
    req = request.make_request(
        lcp_server.url,
        engine="openai",
        reference_url=server("fixture-plain").url,
        prompts=[spec.prompt],
        seeds=300,
        tokens=4,
        sampler=REPORT_SAMPLER,
        model=models["data"][0]["id"],
        draft=fixture_ref.FixtureDraft(spec, REPORT_SAMPLER),
    )
    res = runner.run(req)
    assert res.error is None and res.stats is not None
    assert res.rescored == res.sampled_tokens == 1200
    assert res.stats.verdict is Verdict.PRESERVED, res.stats.reason
