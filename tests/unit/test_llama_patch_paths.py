"""Patches given as paths to .patch files, and bundled mutants (issue 12, items 4 and 5).

The fake-build machinery of test_llama_build_patches.py: a fake sdist in the test's own
SPECAUDIT_CACHE and fake cmake steps, so no compiler runs and ~/.cache is never touched.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fake_build import fake_cmake, install_sdist
from fake_build import patch_values as _p
from specaudit import distribution, llama
from specaudit.distribution import runner
from specaudit.errors import BuildError
from specaudit.llama import build, sources
from specaudit.llama import patches as catalogue
from specaudit.llama.patches import Patch
from specaudit.llama.server import LlamaServer

CliFn = Callable[..., tuple[int, str, str]]
B = 11434

PRISTINE = {
    "CMakeLists.txt": b"project(fake)\n",
    "src/a.c": b"".join(b"int a%d = %d;\n" % (i, i) for i in range(1, 21)),
    "src/b.c": b"int b1 = 1;\nint b2 = 2;\nint b3 = 3;\n",
    "src/spec.c": b"int s1 = 1;\nint s2 = 2;\nint s3 = 3;\n",
}

GOOD = """\
--- a/src/a.c
+++ b/src/a.c
@@ -1,3 +1,3 @@
 int a1 = 1;
-int a2 = 2;
+int a2 = 200;
 int a3 = 3;
"""

# A user's own patch: edits src/b.c
MINE = """\
--- a/src/b.c
+++ b/src/b.c
@@ -1,3 +1,3 @@
 int b1 = 1;
-int b2 = 2;
+int b2 = 42;
 int b3 = 3;
"""

# A bundled mutant: a description line, then the diff; touches a file no patch touches
MUTANT = """\
# s2 off by one: a deliberately wrong speculative path
--- a/src/spec.c
+++ b/src/spec.c
@@ -1,3 +1,3 @@
 int s1 = 1;
-int s2 = 2;
+int s2 = 3;
 int s3 = 3;
