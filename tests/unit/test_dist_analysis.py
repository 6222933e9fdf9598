"""`specaudit dist` without a server: ground truth, analysis, verdicts, parsing, bad input."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from closed_form import Bend, draw
from specaudit import distribution, fixtures
from specaudit.outcome import Outcome
from specaudit.stats import Verdict

DATA = Path(__file__).parent.parent / "data" / "dist"
CliFn = Callable[..., tuple[int, str, str]]
SPEC = fixtures.default_spec()
WL = distribution.make_workload(SPEC)


TRUTH = distribution.Truth(SPEC, WL)


def _draw(n: int, seed: int, bend: Bend | None = None) -> list[distribution.Sample]:
    """n samples of the closed form from a fresh generator seeded `seed`."""
    return draw(TRUTH, n, np.random.default_rng(seed), bend)


# --------------------------------------------------------------------------------------------
# ground truth


def test_truth_is_the_closed_form_of_the_report() -> None:
    truth = distribution.Truth(SPEC, WL)
    after_f = dict(zip(truth.labels, truth.next("f"), strict=True))
    assert after_f["e"] == pytest.approx(0.345, abs=1e-6)
    assert after_f["g"] == pytest.approx(0.452, abs=1e-6)
    assert after_f["h"] == pytest.approx(0.203, abs=1e-6)
    assert truth.most_likely_prefix(1) == "f"


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_marginals_agree_with_the_joint(t: int) -> None:
    truth = distribution.Truth(SPEC, WL)
    joint = fixtures.sequence_distribution(SPEC, WL.prompt, t, WL.sampler)
    want = np.zeros(len(truth.labels))
    for seq, p in joint.items():
        want[truth.index[seq[-1]]] += p
    assert truth.marginal(t) == pytest.approx(want, abs=1e-12)


# --------------------------------------------------------------------------------------------
# analysis


def test_samples_from_the_target_are_preserved() -> None:
    res = distribution.analyse(SPEC, WL, _draw(1500, 1), engine="closed form")
    assert res.verdict is Verdict.PRESERVED, res.reason
    assert [t.name for t in res.tests] == [
        "position 1", "position 2", "position 3", "position 4", "joint 1-3", "draft direction",
        "history 3", "history 4", "seed pairs",
    ]  # fmt: skip
    assert all(not t.rejected for t in res.tests)
    assert [c.position for c in res.headline] == [1, 2, 3]
    assert res.headline[1].label == "bcdbc+f"


def test_too_few_samples_are_inconclusive() -> None:
    res = distribution.analyse(SPEC, WL, _draw(60, 2))
    assert res.verdict is Verdict.INCONCLUSIVE, res.reason
    assert "more samples" in res.reason


def _always_e_after_f(prefix: str, p: np.ndarray) -> np.ndarray:
    """The report's llama-speculative: after f it always picks e."""
    if prefix.endswith("f"):
        q = np.zeros_like(p)
        q[SPEC.tokens.index("e")] = 1.0
        return q
    return p


def test_the_example_programs_bias_is_broken() -> None:
    res = distribution.analyse(SPEC, WL, _draw(300, 3, _always_e_after_f))
    assert res.verdict is Verdict.BROKEN
    pos2 = res.tests[1]
    assert pos2.rejected and pos2.gof.p_value < 1e-30
    row = {r.token: r for r in res.headline[1].tokens}
    assert row["e"].frequency == 1.0 and row["g"].observed == 0


def test_an_impossible_token_is_broken_whatever_the_sample_size() -> None:
    samples = _draw(5, 4)
    # 'a' has probability 0 as the first token after bcdbc (top-k 3 keeps d, e, f)
    samples[0] = distribution.Sample(samples[0].seed, "a" + samples[0].text[1:])
    res = distribution.analyse(SPEC, WL, samples, alpha=1e-9)
    assert res.verdict is Verdict.BROKEN
    assert res.impossible == 1
    assert "probability 0" in res.reason


def test_drafted_and_accepted_are_summed() -> None:
    s = [distribution.Sample(i, t.text, 3, 1) for i, t in enumerate(_draw(20, 5))]
    res = distribution.analyse(SPEC, WL, s)
    assert (res.drafted, res.accepted) == (60, 20)


def test_text_that_is_not_the_fixture_is_broken_with_evidence() -> None:
    # it used to be an error (exit 2); text the fixture cannot produce is an outcome of
    # probability 0: BROKEN, naming seed, position and token (tests/unit/test_dist_verdicts.py)
    res = distribution.analyse(SPEC, WL, [distribution.Sample(1, "Hello")])
    assert res.verdict is Verdict.BROKEN and res.impossible == 1
    assert (res.evidence[0].seed, res.evidence[0].position, res.evidence[0].token) == (1, 1, "'H'")
    assert "is the engine running it" in res.reason


