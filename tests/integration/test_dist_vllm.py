"""`specaudit dist --engine vllm` for real: vLLM's CPU build, started by `dist` from its env on
the default fixture exported as Hugging Face folders (widened to head size 32 and proven), plain
and n-gram-speculating, each server's own probabilities checked against the closed form before
sampling; plain keeps the distribution (PRESERVED), n-gram speculation does not (vLLM 0.32.0's
CPU rejection sampler, docs/vllm.md), its drafts are counted from /metrics, and every process
`dist` started is gone when it returns."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from specaudit.cli import run as cli_run

# two or three vLLM servers started, each 2-6.5 min with other work running (load 14-21), and
# 1000 requests each
pytestmark = pytest.mark.timeout(3600)
SEEDS = 1000  # dist's default: the fixture certifies the 0.15 tolerance at it
# top-k off: with top-k on, vLLM 0.32.0's CPU rejection sampler crashes (top-p 1: on a step
# without drafts, `test_a_crash_of_vllm_is_one_line_naming_the_method_and_the_setting`; top-p
# 0.95: an index out of bounds); top-p 0.8 keeps the support small enough for 1000 seeds


def run_cli(*args: str) -> tuple[int, str, str]:
    """``specaudit ARGS`` in-process, as the `cli` fixture runs it (tests/conftest.py), for a
    module-scoped fixture: (exit code, stdout, stderr)."""
    runner = CliRunner()
    with runner.isolation() as (out, err, _mixed):
        try:
            code = cli_run(list(args))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        return code, out.getvalue().decode(), err.getvalue().decode(errors="replace")


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent pid, from /proc (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = text[text.rindex(")") + 2 :].split()[:2]  # the name may hold spaces
    return state, int(ppid)


def _descendants(pid: int) -> set[int]:
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
    return found


def _running(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"  # a zombie is dead, waiting to be reaped


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    """One `dist --engine vllm` run of plain and ngram, the processes it started (this
    process's descendants, polled while it runs, less those already there) and which of them
    still run seconds after it returned (none, if `dist` stops its servers: SIGKILL is
    delivered at once, but a process of several GB takes a moment to exit)."""
    before = _descendants(os.getpid())
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(_descendants(os.getpid()) - before)
            done.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code, out, err = run_cli(
            "dist", "--engine", "vllm", "--vllm-method", "plain", "--vllm-method", "ngram",
            "--top-k", "0", "--top-p", "0.8", "--seeds", str(SEEDS), "--json",
        )  # fmt: skip
    finally:
        done.set()
        watcher.join()
    deadline = time.monotonic() + 15.0
    while any(_running(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: _stat(p) for p in seen if _running(p)}
    return {"code": code, "err": err, "result": json.loads(out) if out else {}, "seen": seen,
            "left": left}  # fmt: skip


def _engines(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["kind"]: e for e in run["result"].get("engines", [])}


def test_plain_keeps_the_distribution_and_ngram_samples_impossible_tokens(
    run: dict[str, Any],
) -> None:
    """Plain vLLM samples the closed form; n-gram speculation at top-p 0.8 samples tokens the
    sampler forbids (specials outside the top-p set): vLLM 0.32.0's CPU rejection sampler
    (docs/vllm.md). Exit 1: a finding."""
    engines = _engines(run)
    verdicts = {k: (e["verdict"], e["reason"][:200]) for k, e in engines.items()}
    assert run["code"] == 1, (verdicts, run["err"][-300:])
    assert sorted(engines) == ["vllm-ngram", "vllm-plain"]
    assert engines["vllm-plain"]["verdict"] == "PRESERVED", verdicts
    ngram = engines["vllm-ngram"]
    assert ngram["verdict"] == "BROKEN" and ngram["impossible"] > 0, verdicts
    assert all(e["n_samples"] == SEEDS for e in engines.values())


def test_ngram_drafts_are_counted_from_metrics_and_plain_has_none(run: dict[str, Any]) -> None:
    engines = _engines(run)
    assert engines["vllm-plain"]["drafted"] is None
    ngram = engines["vllm-ngram"]
    assert ngram["drafted"] > 0 and 0 < ngram["accepted"] <= ngram["drafted"]


def test_each_server_computes_the_fixture_before_it_is_sampled(run: dict[str, Any]) -> None:
    notes = run["result"].get("notes", [])
    assert any("exported at head size 32 (its own 8): logits bitwise equal" in n for n in notes)
    for method in ("plain", "ngram"):
        (line,) = [n for n in notes if n.startswith(f"vLLM {method} next-token probabilities")]
        assert "vs the closed form on 9 contexts" in line


def test_dist_leaves_no_vllm_process_running(run: dict[str, Any]) -> None:
    assert len(run["seen"]) >= 2  # the API servers and vLLM's engine processes
    assert run["left"] == {}


def test_a_crash_of_vllm_is_one_line_naming_the_method_and_the_setting() -> None:
    """vLLM 0.32.0's CPU rejection sampler applies top-k with ``k.max()`` over the step's
    draft positions, which fails when a step has none: the n-gram server dies on dist's
    default top-k 3 (top-p 1). `dist` says so in one line, exit 2, naming the method, the
    setting and vLLM's own exception, and keeps the server's log."""
    code, out, err = run_cli("dist", "--engine", "vllm", "--vllm-method", "ngram", "--seeds", "200")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert (
        line.startswith("error: vLLM ")
        and " ngram (temperature 1, top-k 3, top-p 1, min-p 0)" in line
    )
    assert "RuntimeError: max(): Expected reduction dim" in line
    log = Path(line.split("(log ", 1)[1].split(":", 1)[0])
    assert "apply_top_k_only" in log.read_text()
    log.unlink()
