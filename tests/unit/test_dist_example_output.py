"""llama-speculative's output read with its logger drained at exit (`dist.logflush`), and an
engine that cannot sample named in one line (`specaudit dist` and the audit's dist section).

The real example prints through llama.cpp's asynchronous logger, which it never flushes: a
run that exits before the logger's thread has printed anything loses everything. The fake
example here is that worst case made deterministic: its "logger" queues every line and prints
only when `common_log_pause` is called (the two functions under llama.cpp's C++ names), so
without the exit flush nothing ever reaches stdout or stderr.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from fakes import Answer, Asked, Canned, route_clients
from specaudit import distribution, fixtures
from specaudit.audit import AuditContext
from specaudit.audit.sections import dist as dist_section
from specaudit.client import ClientError
from specaudit.distribution import logflush
from specaudit.distribution.coverage import kind_paths
from specaudit.errors import ServerError
from specaudit.llama.build import LlamaBinaries
from specaudit.outcome import Outcome

DATA = Path(__file__).parent.parent / "data" / "dist"
SPEC = fixtures.default_spec()
WL = distribution.make_workload(SPEC)

FAKE_EXAMPLE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* llama.cpp's logger when its worker thread has not run before exit: lines wait in a queue
   until common_log_pause() prints them. */
struct common_log { const char *line[16]; int to_stderr[16]; int n; };
static struct common_log the_log;
struct common_log *_Z15common_log_mainv(void) { return &the_log; }
void _Z16common_log_pauseP10common_log(struct common_log *log) {
    for (int i = 0; i < log->n; i++) {
        FILE *f = log->to_stderr[i] ? stderr : stdout;
        fputs(log->line[i], f);
        fflush(f);
    }
    log->n = 0;
}
static void queue(int to_stderr, const char *s) {
    struct common_log *log = _Z15common_log_mainv();
    log->line[log->n] = s;
    log->to_stderr[log->n++] = to_stderr;
}
int main(int argc, char **argv) {
    const char *prompt = "";
    for (int i = 1; i + 1 < argc; i++) if (strcmp(argv[i], "-p") == 0) prompt = argv[i + 1];
    queue(0, "\n\n"); queue(0, prompt); queue(0, "fegh"); queue(0, "\n\n");   /* LOG */
    queue(1, "n_drafted = 6\n"); queue(1, "n_accept  = 3\n");                /* LOG_INF */
    queue(0, "\n\n");
    return 0;
}
"""


@pytest.fixture(scope="module")
def fake_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fake-example")
    (d / "fake.c").write_text(FAKE_EXAMPLE)
    out = d / "llama-speculative"
    cc = logflush._compiler()
    subprocess.run([*cc, "-O2", "-o", str(out), str(d / "fake.c")], check=True)
    return out


def _run(binary: Path, env: dict[str, str] | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), "-p", "bcdbc"], capture_output=True, text=True, env=env, timeout=60
    )


# --------------------------------------------------------------------------------------------
# the channel: the logger drained at exit


def test_without_the_exit_flush_the_queued_output_is_lost(fake_example: Path) -> None:
    r = _run(fake_example, None)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""


def test_the_exit_flush_prints_everything_queued_then_the_marker(fake_example: Path) -> None:
    r = _run(fake_example, logflush.environ())
    assert r.returncode == 0
    assert r.stdout == "\n\nbcdbcfegh\n\n\n\n"
    assert r.stderr.splitlines()[-1] == logflush.MARKER
    assert logflush.problem(r.stderr) is None
    assert distribution.read_example_output(r.stdout, r.stderr, "bcdbc") == ("fegh", 6, 3)


def test_a_program_without_the_logger_symbols_says_so(tmp_path: Path) -> None:
    # /bin/true has no common_log_main: nothing to flush, and the reason is on stderr
    r = subprocess.run(["true"], capture_output=True, text=True, env=logflush.environ())
    why = logflush.problem(r.stderr)
    assert why is not None and "no common_log_main/common_log_pause" in why


