"""vLLM's CPU build for real: the env in specaudit's cache (built here if ``python -m
specaudit.vllm install`` has not built it), a `VllmServer` on the exported fixture answering a
seeded ``/v1/completions`` with logprobs and token ids, checked against the same weights run by
transformers; and a server speculating with vLLM's n-gram drafter (``--speculative-config``),
whose drafts are accepted and whose logprobs are still the model's. Both servers are the
session's (`vllm_plain`, `vllm_ngram` in tests/integration/conftest.py); that a stopped server
leaves nothing running is tested on a server `dist --engine vllm` starts and stops
(tests/integration/test_dist_vllm.py). The tiny Llama checkpoint (`specaudit.vllm.tiny`) is
built here, not served."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from specaudit.distribution import vllm as dv
from specaudit.vllm import env as venv
from specaudit.vllm import tiny
from specaudit.vllm.server import VllmServer

CliFn = Callable[..., tuple[int, str, str]]

# the session's two vLLM servers start in the first tests that use them (unless
# test_dist_vllm.py, which shares them, ran first): 2-5 min each with other work running
# (load 14-21)
pytestmark = pytest.mark.timeout(3600)
PROMPT = "bcdbc"  # the fixture's letters
TOKENS = 4
TOP = 3  # logprobs asked for: the session servers' --max-logprobs


@dataclass(frozen=True)
class Served:
    """Two completions of one seed from the session's plain server."""

    first: dict[str, Any]
    second: dict[str, Any]


