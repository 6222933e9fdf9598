"""`specaudit.llama_cpp_python` without building anything: where the cached wheel is looked
for, the server's command line, and the module's usage line."""

from __future__ import annotations

from pathlib import Path

import pytest

from specaudit import llama_cpp_python as lcp
from specaudit.errors import ServerError


def test_cached_wheel_is_found_under_the_cache_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path))
    assert lcp.cached_wheel("9.9.9") is None
    d = lcp.wheel_dir("9.9.9")
    assert d == tmp_path / "llama-cpp-python" / "9.9.9"
    d.mkdir(parents=True)
    w = d / "llama_cpp_python-9.9.9-py3-none-linux_x86_64.whl"
    w.write_bytes(b"")
    assert lcp.cached_wheel("9.9.9") == w


def test_server_argv_binds_loopback_and_speculates(tmp_path: Path) -> None:
    srv = lcp.LlamaCppPythonServer(tmp_path / "target.gguf", log_path=tmp_path / "log")
    srv.port = 4321
    argv = srv.argv()
    assert argv[1:3] == ["-m", "llama_cpp.server"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "4321"
    assert argv[argv.index("--draft_model") + 1] == lcp.PROMPT_LOOKUP
    assert argv[argv.index("--logits_all") + 1] == "true"
    plain = lcp.LlamaCppPythonServer(tmp_path / "target.gguf", draft=None).argv()
    assert "--draft_model" not in plain


def test_missing_model_is_a_server_error(tmp_path: Path) -> None:
    srv = lcp.LlamaCppPythonServer(tmp_path / "nope.gguf", log_path=tmp_path / "log")
    with pytest.raises(ServerError, match="model file not found"), srv:
        pass


def test_main_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert lcp.main(["frobnicate"]) == 2
    assert "usage: python -m specaudit.llama_cpp_python install" in capsys.readouterr().err
