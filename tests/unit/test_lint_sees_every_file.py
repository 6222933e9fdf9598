"""ruff must lint every Python file of the project: its default `exclude` list once hid a whole
package (a folder named `dist`), so CI passed lint over code no linter ever read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("src", "tests", "benchmarks")


def test_ruff_lists_every_python_file_under_src_tests_and_benchmarks() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", *TREES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    seen = {
        Path(line.strip()).resolve() for line in out.splitlines() if line.strip().endswith(".py")
    }
    on_disk = {
        p.resolve()
        for tree in TREES
        for p in (ROOT / tree).rglob("*.py")
        if "__pycache__" not in p.parts and not any(part.endswith(".egg-info") for part in p.parts)
    }
    assert on_disk, "no Python files found: the test is looking in the wrong place"
    assert sorted(map(str, on_disk - seen)) == []


def test_no_two_test_files_share_a_basename() -> None:
    """pytest imports test files by basename (rootdir-relative, no packages): two files of the
    same name under tests/unit and tests/integration stop the whole suite at collection."""
    names: dict[str, list[str]] = {}
    for p in (ROOT / "tests").rglob("test_*.py"):
        names.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert names, "no test files found"
    assert {n: ps for n, ps in names.items() if len(ps) > 1} == {}
