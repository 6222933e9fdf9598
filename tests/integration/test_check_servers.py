"""`specaudit check` against real llama-server b11434: plain vs speculating fixture (every
endpoint, streamed and not, through the CLI), Gemma 3 270M plain vs speculating on the chat
endpoint (through the audit section), n-gram speculation mixing real and placeholder
tokens in one response, and each other n-gram type real with spec-logprobs."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from specaudit import audit, check
from specaudit.audit.sections import check as check_sections
from specaudit.client import JSON, Client, StreamResult
from specaudit.llama import presets

CliFn = Callable[..., tuple[int, str, str]]
ALL_LABELS = {f"{k}{s}" for k in check.PROBE_KINDS for s in ("", " (stream)")}
# Gemma copies this sentence over and over; the n-gram drafter only drafts repeated text.
NGRAM_PROMPT = "Write the sentence 'I will not talk in class.' ten times, one per line."


def _check_json(cli: CliFn, url: str, *args: str) -> tuple[int, dict[str, Any]]:
    code, out, err = cli("check", url, "--json", *args)
    assert code in (0, 1), err[-2000:]
    assert err == ""
    return code, json.loads(out)


def test_fixture_plain_every_logprob_real(server: Callable[..., Any], cli: CliFn) -> None:
    rc, body = _check_json(cli, server("fixture-plain").url, "--prompt", "bcdbc")
    assert rc == 0 and body["verdict"] == "real" and body["exit_code"] == 0
    assert body["placeholders_by_endpoint"] == dict.fromkeys(ALL_LABELS, 0)
    for e in body["endpoints"]:
        assert e["status"] == "ok", e
        assert e["total"] == e["real"] == e["server_tokens"] == 24
        assert all(t["candidates"] and t["klass"] == "real" for t in e["tokens"])
        assert e["draft_n"] is None
    assert body["speculation"]["state"] == "no" and body["switch"] is None


def test_fixture_spec_placeholders_everywhere(server: Callable[..., Any], cli: CliFn) -> None:
    rc, body = _check_json(cli, server("fixture-spec").url, "--prompt", "bcdbc")
    assert rc == 1 and body["verdict"] == "placeholders"
    by_ep = body["placeholders_by_endpoint"]
    assert set(by_ep) == ALL_LABELS and all(n > 0 for n in by_ep.values()), by_ep
    assert body["placeholders"] == sum(by_ep.values())
    for e in body["endpoints"]:
        assert e["real"] + e["placeholder"] == e["total"] == e["server_tokens"] == 24
        first = e["tokens"][0]
        assert first["index"] == 0 and first["klass"] == "real"  # the normal path
        ph = [t for t in e["tokens"] if t["klass"] == "placeholder"]
        assert all(t["logprob"] is None and t["candidates"] == [] for t in ph)
        # non-streamed placeholders say 0.0 (prob 1.0); streamed ones have no entry at all
        assert {t["reported_logprob"] for t in ph} == ({None} if e["stream"] else {0.0})
        assert e["draft_n"] > 0
    sp = body["speculation"]
    assert sp["state"] == "yes" and sp["hidden"] and sp["slots_speculative"] == 4
    assert "/props says speculative.types none; /slots says 4/4 slots speculate" in sp["summary"]
    # "speculative.n_max" is compiled out at b11434: the server drafts as much as before
    sw = body["switch"]
    assert sw["verdict"] == "ignored" and sw["draft_n_switch"] == sw["draft_n"] > 0


def test_fixture_spec_human_output(server: Callable[..., Any], cli: CliFn) -> None:
    code, out, err = cli(
        "check", server("fixture-spec").url, "--prompt", "bcdbc", "--endpoint", "chat",
        "--no-stream", "--tokens", "6",
    )  # fmt: skip
    assert code == 1, err
    assert "0 first" in out and "missing (sent 0)" in out
    assert "hidden speculation" in out and "verdict: placeholders" in out
    assert "per-request switch: ignored" in out


@pytest.mark.parametrize("ngram_type", list(presets.NGRAM_TYPE_ARGS))
def test_fixture_ngram_types_real_when_patched(
    server: Callable[..., Any], cli: CliFn, ngram_type: str
) -> None:
    """ngram-simple, ngram-map-k, ngram-map-k4v, ngram-cache: with spec-logprobs every token
    on every endpoint is real while the server drafts. (The stock control is in
    test_patch_equality: the session's stock n-gram servers keep their per-slot drafter state
    for the audit's dist section, so they are not probed here.)"""
    url = server(f"fixture-{ngram_type}-patched").url
    rc, body = _check_json(cli, url, "--prompt", "bcdbc")
    assert rc == 0 and body["verdict"] == "real", body["placeholders_by_endpoint"]
    assert body["placeholders_by_endpoint"] == dict.fromkeys(ALL_LABELS, 0)
    drafted = sum(e["draft_n"] or 0 for e in body["endpoints"])
    print(f"\n{ngram_type} patched: check exit {rc}, {drafted} tokens drafted over the probes")
    assert drafted > 0, f"{ngram_type} never drafted: nothing was checked under speculation"


@pytest.fixture(scope="module")
def check_section(audit_ctx: audit.AuditContext) -> audit.Section:
    return check_sections.section(audit_ctx)


@pytest.mark.gemma
def test_gemma_plain_vs_speculating_chat(check_section: audit.Section) -> None:
    plain, spec = check_section.data["gemma-plain"], check_section.data["gemma-spec"]
    assert isinstance(plain, check.CheckResult) and isinstance(spec, check.CheckResult)
    assert [e.label for e in plain.endpoints] == ["chat", "chat (stream)"]
    assert plain.exit_code == 0 and plain.placeholders == 0
    assert all(e.total == e.real == 24 for e in plain.endpoints)
    assert spec.exit_code == 1
    for e in spec.endpoints:
        # the report saw 23 of 24; the last token may come from the normal path
        assert e.total == 24 and e.tokens[0].klass.value == "real"
        assert e.placeholder >= 22, (e.label, e.placeholder)
    assert spec.speculation.hidden and spec.switch is not None
    assert spec.switch.verdict == "ignored"


@pytest.mark.gemma
def test_audit_section_table(check_section: audit.Section) -> None:
    assert check_section.key == "check" and check_section.status == "finding"
    md = check_section.markdown
    assert "| server | endpoint | stream | real | placeholder | verdict |" in md
    for name in check_sections.ROLES:
        assert f"| {name} |" in md
    fx = check_section.data["fixture-spec"]
    assert len(fx.endpoints) == 8 and all(e.placeholder > 0 for e in fx.endpoints)
    assert check_section.data["fixture-plain"].placeholders == 0


class RecordingClient(Client):
    """Keeps every body it received, to count placeholders independently of the library."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url, timeout=600)
        self.bodies: list[JSON] = []
        self.streams: list[StreamResult] = []

    def __enter__(self) -> RecordingClient:
        return self

    def post(self, path: str, body: JSON) -> JSON:
        r = super().post(path, body)
        self.bodies.append(r)
        return r

    def stream(self, path: str, body: JSON) -> StreamResult:
        r = super().stream(path, body)
        self.streams.append(r)
        return r


def _hand_count(body: JSON | None, stream: StreamResult | None) -> tuple[int, int]:
    """(real, placeholder) read straight off the wire."""
    if body is not None:
        content = body["choices"][0]["logprobs"]["content"]
        real = sum(1 for c in content if c["top_logprobs"])
        return real, len(content) - real
    assert stream is not None
    real = ph = 0
    for ev in stream.events:
        ch = ev["choices"][0] if ev.get("choices") else {}
        if ch.get("logprobs"):
            real += len(ch["logprobs"]["content"])
        elif ch.get("delta", {}).get("content"):
            ph += 1
    return real, ph


@pytest.mark.gemma
@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_ngram_mixes_real_and_placeholder(server: Callable[..., Any], stream: bool) -> None:
    s = check.CheckSettings(tokens=48, prompt=NGRAM_PROMPT, temperature=0.0)
    with RecordingClient(server("gemma-ngram").url) as c:
        r = check.probe(c, "chat", stream, s)
    assert r.status == "ok", r.error
    assert r.real + r.placeholder == r.total == r.server_tokens == 48
    assert r.placeholder > 0 and r.real > 1, (r.real, r.placeholder)
    assert r.tokens[0].klass.value == "real"
    assert any(t.klass.value == "real" for t in r.tokens[1:])  # real values after drafting too
    assert r.draft_n is not None and r.draft_n > 0
    wire = _hand_count(None if stream else c.bodies[0], c.streams[0] if stream else None)
    assert wire == (r.real, r.placeholder)