def test_the_library_is_built_once_and_preloaded_first() -> None:
    lib = logflush.library()
    assert lib.is_file() and logflush.library() == lib
    env = logflush.environ({"LD_PRELOAD": "/other.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == f"{lib}:/other.so" and env["PATH"] == "/bin"


# --------------------------------------------------------------------------------------------
# reading one run


def _recorded() -> tuple[str, str]:
    out = (DATA / "llama-speculative-seed9.stdout").read_text()
    err = (DATA / "llama-speculative-seed9.stderr").read_text()
    return out, err


def test_a_drained_run_is_read() -> None:
    out, err = _recorded()
    err += f"\n{logflush.MARKER}\n"
    assert distribution.read_example_output(out, err, "bcdbc") == ("fhabcf", 6, 3)


def test_a_run_whose_logger_was_not_drained_is_an_error_not_a_retry() -> None:
    out, err = _recorded()  # recorded before the flush: complete, but nothing proves it
    with pytest.raises(distribution.DistError, match="logger was not flushed at exit"):
        distribution.read_example_output(out, err, "bcdbc")
    # what a busy machine used to leave: the prompt only, two init lines
    lost_err = "\n".join(err.splitlines()[:2])
    with pytest.raises(distribution.DistError, match="logger was not flushed at exit"):
        distribution.read_example_output("\n\nbcdbc", lost_err, "bcdbc")


def test_a_drained_run_without_text_or_statistics_says_what_is_missing() -> None:
    out, err = _recorded()
    marker = f"\n{logflush.MARKER}\n"
    with pytest.raises(distribution.DistError, match="n_drafted / n_accept"):
        distribution.read_example_output(out, err.split("n_drafted")[0] + marker, "bcdbc")
    with pytest.raises(distribution.DistError, match="lacks the prompt 'dcb'"):
        distribution.read_example_output(out, err + marker, "dcb")


# --------------------------------------------------------------------------------------------
# the engine


def test_example_engine_reads_every_run_of_a_logger_that_prints_nothing_before_exit(
    fake_example: Path, tmp_path: Path
) -> None:
    eng = distribution.ExampleEngine(
        fake_example, tmp_path / "t.gguf", tmp_path / "d.gguf", SPEC, WL
    )
    samples = distribution.collect(eng, range(1, 41))
    assert [s.text for s in samples] == ["fegh"] * 40
    assert {(s.drafted, s.accepted) for s in samples} == {(6, 3)}


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_example_engine_errors_name_the_engine_and_seed_in_one_line(tmp_path: Path) -> None:
    failing = _script(tmp_path / "failing", "echo 'main: error: failed to load model' >&2; exit 1")
    eng = distribution.ExampleEngine(
        failing, tmp_path, tmp_path, SPEC, WL, label="llama-speculative [x]"
    )
    with pytest.raises(distribution.DistError) as e:
        distribution.measure(eng, SPEC, WL, range(1, 5))
    line = str(e.value)
    assert "\n" not in line and line.count("llama-speculative [x]") == 1
    assert line.startswith("llama-speculative [x] (seed ")
    assert line.endswith("exited with code 1: main: error: failed to load model")

    # complete-looking output from a program whose logger was never drained (a shell exits
    # without running exit handlers): an error, never a sample
    other = _script(tmp_path / "other", "printf '\\n\\nbcdbcfegh\\n\\n\\n\\n'")
    eng = distribution.ExampleEngine(other, tmp_path, tmp_path, SPEC, WL)
    with pytest.raises(
        distribution.DistError, match=r"^llama-speculative \(seed 1\): its logger was not"
    ):
        distribution.measure(eng, SPEC, WL, range(1, 2))


class _NoServer:
    label = "llama-server + draft, greedy"
    kind = "server-spec"
    concurrency = 1

    async def sample(self, seed: int) -> distribution.Sample:
        raise ClientError("cannot connect to http://127.0.0.1:9/completion: refused")

    async def aclose(self) -> None:
        return None


def test_any_engine_error_names_the_engine() -> None:
    with pytest.raises(distribution.DistError) as e:
        distribution.measure(_NoServer(), SPEC, WL, range(1, 3))
    assert str(e.value) == (
        "llama-server + draft, greedy: cannot connect to http://127.0.0.1:9/completion: refused"
    )


# --------------------------------------------------------------------------------------------
# the audit's dist section: one engine that cannot sample does not take the others with it


def _fake_llama_server(content: str) -> Canned:
    def handle(req: Asked) -> Answer:
        if req.path == "/slots":
            return Answer.json([{"id": 0}])
        if req.path == "/props":
            return Answer.json({})
        return Answer.json({"content": content})

    return handle


class _Servers(AuditContext):
    """The plain path served by a canned server; every speculating path's server fails to
    start."""

    def __init__(self, out_dir: Path, plain_url: str, bins: LlamaBinaries) -> None:
        super().__init__(out_dir, ensure_bins=lambda build, patches: bins)
        self.plain_url = plain_url

    def server(self, name: str) -> Any:
        if name.endswith("-plain"):
            return type("Srv", (), {"url": self.plain_url})()
        raise ServerError(f"{name}: llama-server exited at start (code 1)")


def test_audit_section_keeps_the_other_engines_and_names_each_failure_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist_section, "SEEDS", range(1, 31))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # has the rejection path and the MTP drafter
    _script(bin_dir / "llama-server", "echo '--spec-draft-sampling'; echo 'draft-mtp'")
    _script(bin_dir / "llama-speculative", "echo 'error: out of memory' >&2; exit 1")
    bins = LlamaBinaries(bin_dir, 11434, "stock")
    plain = route_clients(monkeypatch, _fake_llama_server("fegh"))
    with _Servers(tmp_path / "audit", plain, bins) as ctx:
        sec = dist_section.section(ctx)
    assert sec.status is Outcome.NO_DECISION and sec.error is not None
    assert "\n" not in sec.error and "\n" not in sec.summary
    failures = sec.error.split("; ")
    # every speculating path of the llama fixtures on both, the example on the last-token one,
    # and the MTP paths on the mtp fixture
    speculating = [p for p in kind_paths("last-token") if p != "plain"]
    assert len(speculating) == 10 and len(failures) == 2 * len(speculating) + 1 + 2
    mtp_name = sec.data["dist_mtp"].fixture
    for label in ("llama-server + MTP, greedy", "llama-server + MTP, rejection"):
        assert any(f.startswith(f"{mtp_name}: {label}: fixture-mtp-") for f in failures), label
    assert sec.data["dist_mtp"].engines == []
    (example,) = [f for f in failures if "llama-speculative" in f]
    assert example.startswith(f"{SPEC.name}: llama-speculative (seed ")
    assert example.endswith("exited with code 1: error: out of memory")
    assert (
        f"{SPEC.name}: llama-server + draft, greedy: fixture-spec: llama-server exited at start "
        "(code 1)"
    ) in failures
    # the plain path of both fixtures was still measured and reported
    for key in ("dist", "dist_context"):
        (plain_res,) = sec.data[key].engines
        assert plain_res.path == "plain" and plain_res.n_samples == 30
    assert "**Could not sample**" in sec.markdown
    assert sec.summary.startswith("error: ") and "(measured: " in sec.summary
