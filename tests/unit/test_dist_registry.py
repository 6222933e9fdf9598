"""The engine registry: an engine shipped as a package (one module with the registry's hook,
named by an entry point of ``specaudit.engines``) runs through `specaudit dist` (its name, its
own option, its checks) with no other edit; plug-ins load once, when the table is first read,
without the engines' extras, and a broken one is one line naming it; the built-in entries say
what they need, and the request checks that in one place."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine_package import install_engine_package
from specaudit import distribution
from specaudit.distribution import registry

CliFn = Callable[..., tuple[int, str, str]]
SRC = Path(__file__).resolve().parents[2] / "src"
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
    assert list(e) == [
        "server", "speculative-example", "url", "openai", "transformers", "openvino", "vllm",
    ]  # fmt: skip
    assert registry.binary_engines() == ("server", "speculative-example")
    assert registry.url_engines() == ("url", "openai")
    assert e["transformers"].extra == "transformers"
    assert [o.flag for o in e["server"].options] == ["--path"]
    assert [o.flag for o in e["transformers"].options] == ["--generator"]
    assert e["openvino"].extra == "openvino"
    assert [o.flag for o in e["openvino"].options] == ["--ov-path", "--ov-logprobs"]
    assert [o.flag for o in e["vllm"].options] == [
        "--vllm-url",
        "--vllm-fix",
        "--vllm-logprobs-mode",
        "--vllm-method",
    ]


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

    from specaudit.distribution import llamacpp, request, runner

    req = distribution.make_request(["url"], url="http://127.0.0.1:9", work_dir=tmp_path, seeds=5)

    def again(*a: object, **k: object) -> None:
        raise AssertionError("checked again")

    for module in (request, runner):
        for name in ("make_request", "make_workload", "load_fixture", "url_list"):
            monkeypatch.setattr(module, name, again)
    monkeypatch.setattr(llamacpp, "ServerEngine", lambda *a, **k: SimpleNamespace(label="u"))
    monkeypatch.setattr(
        runner, "measure", lambda eng, spec, wl, seeds, **k: SimpleNamespace(seeds=seeds)
    )
    (res,) = distribution.run(req).engines
    assert isinstance(res, SimpleNamespace)  # what the stand-in `measure` returned
    assert res.seeds == range(1, 6)


# ------------------------------------------------------------------ engines as packages


def test_an_engine_installed_as_a_package_runs_through_dist(toy: None, tmp_path: Path) -> None:
    """The toy is nowhere in specaudit: only its package's entry point names it."""
    req = distribution.make_request(
        ["toy"], work_dir=tmp_path, tokens=3, positions=2, joint=2, tolerance=0.2,
        sequential=True, seeds=3000, toy_modes=["greedy"],
    )  # fmt: skip
    (eng,) = distribution.run(req).engines
    assert eng.engine == "toy (greedy)" and eng.verdict.value == "BROKEN"
    assert registry.names() == (
        "server", "speculative-example", "url", "openai", "transformers", "openvino", "vllm",
        "toy",
    )  # fmt: skip


def _install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, target: str, source: str | None = None
) -> None:
    """A package `specaudit-extra` whose entry point ``extra`` names `target`; `source`: the
    module ``extra_engine`` it ships."""
    modules = {"extra_engine": source} if source is not None else {}
    site = install_engine_package(tmp_path / "site", "specaudit-extra", {"extra": target}, modules)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "extra_engine", raising=False)
    registry.reset()


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Whatever a test installs is forgotten afterwards (the next read loads again)."""
    yield
    registry.reset()
    sys.modules.pop("extra_engine", None)


def test_an_entry_point_may_name_the_hook_itself(
    clean_registry: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cli: CliFn
) -> None:
    _install(monkeypatch, tmp_path, "toy_engine:register_engines")
    monkeypatch.delitem(sys.modules, "toy_engine", raising=False)
    code, out, err = cli("dist", "--engine", "toy", *SMALL)
    assert code == 0, err
    assert json.loads(out)["engines"][0]["engine"] == "toy (exact)"


PLUGIN_COUNTING = """
CALLS = []


def register_engines(register):
    CALLS.append(register)
"""


def test_plug_ins_are_loaded_once_when_the_table_is_first_read(
    clean_registry: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _install(monkeypatch, tmp_path, "extra_engine", PLUGIN_COUNTING)
    assert "extra_engine" not in sys.modules  # reset and installed: nothing loaded yet
    registry.get("server")
    registry.names()
    registry.options()
    calls = sys.modules["extra_engine"].CALLS
    assert len(calls) == 1  # one hook call, with a register of its own


BROKEN_PLUGINS = [
    ("no_such_module_here", None, "could not be loaded: ModuleNotFoundError"),
    ("extra_engine", "X = 1\n", "has no register_engines(register) hook"),
    ("extra_engine", "raise RuntimeError('a\\nb')\n", "could not be loaded: RuntimeError: a b"),
    (
        "extra_engine",
        "def register_engines(register):\n    raise KeyError('oops')\n",
        "register_engines failed: KeyError: 'oops'",
    ),
    (
        "extra_engine",
        "from specaudit.distribution import llamacpp\n\n"
        "def register_engines(register):\n    register(llamacpp.URL)\n",
        "registers engine 'url', which specaudit.distribution.llamacpp registered",
    ),
    (
        "extra_engine",
        "def register_engines(register):\n    register('toy')\n",
        "TypeError: register() takes an EngineEntry, not str",
    ),
]


@pytest.mark.parametrize(("target", "source", "why"), BROKEN_PLUGINS)
def test_a_plug_in_that_cannot_register_is_one_line_naming_it(
    clean_registry: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    cli: CliFn,
    target: str,
    source: str | None,
    why: str,
) -> None:
    _install(monkeypatch, tmp_path, target, source)
    with pytest.raises(distribution.DistError) as ei:
        registry.names()
    msg = str(ei.value)
    assert msg.startswith(f"engine plug-in 'extra' ({target}, from specaudit-extra 0.1)")
    assert why in msg and "\n" not in msg
    with pytest.raises(distribution.DistError, match="engine plug-in 'extra'"):
        registry.get("url")  # nothing half-registered: the next read tries again, and fails
    code, out, err = cli("dist", "--engine", "url", "--url", "http://127.0.0.1:9")
    assert code == 2 and err.strip() == f"error: {msg}", err


def test_reading_the_registry_imports_no_engine_extra() -> None:
    """torch, transformers and openvino are imported when their engine runs, not before."""
    code = (
        "import sys\n"
        "from specaudit.distribution import registry\n"
        "assert registry.names()[-1] == 'vllm'\n"
        "print([m for m in ('torch', 'transformers', 'openvino', 'openvino_genai')"
        " if m in sys.modules])\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert out.strip() == "[]"