"""


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return install_sdist(
        tmp_path, monkeypatch, B, PRISTINE, {"good.patch": GOOD, "mutants/s2.patch": MUTANT}
    )


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, bytes]]:
    """Fake cmake: each "build" records the bytes of the tree it compiled and emits the targets."""
    return fake_cmake(monkeypatch, PRISTINE)


def _mine(tmp_path: Path, text: str = MINE, name: str = "mine.patch") -> Path:
    d = tmp_path / "user"
    d.mkdir(exist_ok=True)
    (d / name).write_text(text)
    return d / name


def _src() -> Path:
    return build.llama_dir() / "work" / f"b{B}" / "llama.cpp"


# ------------------------------------------------------------------------------ path patches


def test_a_path_patch_builds_its_own_variant_named_after_its_stem(
    tmp_path: Path, compiled: list[dict[str, bytes]]
) -> None:
    p = _mine(tmp_path)
    b = build.ensure(B, _p(str(p)))
    assert compiled[-1]["src/b.c"] == b"int b1 = 1;\nint b2 = 42;\nint b3 = 3;\n"
    assert compiled[-1]["src/a.c"] == PRISTINE["src/a.c"]
    assert b.variant.startswith("mine-") and len(b.variant) == len("mine-") + 12
    assert b.bin_dir.parent.name == f"b{B}-{b.variant}"
    info = json.loads((b.bin_dir.parent / "complete.json").read_text())
    assert info["variant"] == b.variant
    # found again by the same path, without a build
    assert build.find(B, _p(str(p))) == b
    assert len(compiled) == 1


def test_the_variant_follows_the_bytes_not_the_path(
    tmp_path: Path, compiled: list[dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    p = _mine(tmp_path)
    b = build.ensure(B, _p(str(p)))
    # the same bytes under the same name elsewhere, and as a relative path: the same entry
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "mine.patch").write_bytes(p.read_bytes())
    monkeypatch.chdir(other)
    assert build.find(B, _p("mine.patch")) == b
    assert build.ensure(B, _p("./mine.patch")) == b
    assert len(compiled) == 1
    # editing the file is a new variant (the old entry stays, keyed by the old bytes)
    p.write_text(MINE.replace("42", "43"))
    assert build.find(B, _p(str(p))) is None
    b2 = build.ensure(B, _p(str(p)))
    assert b2.variant != b.variant and b2.variant.startswith("mine-")
    assert compiled[-1]["src/b.c"].count(b"43") == 1
    assert build.find(B, _p("mine.patch")) == b


def test_a_path_with_the_bytes_of_a_bundled_patch_is_that_variant(tmp_path: Path) -> None:
    copy = _mine(tmp_path, GOOD, "good.patch")
    assert catalogue.variant_name(_p(str(copy), build=B)) == catalogue.variant_name(
        _p("good", build=B)
    )
    renamed = _mine(tmp_path, GOOD, "better.patch")
    assert catalogue.variant_name(_p(str(renamed), build=B)).startswith("better-")


def test_the_build_uses_an_immutable_copy_of_the_file(
    tmp_path: Path, compiled: list[dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    p = _mine(tmp_path)
    real = sources.set_patches

    def edit_then_set(build_n: int, src: Path, patches: tuple[Patch, ...]) -> Any:
        p.write_text("garbage written while the build starts\n")  # the user edits the file
        return real(build_n, src, patches)

    monkeypatch.setattr(sources, "set_patches", edit_then_set)
    b = build.ensure(B, _p(str(p)))
    assert compiled[-1]["src/b.c"].count(b"42") == 1  # built from the bytes it was keyed by
    (patch,) = b.patches
    assert patch.data.decode() == MINE  # the value the build used holds the bytes it was keyed by
    (copy,) = json.loads((b.bin_dir.parent / "complete.json").read_text())["patches"]
    assert Path(copy).read_text() == MINE and Path(copy).is_relative_to(build.llama_dir())
    assert build.find(B, _p(copy)) == b


def test_path_patches_combine_with_bundled_ones_in_order(
    tmp_path: Path, compiled: list[dict[str, bytes]]
) -> None:
    p = _mine(tmp_path)
    b = build.ensure(B, _p("good", str(p)))
    assert b.variant.startswith("good+mine-")
    assert compiled[-1]["src/a.c"] != PRISTINE["src/a.c"]
    assert compiled[-1]["src/b.c"] != PRISTINE["src/b.c"]
    # a stock build afterwards compiles pristine sources again
    build.ensure(B)
    assert compiled[-1] == PRISTINE


def test_a_stock_build_after_a_path_patch_restores_its_files_even_without_a_record(
    tmp_path: Path, compiled: list[dict[str, bytes]]
) -> None:
    # MINE edits src/b.c, which no bundled patch touches: only the state record names it...
    build.ensure(B, _p(str(_mine(tmp_path))))
    assert compiled[-1]["src/b.c"] != PRISTINE["src/b.c"]
    # ...and the record is lost: the stock build must still compile a pristine src/b.c
    (_src().parent / "patched.json").write_text("{not json")
    build.ensure(B)
    assert compiled[-1] == PRISTINE
    stock = json.loads((build.entry_dir(B) / "complete.json").read_text())
    assert "src/b.c" in stock["sources"]["files"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("--- a/../evil.c\n+++ b/../evil.c\n@@ -1 +1 @@\n-x\n+y\n", "outside the source tree"),
        ("--- a//etc/passwd\n+++ b//etc/passwd\n@@ -1 +1 @@\n-x\n+y\n", "outside the source tree"),
        ("just some text, not a diff\n", "touches no file"),
        (GOOD.replace("int a2 = 2;", "int a2 = 7;"), "patch mine.patch does not apply"),
        (MINE.replace("src/b.c", "src/none.c"), "patch mine.patch does not apply"),
    ],
    ids=["dotdot", "absolute", "not-a-diff", "does-not-apply", "no-such-file"],
)
def test_a_bad_patch_file_is_one_line_and_leaves_the_tree_stock(
    tmp_path: Path, compiled: list[dict[str, bytes]], text: str, match: str
) -> None:
    build.ensure(B)
    p = _mine(tmp_path, text)
    with pytest.raises(BuildError, match=match) as ei:
        build.ensure(B, _p(str(p)))
    assert "\n" not in str(ei.value)
    assert all((_src() / rel).read_bytes() == data for rel, data in PRISTINE.items())
    assert (
        not (tmp_path / "evil.c").exists() and not (build.llama_dir() / "work" / "evil.c").exists()
    )
    assert len(compiled) == 1


def test_a_missing_patch_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"patch file .*nope\.patch' not found"):
        build.ensure(B, _p(str(tmp_path / "nope.patch")))
    (tmp_path / "dir.patch").mkdir()
    with pytest.raises(BuildError, match="not found"):
        catalogue.resolve(str(tmp_path / "dir.patch"))  # a directory is not a patch file
    with pytest.raises(BuildError, match="not found"):
        catalogue.resolve("a\0b.patch")


def test_odd_file_names_give_safe_variant_labels(tmp_path: Path) -> None:
    p = _mine(tmp_path, MINE, "my fix+v2 (ü).patch")
    v = catalogue.variant_name(_p(str(p), build=B))
    assert v.startswith("my_fix_v2____-") and "/" not in v
    p2 = _mine(tmp_path, MINE, "..patch")
    assert catalogue.patch_label(str(p2)) == "patch"


def test_names_cannot_escape_the_patch_directory(tmp_path: Path) -> None:
    for name in ("../good", "mutants/../good", "mutants/", "", "good/x", "mutants/s2/x"):
        with pytest.raises(BuildError, match="no (patch|mutant)"):
            catalogue.resolve(name, B)


# --------------------------------------------------------------------------------- mutants


def test_mutants_are_listed_apart_from_the_patches() -> None:
    assert catalogue.available_patches(B) == ["good"]
    assert catalogue.available_mutants(B) == ["mutants/s2"]
    assert llama.available_mutants(B) == ["mutants/s2"]
    assert catalogue.describe_patch("mutants/s2", B) == (
        "s2 off by one: a deliberately wrong speculative path"
    )
    assert catalogue.describe_patch("good", B) == ""


def test_a_mutant_builds_as_its_own_variant_and_stock_is_restored_after_it(
    compiled: list[dict[str, bytes]],
) -> None:
    b = build.ensure(B, _p("mutants/s2"))
    assert b.variant.startswith("mutant-s2-") and tuple(p.name for p in b.patches) == (
        "mutants/s2",
    )
    assert compiled[-1]["src/spec.c"] == b"int s1 = 1;\nint s2 = 3;\nint s3 = 3;\n"
    # the state record is lost: the mutant's file is restored anyway, being a bundled file
    (_src().parent / "patched.json").write_text("{not json")
    build.ensure(B)
    assert compiled[-1] == PRISTINE
    stock = json.loads((build.entry_dir(B) / "complete.json").read_text())
    assert "src/spec.c" in stock["sources"]["files"]
    assert build.find(B, _p("mutants/s2")) == b


def test_unknown_mutant_lists_the_mutants() -> None:
    with pytest.raises(BuildError, match=r"no mutant 'mutants/nope' .*available: mutants/s2"):
        build.ensure(B, _p("mutants/nope"))


# ------------------------------------------------------------------------------------- CLI


def test_cli_build_and_path_take_a_relative_patch_path(
    tmp_path: Path, compiled: list[dict[str, bytes]], cli: CliFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = _mine(tmp_path)
    monkeypatch.chdir(p.parent)
    code, out, err = cli("llama", "build", "--patch", "mine.patch", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["variant"].startswith("mine-")
    code, out, err = cli("llama", "path", "--patch", "./mine.patch", "--json")
    assert code == 0, err
    assert json.loads(out)["variant"] == got["variant"]
    code, out, err = cli("llama", "build", "--patch", "mutants/s2", "--json")
    assert code == 0, err
    assert json.loads(out)["variant"].startswith("mutant-s2-")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["llama", "build", "--patch", "missing.patch"], "patch file 'missing.patch' not found"),
        (["llama", "path", "--patch", "mutants/nope"], "no mutant 'mutants/nope'"),
        (["llama", "build", "--patch", "nope"], "no patch 'nope'"),
        (["dist", "--patch", "missing.patch"], "patch file 'missing.patch' not found"),
        (["dist", "--patch", "mutants/nope"], "no mutant"),
        (["dist", "--engine", "url", "--url", "http://127.0.0.1:9", "--patch", "good"], "applies"),
    ],
)
def test_cli_bad_patches_are_one_line_exit_2(
    cli: CliFn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], match: str
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(*args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], err


def test_cli_dist_runs_the_server_engine_on_the_patched_build(
    tmp_path: Path, cli: CliFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dist --patch PATH` provisions that variant (the build itself is stubbed here)."""
    p = _mine(tmp_path)
    asked: list[tuple[Patch, ...]] = []

    def fake_find(b: int, patches: tuple[Patch, ...] = ()) -> None:
        asked.append(tuple(patches))
        raise BuildError("stop here")

    monkeypatch.setattr(llama, "find", fake_find)
    code, _, err = cli("dist", "--engine", "server", "--patch", str(p), "--seeds", "5")
    assert code == 2 and "stop here" in err
    assert [tuple(x.name for x in a) for a in asked] == [(str(p.resolve()),)]


