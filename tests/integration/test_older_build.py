"""An older llama.cpp build, for real: b10705 (August, before the rejection sampler #27694).

Through `specaudit.matrix`: the stock speculating server sends placeholder logprobs, the
ported spec-logprobs patch makes every token real, /props says "none" while /slots shows the
slots speculating, and `dist` finds the server's sample-and-match verification (the only one
this build has, used at temperature > 0 too) PRESERVED on stock and patched alike, with a draft
model and with the mtp fixture's own MTP layer (b10705 has --spec-type draft-mtp, not yet
mtp-rejection).
./run test builds both binaries before pytest starts (cold: minutes; see docs/builds.md).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import pytest

from specaudit import llama, matrix
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import Patch, resolve_all
from specaudit.stats import Verdict

CliFn = Callable[..., tuple[int, str, str]]
OLD = 10705
SEEDS = 1000  # the report's 1000 seeds (400 left a TV bound of 0.159 > 0.15)


def _progress(pct: float, msg: str) -> None:
    print(f"[specaudit] building llama.cpp b{OLD}: {pct:3.0f}% {msg[-70:]}", file=sys.stderr)


def _ensure(build: int, patches: tuple[Patch, ...]) -> LlamaBinaries:
    return llama.ensure(build, patches, progress=_progress)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> matrix.MatrixResult:
    work = tmp_path_factory.mktemp("matrix")
    return matrix.run([OLD], seeds=SEEDS, work_dir=work, ensure=_ensure)


def test_the_port_applies_and_names_its_build() -> None:
    assert presets.PATCH in llama.available_patches(OLD)
    bins = _ensure(OLD, resolve_all((presets.PATCH,), OLD))
    assert bins.build == OLD and bins.variant.startswith(presets.PATCH + "-")


def test_no_rejection_sampler_before_27694(result: matrix.MatrixResult) -> None:
    (b,) = result.builds
    assert b.build == OLD and not b.has_rejection
    assert set(b.stock.dist) == {"greedy", "mtp"}  # mtp: the MTP drafter, sample-and-match
    assert matrix.has_rejection(_ensure(llama.DEFAULT_BUILD, ()))  # the control: b11434 has it


def test_stock_placeholders_patched_real(result: matrix.MatrixResult) -> None:
    (b,) = result.builds
    assert b.stock.placeholders > 0 and b.stock.check_verdict == "placeholders"
    assert b.patched is not None
    assert b.patched.placeholders == 0 and b.patched.real > 0
    assert b.patched.check_verdict == "real"
    assert b.patched.draft_n  # the patched server really speculated


def test_props_says_none_slots_speculate(result: matrix.MatrixResult) -> None:
    (b,) = result.builds
    assert b.slots_total and b.slots_speculative == b.slots_total
    assert b.props_types is None or "draft" not in b.props_types


def test_dist_sample_and_match_preserved(result: matrix.MatrixResult) -> None:
    (b,) = result.builds
    assert b.patched is not None
    for v in (b.stock, b.patched):
        e = v.dist["greedy"]
        assert e.verdict is Verdict.PRESERVED, (v.variant, e.reason)
        assert e.n_samples == SEEDS
        assert e.drafted and e.accepted and 0 < e.accepted < e.drafted


def test_mtp_drafts_and_keeps_the_distribution_without_a_rejection_path(
    result: matrix.MatrixResult,
) -> None:
    (b,) = result.builds
    assert b.mtp_paths == ["mtp"] and result.mtp_fixture is not None
    assert b.patched is not None
    for v in (b.stock, b.patched):
        e = v.dist["mtp"]
        assert e.verdict is Verdict.PRESERVED, (v.variant, e.reason)
        assert e.n_samples == SEEDS
        assert e.drafted and e.accepted and 0 < e.accepted < e.drafted, v.variant


def test_cli_matrix_json_and_markdown(result: matrix.MatrixResult, cli: CliFn) -> None:
    code, out, err = cli("matrix", "--builds", str(OLD), "--seeds", "50", "--json")
    assert code == 0, err
    data = json.loads(out)
    (b,) = data["builds"]
    assert b["build"] == OLD and b["patched"]["placeholders"] == 0
    assert b["stock"]["dist"]["greedy"]["verdict"] in ("PRESERVED", "INCONCLUSIVE")
    md = matrix.to_markdown(result)
    assert f"| b{OLD} |" in md and "no rejection sampler (before #27694)" in md
