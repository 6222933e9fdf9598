#!/usr/bin/env python3
"""llama-server aborts with GGML_ASSERT(batch.size() > 0) in pre_decode() when a request
pinned to a slot (``id_slot``) arrives while that slot is still processing another prompt.

get_available_slot() returns the pinned slot even though it is busy, and, because the
similarity it computed for it is 0, runs the prompt-cache update on it (prompt_save +
prompt_load) before the caller defers the task: the busy slot's tokens and KV state are
replaced by the cached prompt that best matches the *deferred* request. When that prompt is
as long as the running task's, the next pre_decode() finds "the entire prompt processed"
with nothing added to the batch and aborts; a longer one leaves the task hanging; a shorter one
silently continues the running prompt on another prompt's KV cells (a wrong answer).

    python3 llama-server-empty-batch-abort.py /path/to/llama-server /path/to/model.gguf
        [--n-tokens N] [--delay S] [--attempts K] [--batch B] [llama-server args ...]

Sequence (all three requests pinned to slot 0, stdlib only):
  1. C: a prompt of N tokens -> slot 0 caches C.
  2. A: another prompt of N tokens, sharing no token with C -> slot 0 saves C to the prompt
     cache and starts A (long enough to take several decode steps).
  3. B: C again, pinned to slot 0, sent while A is still in prompt processing (polled on
     /slots) -> get_available_slot() loads C into the busy slot 0, B is deferred, and the
     next update finds slot 0's prompt (C, N tokens) "complete" with an empty batch.

Exit status: 0 when the server aborted (reproduced), 1 when it survived.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("server")
    ap.add_argument("model")
    ap.add_argument("--n-tokens", type=int, default=600, help="prompt length (default 600)")
    ap.add_argument("--delay", type=float, default=0.5,
                    help="seconds between slot 0 turning busy and B (default 0.5)")
    ap.add_argument("--attempts", type=int, default=10,
                    help="tries, each with fresh prompts, until the server aborts (default 10)")
    ap.add_argument("--batch", type=int, default=0, help="-b/-ub for the server (0: default)")
    a, extra = ap.parse_known_args()  # the rest: more llama-server arguments

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [a.server, "-m", a.model, "--host", "127.0.0.1", "--port", str(port),
            "-np", "2", "-c", str(4 * (a.n_tokens + 64)), "-t", "1", "--no-webui"]
    if a.batch:
        argv += ["-b", str(a.batch), "-ub", str(a.batch)]
    argv += extra
    fd, log = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
    proc = subprocess.Popen(argv, stdout=fd, stderr=subprocess.STDOUT)
    os.close(fd)
    try:
        return run(url, proc, a.n_tokens, a.delay, a.attempts, log)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def call(url: str, path: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def ready(url: str, proc: subprocess.Popen) -> bool:
    for _ in range(600):
        try:
            call(url, "/health", timeout=1)
            return True
        except (OSError, urllib.error.URLError):
            if proc.poll() is not None:
                return False
            time.sleep(0.2)
    return False


def body(ids: list[int]) -> dict:
    return {"prompt": ids, "n_predict": 1, "n_probs": 4, "cache_prompt": True,
            "id_slot": 0, "seed": 0}


def send(url: str, ids: list[int]) -> None:
    with contextlib.suppress(OSError, urllib.error.URLError):  # an abort closes the connection
        call(url, "/completion", body(ids), timeout=120)


def attempt(url: str, prompt_c: list[int], prompt_a: list[int], delay: float) -> bool:
    """C, then A and (while A is mid-prompt) C again, all pinned to slot 0; True when both
    A and the second C were answered."""
    call(url, "/completion", body(prompt_c))  # 1. slot 0 holds C
    t_a = threading.Thread(target=send, args=(url, prompt_a))
    t_a.start()  # 2. slot 0 starts A
    while t_a.is_alive():  # wait until slot 0 is busy with A
        if call(url, "/slots", timeout=5)[0].get("is_processing"):
            break
    time.sleep(delay)  # A's first prompt batch is being decoded: slot 0 is mid-prompt
    t_b = threading.Thread(target=send, args=(url, prompt_c))
    t_b.start()  # 3. B (= C) pinned to the busy slot 0
    t_a.join(150)
    t_b.join(150)
    return not (t_a.is_alive() or t_b.is_alive())


def run(url: str, proc: subprocess.Popen, n: int, delay: float, attempts: int, log: str) -> int:
    if not ready(url, proc):
        print(f"llama-server did not start (log: {log})")
        return 1
    n_vocab = call(url, "/v1/models")["data"][0]["meta"]["n_vocab"]
    # prompts of n tokens from two disjoint id ranges: C and A share no prefix
    span = max(1, min(97, n_vocab // 2))
    lo = n_vocab // 4 if n_vocab > 4 * span else 0
    for k in range(attempts):
        # each attempt its own prompts (C's first token differs between attempts)
        prompt_c = [lo + (i + k) % span for i in range(n)]
        prompt_a = [lo + span + (i + k) % span for i in range(n)]
        answered = attempt(url, prompt_c, prompt_a, delay)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2)
        if proc.poll() is not None:
            with open(log, errors="replace") as f:
                hit = [ln.strip() for ln in f if "GGML_ASSERT" in ln]
            print(f"llama-server aborted at attempt {k + 1} (exit {proc.returncode}): "
                  f"{hit[0] if hit else '(no assert in the log)'}")
            print(f"log: {log}")
            return 0
        if not answered:
            print(f"attempt {k + 1}: request A or B hangs (log: {log})")
            return 1
    print(f"llama-server survived {attempts} attempts (log: {log})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