# ------------------------------------------------------------------------- dist plumbing


def test_dist_run_checks_patches_before_anything_starts(tmp_path: Path) -> None:
    fake = llama.LlamaBinaries(bin_dir=tmp_path, build=B, variant="stock")
    with pytest.raises(distribution.DistError, match="not both"):
        distribution.make_request(("server",), patches=("good",), binaries=fake)
    with pytest.raises(distribution.DistError, match="applies to the server"):
        distribution.make_request(("url",), url="http://127.0.0.1:9", patches=("good",))
    with pytest.raises(distribution.DistError, match="not one string"):
        distribution.make_request(("server",), patches="good")
    with pytest.raises(BuildError, match="no mutant"):
        distribution.make_request(("server",), patches=("mutants/nope",))


def test_dist_run_builds_with_the_patches_and_labels_the_engines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = _mine(tmp_path)
    asked: list[tuple[Patch, ...]] = []

    def fake_ensure(*a: Any, patches: tuple[Patch, ...] = (), **k: Any) -> llama.LlamaBinaries:
        asked.append(patches)
        return llama.LlamaBinaries(bin_dir=tmp_path, build=B, variant="x", patches=tuple(patches))

    labels: list[str] = []

    def fake_measure(eng: Any, *a: Any, **k: Any) -> None:
        labels.append(eng.label)
        raise KeyboardInterrupt  # stop after the first engine: nothing is sampled

    monkeypatch.setattr(llama, "ensure", fake_ensure)
    monkeypatch.setattr(runner, "measure", fake_measure)
    (tmp_path / "llama-speculative").write_text("")
    with pytest.raises(KeyboardInterrupt):
        req = distribution.make_request(
            ("speculative-example",), patches=(str(p), "mutants/s2"), work_dir=tmp_path
        )
        distribution.run(req)
    assert [tuple(x.name for x in a) for a in asked] == [(str(p.resolve()), "mutants/s2")]
    assert labels == ["llama-speculative [mine+mutant-s2]"]


