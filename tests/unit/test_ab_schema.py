"""The `specaudit ab --json` schema: pinned here, documented in docs/ab.md, checked both ways.

`SCHEMA` below is the pin: changing the JSON means changing this test on purpose. The docs'
table must say exactly the same, and results built from real recorded responses must match
it (no unlisted path, every listed path present, every value of a listed type). The
integration tests run the same check on live `specaudit ab --json` output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ab_schema import check_against, doc_schema
from specaudit import ab
from specaudit.report import to_jsonable

DATA = Path(__file__).resolve().parents[1] / "data" / "responses"

_SIDE = {
    "": "object",
    ".side": "str",
    ".url": "str",
    ".speculative": "bool|null",
    ".slots": "int",
    ".responses": "int",
    ".tokens": "int",
    ".real": "int",
    ".placeholder": "int",
    ".unchecked": "int",
    ".coverage": "float",
    ".naive_mean": "float|null",
    ".naive_ci": "array|null",
    ".naive_ci[]": "float",
    ".real_mean": "float|null",
    ".real_ci": "array|null",
    ".real_ci[]": "float",
    ".draft_n": "int|null",
    ".draft_n_accepted": "int|null",
}
_DELTA = {
    ".name": "str",
    ".n": "int",
    ".mean": "float|null",
    ".ci_low": "float|null",
    ".ci_high": "float|null",
    ".p_value": "float|null",
    ".alternative": "str",
}

SCHEMA: dict[str, str] = {
    "schema_version": "int",
    "settings": "object",
    "settings.seeds": "int",
    "settings.tokens": "int",
    "settings.prompt": "str",
    "settings.temperature": "float",
    "settings.sampler_top_k": "int|null",
    "settings.top_logprobs": "int",
    "settings.endpoint": "str",
    "settings.first_seed": "int",
    "settings.confidence": "float",
    **{f"plain{k}": v for k, v in _SIDE.items()},
    **{f"spec{k}": v for k, v in _SIDE.items()},
    "delta_naive": "object",
    **{f"delta_naive{k}": v for k, v in _DELTA.items()},
    "delta_real": "object",
    **{f"delta_real{k}": v for k, v in _DELTA.items()},
    "verdict": "object",
    "verdict.kind": "str",
    "verdict.message": "str",
    "verdict.reasons": "array",
    "verdict.reasons[]": "str",
    "verdict.fault_test": "object|null",
    **{f"verdict.fault_test{k}": v for k, v in _DELTA.items()},
    "verdict.agreement_test": "object|null",
    **{f"verdict.agreement_test{k}": v for k, v in _DELTA.items()},
    "responses": "array",
    "responses[]": "object",
    "responses[].side": "str",
    "responses[].seed": "int",
    "responses[].text": "str",
    "responses[].n_predicted": "int|null",
    "responses[].tokens": "int",
    "responses[].real": "int",
    "responses[].placeholder": "int",
    "responses[].unchecked": "int",
    "responses[].coverage": "float",
    "responses[].naive_mean": "float|null",
    "responses[].real_mean": "float|null",
    "responses[].draft_n": "int|null",
    "responses[].draft_n_accepted": "int|null",
    "responses[].token_texts": "array",
    "responses[].token_texts[]": "str",
    "responses[].reported_logprobs": "array",
    "responses[].reported_logprobs[]": "float|null",
    "responses[].real_logprobs": "array",
    "responses[].real_logprobs[]": "float|null",
    "local": "object|null",
    "local.model": "str",
    "local.draft": "str|null",
    "local.spec_type": "str",
    "local.parallel": "int",
    "local.ctx_size": "int",
    "local.binaries": "str",
    "plot": "str|null",
    "seconds": "float",
}


def recorded_results() -> list[dict[str, Any]]:
    """Results analysed from real recorded Gemma responses: a fault run and a 1-seed run."""
    out = []
    for endpoint in ("chat", "completion"):
        rs = []
        for side, name in (("plain", "plain"), ("spec", "spec-draft-simple")):
            body = json.loads((DATA / f"ab-gemma-{endpoint}-{name}-12tok-seed1.json").read_text())
            for seed in (1, 2):  # the same recorded answer stands in for two seeds
                rs.append(ab.parse_response(side, seed, endpoint, body, 3))
        # make seed 2 differ a little so the intervals are not points
        rs[1].naive_mean = (rs[1].naive_mean or 0.0) - 0.05
        rs[1].real_mean = (rs[1].real_mean or 0.0) - 0.05
        local = {
            "model": "/m.gguf",
            "draft": None if endpoint == "chat" else "/m.gguf",
            "spec_type": "draft-simple",
            "parallel": 2,
            "ctx_size": 1024,
            "binaries": "/bin",
        }
        res = ab.analyse(
            ab.Settings(seeds=2, tokens=12, endpoint=endpoint),
            rs,
            {"plain": "http://127.0.0.1:1", "spec": "http://127.0.0.1:2"},
            {"plain": (2, False), "spec": (2, True)},
            seconds=1.5,
            local=local,
        )
        res.plot = Path("/tmp/ab.png") if endpoint == "chat" else None
        out.append(to_jsonable(res))
    # one seed only: intervals and p-values are null, verdict inconclusive with reasons
    one = [
        ab.parse_response(side, 1, "chat", json.loads((DATA / f).read_text()), 3)
        for side, f in (
            ("plain", "ab-gemma-chat-plain-12tok-seed1.json"),
            ("spec", "ab-gemma-chat-spec-draft-simple-12tok-seed1.json"),
        )
    ]
    single = ab.analyse(
        ab.Settings(seeds=1, tokens=12), one, {"plain": "http://a", "spec": "http://b"}
    )
    out.append(to_jsonable(single))
    return out


def test_docs_table_is_the_pinned_schema() -> None:
    assert doc_schema() == SCHEMA


def test_recorded_results_match_the_schema() -> None:
    results = recorded_results()
    assert results[0]["verdict"]["kind"] == "instrument fault"
    assert results[-1]["verdict"]["kind"] == "inconclusive"
    check_against(SCHEMA, results)


def test_schema_version() -> None:
    assert ab.SCHEMA_VERSION == 1
    assert recorded_results()[0]["schema_version"] == 1


def test_checker_catches_drift() -> None:
    res = recorded_results()
    check_against(SCHEMA, res)  # the baseline passes: each failure below is the drift's own
    extra = json.loads(json.dumps(res[0]))
    extra["plain"]["new_key"] = 1
    with pytest.raises(AssertionError, match=r"not in the schema: \['plain.new_key'\]"):
        check_against(SCHEMA, [*res, extra])
    retyped = json.loads(json.dumps(res[0]))
    retyped["settings"]["seeds"] = "5"
    with pytest.raises(AssertionError, match=r"settings.seeds: saw \['int', 'str'\]"):
        check_against(SCHEMA, [*res, retyped])
    with pytest.raises(AssertionError, match=r"never seen in the JSON: \['ghost'\]"):
        check_against({**SCHEMA, "ghost": "int"}, res)