def test_sequential_stops_early_on_the_bias_and_runs_on_under_the_null() -> None:
    truth = distribution.Truth(SPEC, WL)
    seq = distribution.Sequential(truth, WL, 1e-3, 0.15, 1000)
    n = 0
    for s in _draw(1000, 6, _always_e_after_f):
        n += 1
        if seq.add(s):
            break
    assert seq.verdict is Verdict.BROKEN and seq.decided_by in ("e-value", "fixed-look")
    assert n <= 50
    seq = distribution.Sequential(truth, WL, 0.01, 0.15, 3000)
    for s in _draw(3000, 7):
        if seq.add(s):
            break
    # an early stop certifies the tolerance only: WITHIN TOLERANCE, never PRESERVED
    assert seq.verdict is Verdict.WITHIN_TOLERANCE and seq.decided_by == "tv-bound"
    assert seq.looks >= 1


def test_result_outcome_and_exit_code(tmp_path: Path) -> None:
    good = distribution.analyse(SPEC, WL, _draw(1500, 1), engine="good")
    few = distribution.analyse(SPEC, WL, _draw(60, 2), engine="few")
    bad = distribution.analyse(SPEC, WL, _draw(300, 3, _always_e_after_f))

    def result(*engines: distribution.EngineResult) -> distribution.DistResult:
        return distribution.DistResult("x", tmp_path, {}, WL, 0.01, 0.15, False, list(engines))

    assert (result(good).outcome, result(good).exit_code) == (Outcome.OK, 0)
    assert (result(good, few).outcome, result(good, few).exit_code) == (Outcome.NO_DECISION, 2)
    assert (result(few, bad).outcome, result(few, bad).exit_code) == (Outcome.FINDING, 1)
    assert result().exit_code == 2  # no engine, no decision


def test_markdown_and_plot(tmp_path: Path) -> None:
    good = distribution.analyse(SPEC, WL, _draw(400, 8), engine="good")
    bad = distribution.analyse(SPEC, WL, _draw(400, 9, _always_e_after_f), engine="bad")
    res = distribution.DistResult(
        "x", tmp_path, {}, WL, 0.01, 0.15, False, [good, bad]
    )  # fmt: skip
    md = distribution.to_markdown(res)
    assert "| good |" in md and "BROKEN" in md and "bcdbc+f" in md
    png = distribution.plot_results(res, tmp_path / "d.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# llama-speculative output (recorded from the real binary, seed 9)


def test_parse_example_output_recorded() -> None:
    out = (DATA / "llama-speculative-seed9.stdout").read_text()
    err = (DATA / "llama-speculative-seed9.stderr").read_text()
    assert distribution.parse_example_output(out, err, "bcdbc") == ("fhabcf", 6, 3)


def test_parse_example_output_detects_lost_tails() -> None:
    out = (DATA / "llama-speculative-seed9.stdout").read_text()
    err = (DATA / "llama-speculative-seed9.stderr").read_text()
    # llama.cpp's async logger can drop the tail at exit: any truncation is incomplete
    assert distribution.parse_example_output(out[:-1], err, "bcdbc") is None
    assert distribution.parse_example_output("\n\nbcdbcf", err, "bcdbc") is None
    assert distribution.parse_example_output(out, err.split("n_drafted")[0], "bcdbc") is None
    assert distribution.parse_example_output(out, err, "dcb") is None


def test_spawn_server_sizes_the_fixture_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One thread, the fixture's whole context per slot, -np as asked; a draft only with one."""
    from specaudit.llama.build import LlamaBinaries
    from specaudit.llama.server import LlamaServer

    monkeypatch.setattr(LlamaServer, "__enter__", lambda self: self)
    monkeypatch.setattr(LlamaServer, "__exit__", lambda self, *exc: None)
    fs = fixtures.build(tmp_path / "fx")
    bins = LlamaBinaries(tmp_path / "bin", 11434, "stock")
    for draft in (False, True):
        with distribution.spawn_server(bins, fs, draft=draft, parallel=3, log_dir=tmp_path) as srv:
            argv = srv.argv()
            assert srv.name == ("dist-spec" if draft else "dist-plain")
            assert srv.log_path == tmp_path / f"{srv.name}.log"
            assert argv[argv.index("-np") + 1] == "3"
            assert argv[argv.index("-c") + 1] == str(3 * fs.spec.config.context_length)
            assert argv[argv.index("-t") + 1] == "1"
            assert ("-md" in argv) is draft and ("--spec-type" in argv) is draft
            if draft:
                assert argv[argv.index("--spec-type") + 1] == "draft-simple"


def test_unreachable_url_is_a_dist_error() -> None:
    from specaudit.llama.server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(distribution.DistError, match=re.escape(f"cannot connect to {url}/slots")):
        distribution.ServerEngine(url, SPEC, WL)


def test_example_engine_needs_its_binary(tmp_path: Path) -> None:
    with pytest.raises(distribution.DistError, match="not found"):
        distribution.ExampleEngine(tmp_path / "nope", tmp_path, tmp_path, SPEC, WL)


# --------------------------------------------------------------------------------------------
# driving: an engine error stops everything (error path)


class _FailingEngine:
    label = "failing"
    kind = "url"
    concurrency = 3

    def __init__(self) -> None:
        self.closed = False

    async def sample(self, seed: int) -> distribution.Sample:
        await asyncio.sleep(0.001 * (seed % 3))
        if seed == 5:
            raise distribution.DistError("server went away")
        return distribution.Sample(seed, "fegh")

    async def aclose(self) -> None:
        self.closed = True


def test_engine_errors_propagate_and_close_the_engine() -> None:
    eng = _FailingEngine()
    with pytest.raises(distribution.DistError, match="went away"):
        distribution.measure(eng, SPEC, WL, range(1, 50))
    assert eng.closed


# --------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"tokens": 0}, "--tokens must be at least 3"),
        ({"tokens": 2}, "--tokens must be at least 3"),
        ({"positions": 5}, "--positions"),
        ({"joint": 5}, "--joint"),
        ({"prompt": "xyz"}, "--prompt"),
        ({"prompt": ""}, "--prompt"),
        ({"sampler": fixtures.SamplerSettings(top_k=3, top_p=0.0)}, "sampler settings"),
        ({"sampler": fixtures.SamplerSettings(temperature=-1.0)}, "--temperature"),
    ],
)
def test_bad_workloads(kw: dict[str, Any], msg: str) -> None:
    with pytest.raises(distribution.DistError, match=msg):
        distribution.make_workload(SPEC, **kw)