def _complete(url: str, model: Path) -> dict[str, Any]:
    body = {
        "model": str(model),
        "prompt": PROMPT,
        "max_tokens": TOKENS,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": TOP,
        "return_token_ids": True,
        # tokens named by id: bytes that are no text alone would all be "" and collide
        "return_tokens_as_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


@pytest.fixture(scope="module")
def served(vllm_plain: VllmServer) -> Served:
    assert vllm_plain.max_logprobs >= TOP
    model = vllm_plain.model
    return Served(_complete(vllm_plain.url, model), _complete(vllm_plain.url, model))


def _model_logprobs(
    folder: Path, prompt: list[int], ids: list[int]
) -> tuple[list[float], list[int]]:
    """transformers on the same folder: each generated token's logprob given its prefix, and
    the greedy token at each position."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    rows = [logp[len(prompt) - 1 + i] for i in range(len(ids))]
    return [float(r[t]) for r, t in zip(rows, ids, strict=True)], [int(r.argmax()) for r in rows]


@dataclass(frozen=True)
class Speculated:
    """A greedy completion from the n-gram-speculating server, the speculation counters'
    growth across it as read the moment it returned (`at_return`) and a second later
    (`settled`)."""

    choice: dict[str, Any]
    at_return: dict[str, float]
    settled: dict[str, float]


def _counters(url: str) -> dict[str, float]:
    return dv.counters(httpx.get(f"{url}/metrics", timeout=30.0).text)


def _growth(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


@pytest.fixture(scope="module")
def speculated(vllm_ngram: VllmServer) -> Speculated:
    """The counters' growth is measured around the request: the server is the session's."""
    body = {
        "model": str(vllm_ngram.model),
        "prompt": "abcabcabcabcabc",  # repeats: the n-gram drafter finds proposals
        "max_tokens": 24,  # the greedy cycle comes round: the n-grams of the context match it
        "temperature": 0.0,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    before = _counters(vllm_ngram.url)
    r = httpx.post(f"{vllm_ngram.url}/v1/completions", json=body, timeout=120.0)
    at_return = _counters(vllm_ngram.url)
    assert r.status_code == 200, r.text
    time.sleep(1.0)
    settled = _counters(vllm_ngram.url)
    return Speculated(
        dict(r.json()["choices"][0]), _growth(at_return, before), _growth(settled, before)
    )


def test_env_is_built_and_stamped() -> None:
    env = venv.found_env()
    assert env is not None and env.version == venv.VERSION
    assert (env.root / venv.STAMP).read_text().split() == venv.stamp_lines(venv.VERSION)
    for name in venv.UNWANTED:  # removed: with them the server does not import
        assert not list((env.root / "lib").glob(f"python3*/site-packages/{name}"))


def test_tiny_model_is_byte_identical_on_every_build(tmp_path: Path) -> None:
    a = tiny.build_tiny(tmp_path / "a")
    b = tiny.build_tiny(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert set(tiny.FILES) <= set(names) and names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_seeded_completion_has_token_ids_and_logprobs(
    served: Served, vllm_plain: VllmServer
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vllm_plain.model))
    choice = served.first
    assert choice["prompt_token_ids"] == tok(PROMPT)["input_ids"]  # our tokenizer, served
    ids = choice["token_ids"]
    assert len(ids) == TOKENS and all(0 <= i < len(tok) for i in ids)
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == TOKENS and len(lp["top_logprobs"]) == TOKENS
    assert lp["tokens"] == [f"token_id:{i}" for i in ids]
    for token, value, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert math.isfinite(value) and value < 0.0
        assert TOP <= len(top) <= TOP + 1  # the top 3, and the sampled token if not among them
        assert top[token] == value
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-6
    assert served.second["token_ids"] == ids  # the same seed, the same sample
    assert served.second["logprobs"]["token_logprobs"] == lp["token_logprobs"]


def test_logprobs_are_the_models_own(served: Served, vllm_plain: VllmServer) -> None:
    """vLLM's raw logprobs (its default mode) are the model's log-softmax: the same weights
    run by transformers give the same numbers, position by position."""
    first = served.first
    want, _ = _model_logprobs(vllm_plain.model, first["prompt_token_ids"], first["token_ids"])
    got = served.first["logprobs"]["token_logprobs"]
    assert got == pytest.approx(want, abs=1e-4)


def test_ngram_speculation_is_accepted_and_keeps_the_models_logprobs(
    speculated: Speculated, vllm_ngram: VllmServer
) -> None:
    assert speculated.settled[dv.ACCEPTED] > 0  # it did speculate: drafts were accepted
    choice = speculated.choice
    ids = choice["token_ids"]
    want, greedy = _model_logprobs(vllm_ngram.model, choice["prompt_token_ids"], ids)
    assert choice["token_ids"] == greedy  # greedy decoding is unchanged by speculation
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)


def test_server_argv_is_vllms_module_with_fixed_flags(
    vllm_plain: VllmServer, vllm_ngram: VllmServer
) -> None:
    argv = vllm_plain.argv()
    assert argv[argv.index("-m") + 1] == "vllm.entrypoints.openai.api_server"
    assert argv[argv.index("--generation-config") + 1] == "vllm"
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind" in argv and "--speculative-config" not in argv
    spec = vllm_ngram.argv()
    assert json.loads(spec[spec.index("--speculative-config") + 1]) == vllm_ngram.speculative
    assert vllm_ngram.speculative is not None and vllm_ngram.speculative["method"] == "ngram"


def test_speculation_counters_are_complete_when_a_completion_returns(
    speculated: Speculated,
) -> None:
    """What `dist --engine vllm` relies on to give each request its own drafted and accepted
    counts (the /metrics deltas around it, requests one at a time)."""
    assert speculated.at_return[dv.DRAFTED] >= speculated.at_return[dv.ACCEPTED] > 0
    assert speculated.at_return == speculated.settled


def test_check_reads_vllms_speculation_from_its_metrics(
    cli: CliFn, vllm_plain: VllmServer, vllm_ngram: VllmServer
) -> None:
    """vLLM has no /slots and no /props: `check` reads its /metrics, where the speculative
    counters exist only on a speculating server, instead of saying "unknown"; its logprobs are
    real on both (the n-gram server's are the model's: above)."""
    got = {}
    for name, srv in (("plain", vllm_plain), ("ngram", vllm_ngram)):
        code, out, err = cli(
            "check", srv.url, "--model", str(srv.model), "--prompt", "bcdbc",
            "--endpoint", "completions", "--tokens", "8", "--json",
        )  # fmt: skip
        assert code == 0, (name, err[-300:])
        result = json.loads(out)
        got[name] = result["speculation"]
        assert result["verdict"] == "real", name
    assert got["plain"]["state"] == "no" and not got["plain"]["hidden"]
    assert got["plain"]["summary"].startswith(
        "does not speculate: vLLM's /metrics has no speculative-decoding counters"
    )
    assert got["ngram"]["state"] == "yes" and not got["ngram"]["hidden"]
    assert got["ngram"]["summary"].startswith(
        "speculates: vLLM's /metrics has speculative-decoding counters ("
    )
