"""`--engine openvino`'s checks and error paths, without running OpenVINO: what the closed form
cannot cover is refused before work starts, a missing extra or a path the installed build
lacks is one line, and every reported log-probability gets exactly one class."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from specaudit import distribution, fixtures
from specaudit.distribution import openvino as ov


def _wl(**kw: Any) -> distribution.Workload:
    s = fixtures.SamplerSettings(
        **{"top_k": 3, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0, **kw}
    )
    return distribution.make_workload(fixtures.default_spec(), sampler=s)


@pytest.mark.parametrize(
    ("knobs", "why"),
    [
        ({"temperature": 0.0}, "--temperature must be > 0"),
        ({"top_p": 0.9}, "use --top-p 1 --min-p 0"),
        ({"min_p": 0.05}, "use --top-p 1 --min-p 0"),
    ],
)
def test_settings_openvino_samples_differently_are_refused(
    knobs: dict[str, float], why: str
) -> None:
    with pytest.raises(distribution.DistError, match=why.replace("-", r"\-")):
        ov.check_sampler(_wl(**knobs).sampler)


def test_make_request_refuses_them_before_any_work(tmp_path: Path) -> None:
    fs = fixtures.build(tmp_path / "fx")
    s = fixtures.SamplerSettings(top_k=3, top_p=0.9, min_p=0.0, temperature=0.7)
    with pytest.raises(distribution.DistError, match="temperature before min-p and top-p"):
        distribution.make_request(["openvino"], fixture=fs, sampler=s)


def test_its_options_belong_to_it_alone(tmp_path: Path) -> None:
    fs = fixtures.build(tmp_path / "fx")
    with pytest.raises(distribution.DistError, match="--ov-path"):
        distribution.make_request(["server"], fixture=fs, ov_paths=["draft"])


def _fake_genai(monkeypatch: pytest.MonkeyPatch, **attrs: Any) -> types.ModuleType:
    """A stand-in openvino_genai with only `attrs` (and the version, SchedulerConfig)."""
    fake = types.ModuleType("openvino_genai")
    base = types.ModuleType("openvino")
    for mod in (fake, base):
        setattr(mod, "__version__", "0.0-fake")  # noqa: B010 - a module has no such attribute
    fake_attrs = {"SchedulerConfig": type("SchedulerConfig", (), {}), **attrs}
    for k, v in fake_attrs.items():
        setattr(fake, k, v)
    monkeypatch.setitem(sys.modules, "openvino_genai", fake)
    monkeypatch.setitem(sys.modules, "openvino", base)
    return fake


def test_without_the_extra_one_line_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openvino_genai", None)
    with pytest.raises(distribution.DistError, match=r"specaudit\[openvino\]"):
        ov.versions()


def test_a_build_without_draft_model_says_the_path_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_genai(monkeypatch)  # no draft_model attribute
    target = tmp_path / "t.gguf"
    target.write_bytes(b"x")
    with pytest.raises(distribution.DistError, match="has no draft_model: the draft path"):
        ov.open_pipeline(target, "draft", tmp_path)


def test_a_pipeline_that_refuses_a_path_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def refuse(*a: object, **k: object) -> None:
        raise RuntimeError("Exception from src/x.cpp:1:\nprompt_lookup\n  is not supported")

    _fake_genai(monkeypatch, ContinuousBatchingPipeline=refuse)
    target = tmp_path / "t.gguf"
    target.write_bytes(b"x")
    with pytest.raises(distribution.DistError) as ei:
        ov.open_pipeline(target, "prompt-lookup")
    msg = str(ei.value)
    assert "with prompt lookup" in msg and "is not supported" in msg and "\n" not in msg


def test_unknown_path_and_missing_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_genai(monkeypatch)
    with pytest.raises(distribution.DistError, match="unknown openvino path 'eagle3'"):
        ov.open_pipeline(tmp_path, "eagle3")
    with pytest.raises(distribution.DistError, match="does not exist"):
        ov.open_pipeline(tmp_path / "none.gguf", "plain")


def test_a_folder_without_ir_is_not_a_draft(tmp_path: Path) -> None:
    with pytest.raises(distribution.DistError, match="enable_save_ov_model=True"):
        ov.draft_model_dir(tmp_path)
    (tmp_path / "openvino_model.xml").write_text("<net/>")
    assert ov.draft_model_dir(tmp_path) == tmp_path


@pytest.mark.parametrize(
    ("reported", "expected", "cls"),
    [
        (math.log(0.345), 0.345, "real-correct"),
        (math.log(0.345) + 5e-5, 0.345, "real-correct"),
        (math.log(0.452), 0.345, "real-wrong"),
        (-1.0, 0.0, "real-wrong"),  # a token the closed form forbids
        (0.0, 0.345, "placeholder"),
        (0.0, 1.0, "real-correct"),  # certain: 0.0 is the true value
        (None, 0.345, "missing"),
        (math.nan, 0.345, "missing"),
    ],
)
def test_each_value_gets_one_class(reported: float | None, expected: float, cls: str) -> None:
    assert ov.classify(reported, expected) == cls


def test_outputs_are_scored_per_prefix_raw_or_processed() -> None:
    spec = fixtures.default_spec()
    wl = _wl()
    f_id, e_id = spec.tokenize("f")[0], spec.tokenize("e")[0]
    raw_f = fixtures.raw_distribution(spec, "bcdbc")["f"]
    proc_e = fixtures.conditional_distribution(spec, "bcdbc", "f", wl.sampler)["e"]
    outs = [
        ov.Output([f_id, e_id], [math.log(raw_f), math.log(proc_e)]),  # raw, then processed
        ov.Output([f_id, spec.eos_id, e_id], [math.log(raw_f)]),  # EOS ends what is scored
    ]
    raw = ov.score_outputs(spec, wl, outs, [1, 2], "plain", "raw")
    assert raw.counts == {"real-correct": 2, "real-wrong": 1, "placeholder": 0, "missing": 1}
    assert raw.unscored == 1 and raw.wrong[0][:3] == (1, 2, "e")
    proc = ov.score_outputs(spec, wl, outs[:1], [1], "plain", "processed")
    assert proc.counts["real-correct"] == 1 and proc.counts["real-wrong"] == 1


def test_reproducibility_summary_names_every_comparison() -> None:
    r = ov.Reproducibility("draft", 50, 50, [], [11, 32], [7])
    assert not r.reproducible
    assert r.summary() == (
        "alone twice: 50/50 equal; alone vs in a batch of 50: 48/50 equal; "
        "the same batch twice: 49/50 equal"
    )
    assert ov.Reproducibility("plain", 5, 5, [], [], []).reproducible
