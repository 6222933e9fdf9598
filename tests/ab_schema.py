"""The `specaudit ab --json` schema checker, shared by tests/unit/test_ab_schema.py (which pins
the schema) and the integration tests (which check live `specaudit ab --json` output).

`doc_schema()` reads the path -> type table of docs/ab.md; `check_against(schema, results)`
fails if a result has a path the schema does not list, a value of another type, or (with
`require_all`) never shows a listed path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[1] / "docs" / "ab.md"


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
