"""Issue 7's proof, by specaudit's own instruments, against the real patched llama-server.

The per-token equality with the plain server is in test_patch_equality.py; here `check`,
`ab` and `dist` judge the patched speculating server exactly as they judge the stock one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from specaudit import ab, check, distribution, fixtures
from specaudit.audit import AuditContext
from specaudit.audit.sections import patched
from specaudit.stats import Verdict

CliFn = Callable[..., tuple[int, str, str]]


def _url(server: Callable[[str], Any], name: str) -> str:
    return str(server(name).url)


def test_check_exits_0_on_every_endpoint_of_the_patched_fixture_server(
    server: Callable[[str], Any], fixture_set: fixtures.FixtureSet, cli: CliFn
) -> None:
    url = _url(server, "fixture-spec-patched")
    code, out, err = cli("check", url, "--prompt", fixture_set.spec.prompt, "--json")
    assert code == 0, out[-3000:] + err[-1000:]
    data = json.loads(out)
    assert data["verdict"] == "real"
    eps = data["endpoints"]
    # all four request kinds, streamed and not, answered with real values only
    assert {(e["kind"], e["stream"]) for e in eps if e["status"] == "ok"} == {
        (k, s) for k in check.PROBE_KINDS for s in (False, True)
    }
    assert all(e["placeholder"] == 0 and e["real"] > 0 for e in eps)
    # and it really speculated while doing so
    assert data["speculation"]["state"] == "yes"
    assert (data["speculation"]["draft_n"] or 0) > 0


@pytest.mark.gemma
def test_check_on_patched_gemma_chat_is_real(server: Callable[[str], Any]) -> None:
    stock = check.run(_url(server, "gemma-spec"), endpoint="chat", tokens=24)
    patched = check.run(_url(server, "gemma-spec-patched"), endpoint="chat", tokens=24)
    assert stock.exit_code == 1 and stock.placeholders > 0
    assert patched.exit_code == 0 and patched.placeholders == 0
    assert (patched.speculation.draft_n or 0) > 0


def test_ab_patched_spec_against_plain_is_consistent(
    server: Callable[[str], Any], fixture_set: fixtures.FixtureSet
) -> None:
    settings = ab.Settings(seeds=5, tokens=32, prompt=fixture_set.spec.prompt, endpoint="chat")
    res = ab.run(_url(server, "fixture-plain"), _url(server, "fixture-spec-patched"), settings)
    assert res.spec.coverage == 1.0 and res.plain.coverage == 1.0
    assert res.verdict.kind is ab.ABVerdict.CONSISTENT, res.verdict.message
    # consistent *while speculating*: a patched server that stopped drafting would pass above
    assert res.spec.speculative is True
    assert (res.spec.draft_n or 0) > 0 and (res.spec.draft_n_accepted or 0) > 0
    assert not res.plain.draft_n


def test_dist_on_the_patched_server_is_still_preserved(
    server: Callable[[str], Any], fixture_set: fixtures.FixtureSet
) -> None:
    spec = fixture_set.spec
    wl = distribution.make_workload(spec)
    eng = distribution.ServerEngine(
        _url(server, "fixture-spec-patched"), spec, wl, label="patched", kind="server-spec"
    )
    res = distribution.measure(eng, spec, wl, list(range(1, 1001)))
    assert res.verdict is Verdict.PRESERVED
    # preserved *while speculating*: every sample went through drafting and verification
    assert (res.drafted or 0) > 0 and (res.accepted or 0) > 0


@pytest.mark.gemma
def test_patched_audit_section(audit_ctx: AuditContext) -> None:
    sec = patched.section(audit_ctx)
    assert sec.status == "ok", sec.summary
    rows = sec.data["check"]
    assert len(rows) == len(patched.PAIRS)  # one row per pair: none left out of the checks
    assert all(r["stock"][1] > 0 and r["patched"][1] == 0 for r in rows)
    assert all(r["stock_exit"] == 1 and r["patched_exit"] == 0 for r in rows)
