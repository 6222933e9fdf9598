"""The noisy-null benchmark accumulates runs across invocations (`--resume`): a file whose
runs were measured otherwise, or skip a run, must be refused rather than extended, or the
seed ranges would overlap and the pooled rate would count some seeds twice."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_rescore_noisy_null.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_rescore_noisy_null", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(bench: ModuleType, first: int, n: int, seeds: int) -> list[dict[str, Any]]:
    out = []
    for run in range(first, first + n):
        start = 1 + (run - 1) * bench.SEED_STRIDE
        out.append(
            {
                "run": run,
                "sampler": bench.SAMPLER_TEXT,
                "seed_first": start,
                "seed_last": start + seeds * 3 - 1,
            }
        )
    return out


def test_consecutive_runs_of_the_same_settings_are_kept(bench: ModuleType, tmp_path: Path) -> None:
    f = tmp_path / "runs.json"
    f.write_text(json.dumps(rows(bench, 5, 3, 167)))
    assert [r["run"] for r in bench.previous_rows(f, 167)] == [5, 6, 7]
    assert bench.previous_rows(tmp_path / "absent.json", 167) == []


@pytest.mark.parametrize("fault", ["gap", "tokens", "sampler", "not json"])
def test_a_file_measured_otherwise_is_refused_in_one_line(
    bench: ModuleType, tmp_path: Path, fault: str
) -> None:
    data = rows(bench, 1, 3, 167)
    if fault == "gap":
        del data[1]
    elif fault == "tokens":
        data = rows(bench, 1, 3, 84)
    elif fault == "sampler":
        data[2]["sampler"] = "top-k 0, T = 0.7"
    f = tmp_path / "runs.json"
    f.write_text("{" if fault == "not json" else json.dumps(data))
    with pytest.raises(SystemExit) as exc:
        bench.previous_rows(f, 167)
    msg = str(exc.value)
    assert msg.startswith("--resume:") and "\n" not in msg
