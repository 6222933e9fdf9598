"""specaudit inside the `litellm` proxy process, configured in its own config.yaml
(``litellm_settings.callbacks``), in front of real llama-servers: model group ``fx`` with two
plain and two speculating fixture deployments (one plain killed mid-test), ``fx-spec`` with
speculating ones only, and ``fx-probe``, one deployment that records when its /slots is read
and never gets a request: the proxy reads roles at start and every check_interval, not on first
use. `specaudit check --litellm-config` reads the same file."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from litellm_helpers import extra_server, litellm_proxy, write_config
from specaudit import audit
from specaudit.llama.build import LlamaBinaries

CliFn = Callable[..., tuple[int, str, str]]
K = 3


def _body(stream: bool = False, logprobs: bool = True, model: str = "fx") -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "bcdbc"}],
        "max_tokens": 6,
        "stream": stream,
    }
    if logprobs:
        b |= {"logprobs": True, "top_logprobs": K}
    return b


def _base(r: httpx.Response) -> str:
    return r.headers["x-litellm-model-api-base"].removesuffix("/v1")


def _real(e: dict[str, Any]) -> bool:
    return e["logprob"] is not None and len(e["top_logprobs"]) == K


def _stream(c: httpx.Client, model: str = "fx") -> tuple[list[dict[str, Any]], int]:
    entries: list[dict[str, Any]] = []
    tokens = 0
    with c.stream("POST", "/v1/chat/completions", json=_body(stream=True, model=model)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    tokens += 1
                    assert ch.get("logprobs"), "a streamed token without any logprobs entry"
                    entries += ch["logprobs"]["content"]
    return entries, tokens


@contextlib.contextmanager
def _probe(target: str) -> Iterator[tuple[str, list[float]]]:
    """A deployment that forwards every GET to the llama-server `target` and records when its
    /slots was read: (its URL, the read times)."""
    hits: list[float] = []

    class Forward(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.startswith("/slots"):
                hits.append(time.monotonic())
            r = httpx.get(target + self.path, timeout=10)
            self.send_response(r.status_code)
            self.send_header("content-type", r.headers.get("content-type", "application/json"))
            self.send_header("content-length", str(len(r.content)))
            self.end_headers()
            self.wfile.write(r.content)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", hits
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_litellm_proxy_process(
    server: Callable[..., Any],
    audit_ctx: audit.AuditContext,
    llama_bins: LlamaBinaries,
    fixture_spec_b: str,
    tmp_path: Path,
    cli: CliFn,
) -> None:
    plain_a, spec_a = server("fixture-plain").url, server("fixture-spec").url
    with (
        extra_server(audit_ctx, llama_bins, "fixture-plain", "litellm-proxy-plain-b") as pb,
        _probe(plain_a) as (probe, reads),
    ):
        plain_b, spec_b = pb.url, fixture_spec_b
        plains, specs = {plain_a, plain_b}, {spec_a, spec_b}
        cfg = write_config(
            tmp_path / "config.yaml",
            {
                "fx": [plain_a, plain_b, spec_a, spec_b],
                "fx-spec": [spec_a, spec_b],
                "fx-probe": [probe],
            },
        )
        env = {"SPECAUDIT_LITELLM_CHECK_INTERVAL": "1"}
        with litellm_proxy(cfg, env) as url, httpx.Client(base_url=url, timeout=60) as c:
            # no request has reached the proxy, none ever goes to fx-probe: its /slots is read
            # at start, then every second
            _wait_for(lambda: len(reads) >= 1)
            _wait_for(lambda: len(reads) >= 4)
            gaps = [b - a for a, b in zip(reads, reads[1:], strict=False)]
            # the periodic reads keep their interval; the first follows the start's read by
            # less when the start was slow (0.28 s, with another test file beside it). The
            # upper bound only says "periodic, not once": a 1 s interval took 5.05 s once at a
            # load of 10 on 2 cores
            assert gaps[0] < 15 and all(0.5 < g < 15 for g in gaps[1:]), gaps
            for _ in range(6):
                r = c.post("/v1/chat/completions", json=_body())
                assert r.status_code == 200, r.text
                assert _base(r) in plains and r.headers["x-specaudit-placeholders"] == "0"
                content = r.json()["choices"][0]["logprobs"]["content"]
                assert len(content) == 6 and all(_real(e) for e in content)
            for _ in range(6):
                r = c.post("/v1/chat/completions", json=_body(logprobs=False))
                assert r.status_code == 200 and _base(r) in specs
            entries, tokens = _stream(c)
            assert tokens == len(entries) == 6 and all(_real(e) for e in entries)
            body = {"model": "fx", "prompt": "bcdbc", "max_tokens": 6, "logprobs": K}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and _base(r) in plains, r.text
            assert r.headers["x-specaudit-placeholders"] == "0"
            content = r.json()["choices"][0]["logprobs"]["content"]
            assert len(content) == 6 and all(_real(e) for e in content)

            # a fleet check on the very file the proxy runs on, all four up
            code, out, err = cli(
                "check", "--litellm-config", str(cfg), "--prompt", "bcdbc", "--tokens", "8",
                "--endpoint", "chat", "--json",
            )  # fmt: skip
            assert code == 1, err
            rows = {d["url"]: d for d in json.loads(out)["deployments"]}
            assert {u: rows[u]["exit_code"] for u in plains | specs} == {
                plain_a: 0, plain_b: 0, spec_a: 1, spec_b: 1,
            }  # fmt: skip
            assert "fx, fx-spec" in rows[spec_a]["name"]  # one check per server

            pb.stop()  # mid-test: a plain deployment dies
            for _ in range(6):
                r = c.post("/v1/chat/completions", json=_body())
                assert r.status_code == 200, r.text
                assert _base(r) == plain_a and r.headers["x-specaudit-placeholders"] == "0"
                content = r.json()["choices"][0]["logprobs"]["content"]
                assert all(_real(e) for e in content)
            entries, _ = _stream(c)
            assert entries and all(_real(e) for e in entries)

            # no plain deployment in the group: a clear 503, never a placeholder
            r = c.post("/v1/chat/completions", json=_body(model="fx-spec"))
            assert r.status_code == 503, r.text
            msg = r.json()["error"]["message"]
            assert "asks for logprobs" in msg and "speculates" in msg
            with c.stream("POST", "/v1/chat/completions", json=_body(True, model="fx-spec")) as s:
                text = s.read().decode()
                assert s.status_code == 503 or "asks for logprobs" in text, text[:500]
                assert '"logprob"' not in text
            r = c.post("/v1/chat/completions", json=_body(logprobs=False, model="fx-spec"))
            assert r.status_code == 200 and _base(r) in specs
    # the proxy stopped cleanly: no pending task left behind, no failed check in its log
    log = cfg.with_suffix(".log").read_text(errors="replace")
    assert "Task was destroyed but it is pending" not in log
    assert "specaudit: role check failed" not in log
