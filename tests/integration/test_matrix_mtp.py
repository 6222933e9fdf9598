"""`specaudit matrix` on b11434 (the default build), for real: besides the fixture's
draft-simple paths, the MTP paths on the mtp fixture (a glm4moe with its own MTP layer), stock
and patched, each with drafted/accepted counts that show the MTP drafter ran.

200 seeds per path: the wiring and the counts (the MTP paths' PRESERVED at the report's 1000
seeds is tested in test_dist_mtp and the audit's dist section); on a correct server these
fixed seeds may leave a verdict INCONCLUSIVE (too few to certify the TV tolerance), never
BROKEN.
"""

from __future__ import annotations

import pytest

from specaudit import llama, matrix
from specaudit.llama import presets
from specaudit.stats import Verdict

SEEDS = 200


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> matrix.MatrixResult:
    work = tmp_path_factory.mktemp("matrix-mtp")
    return matrix.run([llama.DEFAULT_BUILD], seeds=SEEDS, work_dir=work)


def test_matrix_runs_both_mtp_paths_on_the_mtp_fixture_stock_and_patched(
    result: matrix.MatrixResult,
) -> None:
    (b,) = result.builds
    assert b.build == llama.DEFAULT_BUILD and b.mtp_paths == ["mtp", "mtp-rejection"]
    assert result.mtp_fixture is not None and result.mtp_fixture != result.fixture
    assert b.patched is not None
    for v in (b.stock, b.patched):
        assert list(v.dist) == ["greedy", "rejection", "mtp", "mtp-rejection"], v.variant
        for path in presets.MTP_PATHS:
            e = v.dist[path]
            assert e.n_samples == SEEDS and e.path == path
            assert e.verdict is not Verdict.BROKEN, (v.variant, path, e.reason)
            # the target's own MTP layer drafted, and the target accepted some of it
            assert e.drafted is not None and e.accepted is not None, (v.variant, path)
            assert e.drafted > 0 and 0 < e.accepted < e.drafted, (v.variant, path)


def test_matrix_table_has_the_mtp_columns_with_counts(result: matrix.MatrixResult) -> None:
    (b,) = result.builds
    assert b.patched is not None
    md = matrix.to_markdown(result)
    print(f"\n{md}")
    assert "| dist mtp (stock / patched) | dist mtp-rejection (stock / patched) |" in md
    for path in presets.MTP_PATHS:
        s, p = b.stock.dist[path], b.patched.dist[path]
        cell = (
            f"{s.verdict.value} ({s.accepted}/{s.drafted} acc.) / "
            f"{p.verdict.value} ({p.accepted}/{p.drafted} acc.)"
        )
        assert cell in md, cell
    assert f"MTP paths on fixture `{result.mtp_fixture}`" in md
