"""The suite's order when run side by side (tests/suite_order.py): every file or group named for
the longest-first order exists, so a renamed file cannot silently fall to the end of the run."""

from __future__ import annotations

from pathlib import Path

import suite_order

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_named_first_exists() -> None:
    for name in suite_order.FIRST:
        assert name in suite_order.SHARED_SESSION_GROUPS or (ROOT / name).is_file(), name


def test_every_file_of_a_shared_group_exists() -> None:
    for paths in suite_order.SHARED_SESSION_GROUPS.values():
        for path in paths:
            assert (ROOT / path).is_file(), path


def test_integration_files_run_before_unit_files_unless_named_first() -> None:
    rank = suite_order.rank_of
    assert rank("tests/integration/test_upstream_server_tests.py") < rank(
        "tests/unit/test_dist_verdicts.py"
    )
    assert rank("tests/unit/test_dist_verdicts.py") < rank("tests/integration/test_lifecycle.py")
    assert rank("tests/integration/test_lifecycle.py") < rank("tests/unit/test_stats.py")
