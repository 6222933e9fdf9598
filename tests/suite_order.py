"""The order of the suite's files when `./run test` runs them side by side (pytest-xdist, one
file per worker): which files share a worker, and which start first. tests/conftest.py applies
it; tests/unit/test_suite_order.py holds it to the tree."""

from __future__ import annotations

# Tests run side by side (`./run test`: pytest-xdist), one test file per worker, so a file's
# module-scoped servers start once. Files that share an expensive session fixture go to one
# worker too: the audit's dist section (1000 seeds on every path, `dist_section` in
# tests/integration/conftest.py) would otherwise be sampled once per worker. (xdist's own
# `--dist loadgroup` does not group under pytest 9: its suffix on the node id is ignored.)
SHARED_SESSION_GROUPS = {
    "dist-section": (
        "tests/integration/test_dist_llama.py",
        "tests/integration/test_dist_openai.py",
        "tests/integration/test_fixture_context_server.py",
        "tests/integration/test_mutants.py",
    ),
    # the session's plain and n-gram vLLM servers (`vllm_plain`, `vllm_ngram`): minutes each
    "vllm": (
        "tests/integration/test_vllm_server.py",
        "tests/integration/test_dist_vllm.py",
        "tests/integration/test_vllm_rescore.py",
    ),
}
_GROUP_OF = {path: group for group, paths in SHARED_SESSION_GROUPS.items() for path in paths}
# The longest files first when workers share them out (longest-processing-time first): a long
# file started late would run alone at the end while the other worker idles; the tail is then
# short files, which fill both workers evenly. Ordered by their summed seconds in a measured
# `./run test` (benchmarks/bench_suite.py --keep, its JUnit XML); files not named follow,
# integration before unit.
FIRST = (
    # vLLM: each file starts two or three vLLM servers (minutes each on a busy 2-core machine);
    # measured alone or beside each other on a shared machine (load 4-22), not in `./run test`
    "vllm",  # 705 s test_dist_vllm.py, 294 s test_vllm_server.py, before Gemma's vLLM test
    "tests/integration/test_audit_vllm.py",  # 435 s alone at load 7 (two vLLM starts)
    "tests/integration/test_upstream_server_tests.py",  # 267 s
    "tests/integration/test_rescore_servers.py",  # 140 s
    "tests/integration/test_gemma_logprob_mutants.py",  # 139 s
    "tests/integration/test_dist_replay.py",  # 118 s
    "dist-section",  # 115 s
    "tests/integration/test_rescore_engines.py",  # 80 s
    "tests/integration/test_audit_model.py",  # 65 s
    "tests/integration/test_patched_proof.py",  # 65 s
    "tests/integration/test_patch_equality.py",  # 63 s
    "tests/integration/test_dist_mtp.py",  # 49 s
    "tests/integration/test_check_reference.py",  # 44 s
    "tests/integration/test_dist_under_load.py",  # 36 s
    "tests/integration/test_speculative_fix.py",  # 33 s
    "tests/unit/test_dist_verdicts.py",  # 30 s
    "tests/integration/test_ab_servers.py",  # 29 s
    "tests/integration/test_dist_ngram_types.py",  # 27 s
    "tests/unit/test_cli_guard.py",  # 24 s
    "tests/integration/test_check_servers.py",  # 22 s
    "tests/integration/test_dist_openvino.py",  # 21 s
)


def group_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return _GROUP_OF.get(path, path)


def rank_of(nodeid: str) -> tuple[int, int]:
    """Where a test's file (or group) comes in a side-by-side run: `FIRST` in its order, then
    integration files, then unit files."""
    group = group_of(nodeid)
    first = FIRST.index(group) if group in FIRST else len(FIRST)
    return (first, 0 if group.startswith("tests/integration/") else 1)
