"""Fuzz: malformed, oversized and wrongly typed requests against an in-process proxy.

Every one must get a 4xx with an OpenAI-style error message from the proxy itself (the
backends are closed ports, so a request that slipped through would come back 502/503 and
fail the test), the proxy must keep serving, and memory must stay bounded (RSS measured
after a warm-up and at the end). The suite sends 2,000 requests covering every category;
benchmarks/fuzz_proxy_requests.py sends 10,500 or as many as you like (`fuzz` is shared).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from specaudit.llama import free_port
from specaudit.proxy import ProxyConfig, serve_in_thread

N_CASES = 2_000  # the suite's; benchmarks/fuzz_proxy_requests.py defaults to 10,500
WARMUP = 500
LIMIT = 64 * 1024  # the fuzzed proxy's body limit, so oversized bodies stay cheap

BASES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "abc", "max_tokens": 4},
    "/completion": {"prompt": "abc", "n_predict": 4},
}

WRONG: dict[str, list[object]] = {
    "stream": ["true", 1, 0.5, [], {}],
    "logprobs": ["yes", -1, 1.5, [], {}],
    "top_logprobs": [-1, 1.5, "3", True, [], {}],
    "n_probs": [-2, 2.5, "2", False, [1], {}],
    "post_sampling_probs": [1, "true", [], {}],
    "max_tokens": [1.5, "10", True, [], {}],
    "n_predict": [2.5, "4", False, [4]],
    "seed": [0.1, "1", True, {}],
    "top_k": [1.5, "40", [40]],
    "n": [0, -1, 1.5, "2"],
    "temperature": ["hot", True, [], {}],
    "top_p": ["0.9", False, [0.9]],
    "min_p": ["x", {}],
    "model": [1, [], {}, True],
    "stop": [1, [1], {}, True, ["a", 2]],
}
WRONG_MESSAGES: list[object] = [
    5,
    "hi",
    {},
    [],
    [1],
    [None],
    [{"content": "a"}],
    [{"role": 1, "content": "a"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": {"x": 1}}],
    None,
]
WRONG_PROMPT: list[object] = [5, True, 1.5, False]


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


def cases(rng: random.Random, n: int) -> Iterator[tuple[str, str, bytes, str]]:
    """(method, path, body, category); every one is invalid by construction."""
    paths = list(BASES)
    for _ in range(n):
        path = rng.choice(paths)
        base = BASES[path]
        r = rng.random()
        if r < 0.12:  # random bytes
            yield "POST", path, rng.randbytes(rng.randint(0, 300)), "random-bytes"
        elif r < 0.22:  # truncated valid JSON
            raw = _json({**base, "seed": rng.randint(0, 9)})
            yield "POST", path, raw[: rng.randint(0, len(raw) - 1)], "truncated"
        elif r < 0.27:  # trailing garbage
            yield "POST", path, _json(base) + rng.choice([b"x", b"}", b",", b" 1"]), "trailing"
        elif r < 0.31:  # invalid UTF-8 inside a string
            yield "POST", path, _json(base)[:-2] + b'"\xff\xfe"}', "utf8"
        elif r < 0.34:  # nesting bomb within the size limit
            depth = rng.randint(5_000, 30_000)
            yield "POST", path, b"[" * depth + b"]" * depth, "nesting"
        elif r < 0.39:  # not an object
            v = rng.choice([[], [1, 2], 1, -1.5, "s", None, True, [base]])
            yield "POST", path, _json(v), "not-object"
        elif r < 0.42:  # NaN / Infinity, duplicate keys
            raw = rng.choice(
                [
                    _json(base)[:-1] + b', "temperature": NaN}',
                    _json(base)[:-1] + b', "top_p": Infinity}',
                    _json(base)[:-1] + b', "stream": true, "stream": false}',
                    _json(base)[:-1] + b', "logprobs": 2, "logprobs": 0}',
                ]
            )
            yield "POST", path, raw, "ambiguous"
        elif r < 0.80:  # one wrongly typed field
            field = rng.choice(list(WRONG))
            body = {**base, field: rng.choice(WRONG[field])}
            yield "POST", path, _json(body), f"type:{field}"
        elif r < 0.87:  # wrong messages / prompt
            if path == "/v1/chat/completions":
                body = {**base, "messages": rng.choice(WRONG_MESSAGES)}
                if rng.random() < 0.2:
                    body.pop("messages")
            else:
                body = {**base, "prompt": rng.choice(WRONG_PROMPT)}
            yield "POST", path, _json(body), "messages/prompt"
        elif r < 0.93:  # oversized
            pad = "a" * (LIMIT + rng.randint(1, 4096))
            yield "POST", path, _json({**base, "pad": pad}), "oversized"
        elif r < 0.97:  # empty body
            yield "POST", path, rng.choice([b"", b" ", b"\n\t"]), "empty"
        else:  # unknown paths and wrong methods
            m, p = rng.choice(
                [
                    ("GET", path),
                    ("PUT", path),
                    ("DELETE", "/v1/models"),
                    ("POST", "/v1/embeddings"),
                    ("POST", "/slots"),
                    ("GET", "/props"),
                    ("POST", path + "/"),
                    ("POST", "/v1//completions"),
                    ("GET", "/../etc/passwd"),
                ]
            )
            yield m, p, _json(base), "path/method"


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def fire(url: str, batch: list[tuple[str, str, bytes, str]], conc: int) -> list[str]:
    """Send `batch`; return one problem string per request that was not a proper 4xx."""
    problems: list[str] = []
    todo = iter(batch)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as s:

        async def worker() -> None:
            for method, path, body, cat in todo:
                try:
                    async with s.request(
                        method, url + path, data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        raw = await r.read()
                        status = r.status
                except aiohttp.ClientError as e:
                    problems.append(f"{cat}: {type(e).__name__}")
                    continue
                if not 400 <= status < 500:
                    problems.append(f"{cat}: HTTP {status}")
                    continue
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    problems.append(f"{cat}: no error message in {raw[:80]!r}")
                    continue
                if not isinstance(msg, str) or not msg:
                    problems.append(f"{cat}: empty message")

        await asyncio.gather(*(worker() for _ in range(conc)))
    return problems


@dataclass(frozen=True)
class FuzzRun:
    """What one fuzz run saw: its requests by category, the problems (requests not answered
    with a proper 4xx), the proxy's own accounting, its health after, RSS around the storm."""

    requests: int
    categories: dict[str, int]
    problems: list[str]
    counted: int
    errors: dict[str, int]
    health: int
    rss_before_kib: int
    rss_after_kib: int


