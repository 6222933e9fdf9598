"""`specaudit check` without llama-server: the whole pipeline over *replayed* real responses
(tests/data/responses/check-*.json) for parsing, and small canned servers (tests/fakes.py,
answered through the client's transport, no socket) for the error paths, which run the real
CLI in-process (exit 2, one `error:` line, no traceback)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fakes import Answer, Asked, Canned, route_clients
from specaudit import check
from specaudit.llama.server import free_port

DATA = Path(__file__).parents[1] / "data" / "responses"
CliFn = Callable[..., tuple[int, str, str]]
NOT_FOUND = b'{"error": {"code": 404, "message": "Not Found"}}'
FILE_NOT_FOUND = b'{"error": {"code": 404, "message": "File Not Found"}}'


def _replay_handler(name: str, slots: bool = True, strip_logprobs: bool = False) -> Canned:
    """Answers like the recorded llama-server did (responses are real, only replayed)."""
    rec = json.loads((DATA / f"check-{name}.json").read_text())
    paths = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

    def handle(asked: Asked) -> Answer:
        if asked.method == "GET":
            if asked.path == "/slots" and slots:
                return Answer.json(rec["slots"])
            if asked.path == "/props":
                return Answer.json(rec["props"])
            return Answer(FILE_NOT_FOUND, 404)
        body = asked.json()
        kind = paths.get(asked.path)
        if asked.path == "/completion":
            kind = "native-post" if body.get("post_sampling_probs") else "native"
        if kind is None or kind not in rec:
            return Answer(NOT_FOUND, 404)
        if body.get("stream"):
            text = rec[kind]["stream_sse"]
            if strip_logprobs:
                lines = []
                for ln in text.splitlines():
                    if ln.startswith("data: {"):
                        ev = json.loads(ln[6:])
                        for ch in ev.get("choices", []):
                            ch.pop("logprobs", None)
                        ev.pop("completion_probabilities", None)
                        ln = "data: " + json.dumps(ev)
                    lines.append(ln)
                text = "\n".join(lines) + "\n"
            return Answer(text.encode(), content_type="text/event-stream")
        resp = json.loads(json.dumps(rec[kind]["response"]))
        if strip_logprobs:
            for ch in resp.get("choices", []):
                ch["logprobs"] = None
            resp.pop("completion_probabilities", None)
        return Answer.json(resp)

    return handle


@pytest.fixture
def replay(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    return route_clients(monkeypatch, _replay_handler(**request.param))


# ---------------------------------------------------------------------------------------------
# the pipeline over replayed real responses


@pytest.mark.parametrize("replay", [{"name": "gemma-spec"}], indirect=True)
def test_replayed_speculating_server(replay: str) -> None:
    r = check.run(replay, prompt="Explain how a CPU branch predictor works.")
    assert r.exit_code == 1 and r.verdict == "placeholders"
    assert len(r.endpoints) == 8 and all(e.status == "ok" for e in r.endpoints)
    assert r.placeholders_by_endpoint() == {
        f"{k}{s}": 23 for k in check.PROBE_KINDS for s in ("", " (stream)")
    }
    assert all(e.real == 1 and e.first_real and e.total == 24 for e in r.endpoints)
    sp = r.speculation
    assert sp.state == "yes" and sp.hidden
    assert "/props says speculative.types none; /slots says 2/2 slots speculate" in sp.summary
    assert sp.request_types == "none,draft-simple"
    assert sp.draft_n is not None and sp.draft_n > 0
    assert r.switch is not None and r.switch.verdict == "ignored"  # replay ignores it too


@pytest.mark.parametrize("replay", [{"name": "gemma-plain"}], indirect=True)
def test_replayed_plain_server(replay: str) -> None:
    r = check.run(replay)
    assert r.exit_code == 0 and r.verdict == "real" and r.placeholders == 0
    assert r.real == 8 * 24
    assert r.speculation.state == "no" and not r.speculation.hidden
    assert r.switch is None
    assert all(e.draft_n is None for e in r.endpoints)


@pytest.mark.parametrize("replay", [{"name": "fixture-spec", "slots": False}], indirect=True)
def test_no_slots_means_unknown_but_logprobs_still_checked(replay: str) -> None:
    r = check.run(replay, endpoint="chat", prompt="bcdbc", tokens=8)
    assert r.exit_code == 1 and r.placeholders == 14
    # drafted tokens in the timings still show it speculates
    assert r.speculation.slots_total is None and r.speculation.state == "yes"
    assert "no /slots endpoint" in r.speculation.summary


@pytest.mark.parametrize(
    "replay", [{"name": "fixture-plain", "slots": False, "strip_logprobs": True}], indirect=True
)
def test_server_that_ignores_logprobs_is_no_decision(replay: str) -> None:
    with pytest.raises(check.CheckError, match="no logprobs"):
        check.run(replay, prompt="bcdbc", tokens=8)


@pytest.mark.parametrize("replay", [{"name": "gemma-ngram"}], indirect=True)
def test_replayed_ngram_mixture(replay: str) -> None:
    r = check.run(replay, endpoint="chat", temperature=0.0, tokens=48)
    for e in r.endpoints:
        assert (e.total, e.real, e.placeholder, e.server_tokens) == (48, 18, 30, 48)
    assert r.exit_code == 1


@pytest.mark.parametrize("replay", [{"name": "gemma-ngram"}], indirect=True)
def test_absent_endpoints_are_listed_not_fatal(replay: str) -> None:
    # the recording has only the chat endpoint: the others answer 404 like a non-llama server
    r = check.run(replay, temperature=0.0, tokens=48, stream=True)
    assert [e.status for e in r.endpoints] == ["ok", "absent", "absent", "absent"]
    assert r.exit_code == 1
    assert r.reason.endswith("; absent: /v1/completions, /completion")
    # only streamed requests ran, so the switch probe sent its own non-streamed pair
    assert r.switch is not None and r.switch.kind == "chat" and r.switch.verdict == "ignored"


@pytest.mark.parametrize("replay", [{"name": "gemma-spec"}], indirect=True)
def test_cli_json_over_replay(cli: CliFn, replay: str) -> None:
    code, out, err = cli("check", replay, "--endpoint", "completion", "--no-stream", "--json")
    assert code == 1, err
    body = json.loads(out)
    assert body["verdict"] == "placeholders" and body["exit_code"] == 1
    assert body["placeholders_by_endpoint"] == {"completions": 23, "native": 23, "native-post": 23}
    tok = body["endpoints"][0]["tokens"][1]
    assert tok["klass"] == "placeholder" and tok["logprob"] is None and tok["reported_logprob"] == 0


def test_request_bodies() -> None:
    s = check.CheckSettings(top_k=5, tokens=7, prompt="p", seed=3, temperature=0.5, model="m")
    chat = check.request_body("chat", s)
    assert chat["logprobs"] is True and chat["top_logprobs"] == 5 and chat["max_tokens"] == 7
    assert chat["messages"] == [{"role": "user", "content": "p"}] and chat["model"] == "m"
    assert check.request_body("completions", s)["logprobs"] == 5
    nat = check.request_body("native", s)
    assert nat["n_probs"] == 5 and nat["n_predict"] == 7 and nat["post_sampling_probs"] is False
    assert check.request_body("native-post", s)["post_sampling_probs"] is True
    assert {"seed": 3, "temperature": 0.5}.items() <= nat.items()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"endpoint": "nope"}, "unknown endpoint 'nope'"),
        ({"top_k": 0}, "--top-k must be at least 1"),
        ({"tokens": 1}, "--tokens must be at least 2"),
    ],
)
def test_bad_options_raise(kwargs: dict[str, Any], message: str) -> None:
    # Port 1 is closed: had validation not fired first, the error would be about connecting.
    with pytest.raises(check.CheckError, match=message):
        check.run("http://127.0.0.1:1", **kwargs)


# ---------------------------------------------------------------------------------------------
# error paths through the real CLI (in-process, the shared `cli` fixture)


def _no_decision(cli: CliFn, url: str, *extra: str) -> str:
    """Runs ``specaudit check URL``; asserts exit 2 with one ``error:`` line and returns it."""
    code, out, err = cli("check", url, "--timeout", "10", *extra)
    assert code == 2, (code, out, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err and "Traceback" not in out
    return lines[0]


def _always(status: int, body: bytes, ctype: str) -> Canned:
    return lambda asked: Answer(body, status, ctype)


def _web_site(root: Path) -> Canned:
    """A plain static web site, as `python -m http.server` answers: files for GET, 404 for
    anything else asked for, 501 for other methods."""

    def handle(asked: Asked) -> Answer:
        if asked.method != "GET":
            return Answer(b"<html>Unsupported method</html>", 501, "text/html")
        f = root / (asked.path.lstrip("/") or "index.html")
        if f.parent == root and f.is_file():
            return Answer(f.read_bytes(), content_type="text/html")
        return Answer(b"<html>File not found</html>", 404, "text/html")

    return handle


def test_closed_port(cli: CliFn) -> None:
    line = _no_decision(cli, f"http://127.0.0.1:{free_port()}")
    assert "cannot connect" in line


def test_server_answering_500(cli: CliFn, monkeypatch: pytest.MonkeyPatch) -> None:
    canned = _always(500, b"internal error\nwith a second line", "text/plain")
    line = _no_decision(cli, route_clients(monkeypatch, canned))
    assert "HTTP 500" in line


def test_server_answering_non_json(cli: CliFn, monkeypatch: pytest.MonkeyPatch) -> None:
    canned = _always(200, b"<html><body>hello</body></html>", "text/html")
    line = _no_decision(cli, route_clients(monkeypatch, canned))
    assert "non-JSON" in line


def test_plain_http_server_without_llm_endpoints(
    cli: CliFn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "index.html").write_text("<html>just a web site</html>")
    site = _web_site(tmp_path)
    assert site(Asked("GET", "/")).body == b"<html>just a web site</html>"
    url = route_clients(monkeypatch, site)
    line = _no_decision(cli, url)
    assert "not an LLM server" in line
    # a single endpoint asked for, same answer
    line = _no_decision(cli, url, "--endpoint", "chat")
    assert "not an LLM server" in line


def test_bad_option_is_exit_2_one_line(cli: CliFn) -> None:
    # Port 1 is closed: had validation not fired first, the error would be about connecting.
    line = _no_decision(cli, "http://127.0.0.1:1", "--top-k", "0")
    assert "Invalid value for '--top-k'" in line and "cannot connect" not in line