def _spawned_argv(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **kw: Any
) -> tuple[list[str], str]:
    seen: list[tuple[list[str], str]] = []

    def fake_start(self: LlamaServer) -> LlamaServer:
        seen.append((self.argv(), self.name))
        return self

    monkeypatch.setattr(LlamaServer, "start", fake_start)
    fs = runner.load_fixture(None, tmp_path)
    bins = llama.LlamaBinaries(bin_dir=tmp_path, build=B, variant="stock")
    with runner.spawn_server(bins, fs, **kw):
        pass
    return seen[0]


def test_spawn_server_draft_sampling(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    argv, name = _spawned_argv(monkeypatch, tmp_path, draft=True)
    assert "--spec-draft-sampling" not in argv and name == "dist-spec"  # greedy: no flag
    argv, name = _spawned_argv(monkeypatch, tmp_path, draft=True, draft_sampling="probabilistic")
    i = argv.index("--spec-draft-sampling")
    assert argv[i + 1] == "probabilistic" and "-md" in argv
    assert name == "dist-spec-probabilistic"
    with pytest.raises(distribution.DistError, match="needs a draft"):
        _spawned_argv(monkeypatch, tmp_path, draft=False, draft_sampling="probabilistic")
    with pytest.raises(distribution.DistError, match="one of greedy, probabilistic"):
        _spawned_argv(monkeypatch, tmp_path, draft=True, draft_sampling="typo")


@pytest.mark.parametrize("given", ["spec-logprobs", ["spec-logprobs"], 5])
def test_patches_not_given_as_patch_values_are_refused(given: object) -> None:
    """A library caller passing a name (or anything but `Patch` values) gets a TypeError
    before any lookup: text is resolved once, by `patches.resolve`, never guessed here."""
    with pytest.raises(TypeError, match="Patch values"):
        build.find(B, given)  # type: ignore[arg-type]  # the wrong type is the point