def test_bad_engines_and_numbers(tmp_path: Path) -> None:
    fs = fixtures.build(tmp_path / "fx")
    with pytest.raises(distribution.DistError, match="unknown engine"):
        distribution.make_request(["sglang"], fixture=fs)
    with pytest.raises(distribution.DistError, match="needs --url"):
        distribution.make_request(["url"], fixture=fs)
    with pytest.raises(distribution.DistError, match="--seeds"):
        distribution.make_request(["server"], fixture=fs, seeds=0)
    with pytest.raises(distribution.DistError, match="--alpha"):
        distribution.make_request(["server"], fixture=fs, alpha=0)


def test_missing_and_corrupt_fixtures(tmp_path: Path) -> None:
    with pytest.raises(distribution.DistError, match="missing"):
        distribution.load_fixture(tmp_path / "nothing")
    fs = fixtures.build(tmp_path / "fx")
    data = bytearray(fs.target.read_bytes())
    data[-1] ^= 0xFF
    fs.target.write_bytes(bytes(data))
    with pytest.raises(distribution.DistError, match="SHA-256 mismatch"):
        distribution.load_fixture(fs.dir)


def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path, cli: CliFn) -> None:
    fs = fixtures.build(tmp_path / "fx")
    data = bytearray(fs.draft.read_bytes())
    data[len(data) // 2] ^= 0x55  # same size, other bytes: only the SHA-256 can tell
    fs.draft.write_bytes(bytes(data))
    cases = {
        ("--tokens", "0"): "--tokens must be at least 3",
        ("--engine", "nonsense"): "'nonsense' is not one of",
        ("--fixture", str(tmp_path / "missing")): "missing",
        ("--fixture", str(fs.dir)): "SHA-256 mismatch",
        ("--engine", "url"): "needs --url",
    }
    for args, msg in cases.items():
        code, out, err = cli("dist", *args)
        assert code == 2, args
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, err)
        assert msg in lines[0]
        assert "Traceback" not in err and out == ""


def test_cli_help_documents_exit_codes(cli: CliFn) -> None:
    code, text, _ = cli("dist", "--help")
    assert code == 0
    for needle in ("Exit codes", "PRESERVED", "BROKEN", "INCONCLUSIVE", "--sequential"):
        assert needle in text


def test_impossible_tokens_are_counted_once_each() -> None:
    truth = distribution.Truth(SPEC, WL)
    samples = _draw(50, 10)
    text = "a"  # impossible first token, then a possible continuation
    while len(text) < 4:
        text += truth.labels[int(np.argmax(truth.next(text)))]
    samples[0] = distribution.Sample(1, text)
    head = samples[1].text[:3]
    p = truth.next(head)
    bad = next(ch for ch in SPEC.letters if p[truth.index[ch]] == 0)
    samples[1] = distribution.Sample(2, head + bad)  # impossible fourth token
    res = distribution.analyse(SPEC, WL, samples)
    assert res.impossible == 2
    assert res.verdict is Verdict.BROKEN