def fuzz(n_cases: int, warmup: int, seed: int = 20261201) -> FuzzRun:
    """Send `n_cases` invalid requests (`cases`) to a proxy whose backends are closed ports;
    RSS is read after the first `warmup` and at the end."""
    rng = random.Random(seed)
    batch = list(cases(rng, n_cases))
    cats = Counter(c[3].split(":")[0] for c in batch)
    dead_plain, dead_spec = free_port(), free_port()
    cfg = ProxyConfig(
        f"http://127.0.0.1:{dead_plain}",
        f"http://127.0.0.1:{dead_spec}",
        port=0,
        max_body_bytes=LIMIT,
        check_interval=3600,
    )
    with serve_in_thread(cfg) as px:
        problems = asyncio.run(fire(px.url, batch[:warmup], 8))
        before = rss_kib()
        problems += asyncio.run(fire(px.url, batch[warmup:], 8))
        after = rss_kib()
        stats = px.stats()
        # still healthy and serving after the storm
        health = asyncio.run(_get(px.url + "/health"))
    return FuzzRun(
        len(batch), dict(cats), problems, stats.requests, dict(stats.errors), health, before, after
    )


def check(run: FuzzRun, warmup: int) -> None:
    """Every property a fuzz run must keep (AssertionError naming the first broken one)."""
    assert run.problems == [], run.problems[:20]
    assert run.counted == run.requests
    assert sum(run.errors.values()) == run.requests
    assert set(run.errors) <= {"bad_request", "body_too_large", "not_found", "bad_method"}
    assert run.health == 503  # the proxy answers: down, both backends are closed ports
    grew = run.rss_after_kib - run.rss_before_kib
    assert grew < 32 * 1024, f"RSS grew {grew} KiB over {run.requests - warmup}"


@pytest.mark.timeout(600)
def test_fuzz_every_bad_request_gets_a_4xx_with_a_message() -> None:
    run = fuzz(N_CASES, WARMUP)
    assert run.requests == N_CASES and len(run.categories) == 12, run.categories
    print(
        f"fuzz: {run.requests} requests, categories {run.categories}; RSS {run.rss_before_kib} "
        f"KiB -> {run.rss_after_kib} KiB ({run.rss_after_kib - run.rss_before_kib:+d} KiB)"
    )
    check(run, WARMUP)


async def _get(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        await r.read()
        return r.status
