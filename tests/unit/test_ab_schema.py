"""The `specaudit ab --json` schema: pinned here, documented in docs/ab.md, checked both ways.

`SCHEMA` below is the pin: changing the JSON means changing this test on purpose. The docs'
table must say exactly the same, and results built from real recorded responses must match
it (no unlisted path, every listed path present, every value of a listed type). The
integration tests run the same check on live `specaudit ab --json` output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from specaudit import ab
from specaudit.report import to_jsonable

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ab.md"
DATA = ROOT / "tests" / "data" / "responses"

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


def doc_schema(text: str | None = None) -> dict[str, str]:
    """The path -> type table between the schema markers of docs/ab.md."""
    text = text if text is not None else DOC.read_text()
    block = text.split("<!-- schema:start -->", 1)[1].split("<!-- schema:end -->", 1)[0]
    out: dict[str, str] = {}
    for line in block.splitlines():
        m = re.match(r"^\| `([^`]+)` \| ([^|]+(?:\\\|[^|]+)*) \|", line)
        if m:
            out[m.group(1)] = "|".join(t.strip() for t in m.group(2).split("\\|"))
    return out


def _type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    raise AssertionError(f"not a JSON value: {v!r}")


def flatten(
    obj: Any, path: str = "", out: dict[str, set[str]] | None = None
) -> dict[str, set[str]]:
    """path -> set of JSON types seen there (``a.b`` keys, ``a[]`` array elements)."""
    out = {} if out is None else out
    if path:
        out.setdefault(path, set()).add(_type(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, f"{path}.{k}" if path else k, out)
    elif isinstance(obj, list):
        for v in obj:
            flatten(v, f"{path}[]", out)
    return out


def check_against(schema: dict[str, str], instances: list[Any], require_all: bool = True) -> None:
    """Every seen path listed with a compatible type; every listed path seen somewhere.

    `require_all=False` (one live result) only requires the top-level keys: an empty array
    or a null object legitimately hides the paths below it.
    """
    seen: dict[str, set[str]] = {}
    for inst in instances:
        for p, types in flatten(json.loads(json.dumps(inst))).items():
            seen.setdefault(p, set()).update(types)
    unlisted = sorted(set(seen) - set(schema))
    assert not unlisted, f"paths in the JSON but not in the schema: {unlisted}"
    for p, types in seen.items():
        allowed = set(schema[p].split("|"))
        if "float" in allowed:
            allowed.add("int")  # an integral float value may serialise as an int
        assert types <= allowed, f"{p}: saw {sorted(types)}, schema says {schema[p]}"
    wanted = set(schema) if require_all else {p for p in schema if "." not in p and "[" not in p}
    missing = sorted(wanted - set(seen))
    assert not missing, f"schema paths never seen in the JSON: {missing}"


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
    extra = json.loads(json.dumps(res[0]))
    extra["plain"]["new_key"] = 1
    retyped = json.loads(json.dumps(res[0]))
    retyped["settings"]["seeds"] = "5"
    for bad in (extra, retyped):
        try:
            check_against(SCHEMA, [*res, bad])
        except AssertionError:
            continue
        raise AssertionError("schema drift went unnoticed")
    try:
        check_against({**SCHEMA, "ghost": "int"}, res)
    except AssertionError:
        pass
    else:
        raise AssertionError("a documented path that never appears went unnoticed")
