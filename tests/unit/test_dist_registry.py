"""The engine registry: an engine added as one module plus one `register` call runs through
`specaudit dist` (its name, its own option, its checks) with no other edit; the built-in
entries say what they need, and the request checks that in one place."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from specaudit import distribution
from specaudit.distribution import registry

CliFn = Callable[..., tuple[int, str, str]]
SMALL = (
    "--tokens", "3", "--positions", "2", "--joint", "2", "--tolerance", "0.2",
    "--sequential", "--seeds", "3000", "--json",
)  # fmt: skip


def test_a_registered_engine_runs_through_the_cli(toy: None, cli: CliFn) -> None:
    code, out, err = cli("dist", "--engine", "toy", *SMALL)
    assert code == 0, err
    (eng,) = json.loads(out)["engines"]
    assert eng["kind"] == "toy" and eng["engine"] == "toy (exact)"
    assert eng["verdict"] == "WITHIN TOLERANCE"


def test_an_engines_own_option_reaches_its_build(toy: None, cli: CliFn) -> None:
    code, out, err = cli("dist", "--engine", "toy", "--toy-mode", "greedy", *SMALL)
    assert code == 1, err
    (eng,) = json.loads(out)["engines"]
    assert eng["engine"] == "toy (greedy)" and eng["verdict"] == "BROKEN"


def test_an_engines_option_applies_to_that_engine_only(toy: None, cli: CliFn) -> None:
    code, _, err = cli(
        "dist", "--engine", "url", "--url", "http://127.0.0.1:9", "--toy-mode", "greedy"
    )
    assert code == 2 and "--toy-mode applies to the toy engine only" in err
    code, _, err = cli("dist", "--engine", "toy", "--toy-mode", "loud")
    assert code == 2 and "'loud' is not one of" in err


def test_help_lists_a_registered_engine_and_its_option(toy: None, cli: CliFn) -> None:
    code, out, _ = cli("dist", "--help")
    assert code == 0 and "|toy]" in out and "--toy-mode [exact|greedy]" in out
    assert "toy: an in-memory sampler" in " ".join(out.split())


def test_an_unregistered_engine_is_a_usage_error(cli: CliFn) -> None:
    assert "toy" not in registry.names()
    code, _, err = cli("dist", "--engine", "toy")
    assert code == 2 and "'toy' is not one of" in err
    with pytest.raises(distribution.DistError, match="unknown engine 'toy'"):
        distribution.make_request(["toy"])


def test_the_builtin_entries_declare_what_they_need() -> None:
    e = {x.name: x for x in registry.entries()}
    assert list(e) == ["server", "speculative-example", "url", "openai", "transformers", "openvino"]
    assert registry.binary_engines() == ("server", "speculative-example")
    assert registry.url_engines() == ("url", "openai")
    assert e["transformers"].extra == "transformers"
    assert [o.flag for o in e["server"].options] == ["--path"]
    assert [o.flag for o in e["transformers"].options] == ["--generator"]
    assert e["openvino"].extra == "openvino"
    assert [o.flag for o in e["openvino"].options] == ["--ov-path", "--ov-logprobs"]


def test_two_engines_cannot_share_an_option() -> None:
    server = registry.get("server")
    clash = registry.EngineEntry("clash", server.build, options=server.options)
    with pytest.raises(ValueError, match="already server's"):
        registry.register(clash)
    assert "clash" not in registry.names()


def test_a_request_is_frozen_and_carries_the_engines_options(tmp_path: Path) -> None:
    req = distribution.make_request(
        ["server", "server"], work_dir=tmp_path, seeds=5, paths=["greedy"]
    )
    assert req.engines == ("server",) and req.option("paths") == ("greedy",)
    assert req.option("generators") is None and req.seed_range == range(1, 6)
    with pytest.raises(AttributeError):
        req.seeds = 6  # type: ignore[misc]  # assigning to the frozen request on purpose
    with pytest.raises(TypeError, match="unexpected keyword argument 'pathz'"):
        distribution.make_request(["server"], work_dir=tmp_path, pathz=["greedy"])


def test_run_takes_the_request_as_it_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`run` checks nothing again: the request was checked when it was made."""
    from types import SimpleNamespace

    from specaudit.distribution import builtin, request, runner

    req = distribution.make_request(["url"], url="http://127.0.0.1:9", work_dir=tmp_path, seeds=5)

    def again(*a: object, **k: object) -> None:
        raise AssertionError("checked again")

    for module in (request, runner):
        for name in ("make_request", "make_workload", "load_fixture", "url_list"):
            monkeypatch.setattr(module, name, again)
    monkeypatch.setattr(builtin, "ServerEngine", lambda *a, **k: SimpleNamespace(label="u"))
    monkeypatch.setattr(
        runner, "measure", lambda eng, spec, wl, seeds, **k: SimpleNamespace(seeds=seeds)
    )
    (res,) = distribution.run(req).engines
    assert isinstance(res, SimpleNamespace)  # what the stand-in `measure` returned
    assert res.seeds == range(1, 6)
