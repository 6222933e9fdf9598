"""Any engine registered in `dist` is re-scorable with no change in rescore: the toy engine
(tests/toy_engine.py, installed as a package whose entry point names it, nowhere in
specaudit) re-scored against a canned plain llama-server (tests/fakes.py, through the client's
transport, no socket) that answers with the fixture's closed form. The exact toy is PRESERVED,
the greedy toy BROKEN, through the library and `specaudit rescore --dist-engine toy`; a
sample's non-letter outcomes become impossible tokens; bad input is one line, exit 2."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest

from fakes import Answer, Asked, Canned, route_clients
from specaudit import fixtures
from specaudit.distribution.results import END, OTHER, SPECIAL_CODES, DistError
from specaudit.fidelity import FixtureReference
from specaudit.fixtures import REPORT_SAMPLER
from specaudit.rescore import engines
from specaudit.rescore.records import RescoreError
from specaudit.stats import Verdict

CliFn = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="module")
def fixture_set(tmp_path_factory: pytest.TempPathFactory) -> fixtures.FixtureSet:
    return fixtures.build(tmp_path_factory.mktemp("fixture"))


def _reference_handler(spec: fixtures.FixtureSpec) -> Canned:
    """A plain llama-server as a reference sees it: /slots (not speculating), /v1/models, and
    /completion on a token-id prompt answered from the closed form (post-sampling probs or raw
    logprobs; `n_predict` > 1 continues with the most likely letters)."""
    closed = FixtureReference(spec, REPORT_SAMPLER)
    meta = {"data": [{"id": "fixture", "meta": {"n_vocab": spec.n_vocab}}]}

    def handler(req: Asked) -> Answer:
        body = json.loads(req.body or b"{}")
        if req.path == "/slots":
            return Answer.json([{"id": 0, "speculative": False}])
        if req.path == "/v1/models":
            return Answer.json(meta)
        if req.path != "/completion":
            return Answer.json({"error": "not supported"}, 501)
        ids = [int(t) for t in body["prompt"]]
        nt = closed.next_token(ids)
        if int(body.get("n_predict", 1)) > 1:
            gen: list[int] = []
            for _ in range(int(body["n_predict"])):
                d = closed.next_token([*ids, *gen]).probs
                gen.append(max(d, key=lambda t: d[t]))
            return Answer.json({"tokens": gen})
        if body.get("post_sampling_probs"):
            probs = [{"id": t, "prob": p} for t, p in nt.probs.items()]
            return Answer.json({"completion_probabilities": [{"top_probs": probs}]})
        lps = [{"id": t, "logprob": lp} for t, lp in nt.logprobs.items() if math.isfinite(lp)]
        return Answer.json({"completion_probabilities": [{"top_logprobs": lps}]})

    return handler


def _run(
    monkeypatch: pytest.MonkeyPatch, fs: fixtures.FixtureSet, mode: str
) -> engines.EngineRescoreResult:
    req = engines.make_request(
        ["toy"], fixture=fs, reference_url=route_clients(monkeypatch, _reference_handler(fs.spec)),
        seeds=300, tokens=4, sampler=REPORT_SAMPLER, toy_modes=[mode],
    )  # fmt: skip
    return engines.run(req)


def test_a_registered_engine_that_samples_the_truth_is_preserved(
    toy: None, fixture_set: fixtures.FixtureSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    res = _run(monkeypatch, fixture_set, "exact")
    (r,) = res.results
    assert r.engine == "toy (exact)" and r.error is None and r.stats is not None
    assert r.rescored == r.sampled_tokens == 1200
    assert r.probe_tv is not None and r.probe_tv < 1e-9  # the reference is the closed form
    assert r.stats.impossible == 0 and r.stats.g_prefixes >= 1
    assert r.stats.verdict is Verdict.PRESERVED, r.stats.reason
    assert res.exit_code == 0


def test_a_registered_engine_that_always_takes_the_argmax_is_broken(
    toy: None, fixture_set: fixtures.FixtureSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    (r,) = _run(monkeypatch, fixture_set, "greedy").results
    assert r.stats is not None
    assert r.stats.verdict is Verdict.BROKEN, r.stats.reason
    assert r.stats.impossible == 0  # the argmax is possible, just sampled too often
    assert r.stats.ks_p < 1e-6


def test_the_cli_re_scores_an_engine_installed_as_a_package_with_its_own_option(
    toy: None, fixture_set: fixtures.FixtureSet, cli: CliFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, help_out, _ = cli("rescore", "--help")
    assert code == 0 and "--toy-mode" in help_out
    assert "toy: an in-memory sampler" in " ".join(help_out.split())
    args = (
        "rescore", "--dist-engine", "toy", "--fixture", str(fixture_set.dir),
        "--reference-url", route_clients(monkeypatch, _reference_handler(fixture_set.spec)),
        "--seeds", "300", "--tokens", "4", "--top-k", "3", "--json",
    )  # fmt: skip
    good_code, good_out, _ = cli(*args, "--toy-mode", "exact")
    bad_code, bad_out, _ = cli(*args, "--toy-mode", "greedy")
    assert good_code == 0, good_out
    good = json.loads(good_out)
    assert good["outcome"] == "ok" and good["results"][0]["verdict"] == "PRESERVED"
    assert bad_code == 1
    assert json.loads(bad_out)["results"][0]["verdict"] == "BROKEN"


def test_fixture_letters_become_ids_and_the_sample_stops_at_a_non_letter(
    fixture_set: fixtures.FixtureSet,
) -> None:
    spec = fixture_set.spec
    a, b = spec.token_ids["a"], spec.token_ids["b"]
    assert engines.fixture_ids(spec, "abab", 4) == (a, b, a, b)
    assert engines.fixture_ids(spec, "ab" + SPECIAL_CODES["</s>"] + "a", 4) == (a, b, spec.eos_id)
    assert engines.fixture_ids(spec, "a" + OTHER + "bb", 4) == (a, engines.NOT_A_TOKEN)
    assert engines.fixture_ids(spec, "ab", 4) == (a, b, engines.NOT_A_TOKEN)  # short: END
    assert engines.fixture_ids(spec, "a" + END, 4) == (a, engines.NOT_A_TOKEN)
    assert engines.fixture_ids(spec, "aH", 4) == (a, engines.NOT_A_TOKEN)  # not a fixture text


def test_a_token_outside_the_reference_support_is_named(
    toy: None, fixture_set: fixtures.FixtureSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose every sample ends early: each short sample's end is an impossible
    token, BROKEN, and the notes name where (seed, position, prefix)."""
    import toy_engine

    real = toy_engine.ToyEngine.sample

    async def short(self: Any, seed: int) -> Any:
        s = await real(self, seed)
        return type(s)(s.seed, s.text[:3] if seed % 10 == 0 else s.text)

    monkeypatch.setattr(toy_engine.ToyEngine, "sample", short)
    (r,) = _run(monkeypatch, fixture_set, "exact").results
    assert r.stats is not None and r.stats.verdict is Verdict.BROKEN
    assert r.stats.impossible == 30  # seeds 10, 20, ..., 300
    assert r.sampled_tokens == 1200  # three letters and the end of each short sample
    assert r.notes[0].startswith("impossible token: seed 10, position 4, after 'bcdbc")
    assert "<not a fixture token>" in r.notes[0]
    assert r.notes[-1] == "... and 20 more impossible tokens"


def test_bad_input_is_one_line(
    toy: None, fixture_set: fixtures.FixtureSet, cli: CliFn, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RescoreError, match="--dist-engine url needs --url"):
        engines.make_request(["url"], fixture=fixture_set)
    with pytest.raises(RescoreError, match="unknown --dist-engine 'nope'"):
        engines.make_request(["nope"], fixture=fixture_set)
    with pytest.raises(RescoreError, match="too few to decide"):
        engines.make_request(["toy"], fixture=fixture_set, seeds=2, tokens=4)
    with pytest.raises(RescoreError, match="--path applies to the server engine only"):
        engines.make_request(["toy"], fixture=fixture_set, paths=["plain"])

    def missing() -> dict[str, str]:
        raise DistError("--engine transformers needs transformers: pip install 'specaudit[x]'")

    from specaudit.distribution import hf

    monkeypatch.setattr(hf, "versions", missing)
    for args in (
        ("--dist-engine", "transformers", "--fixture", str(fixture_set.dir)),
        ("--dist-engine", "openai", "--fixture", str(fixture_set.dir)),
        ("--generator", "assistant", "--url", "http://127.0.0.1:9"),
        ("--dist-engine", "toy", "--self"),
        ("--dist-engine", "toy", "--engine", "openai"),
    ):
        code, out, err = cli("rescore", *args)
        assert code == 2, (args, out, err)
        assert err.count("\n") == 1 and err.startswith("error: "), (args, err)
        assert "Traceback" not in err
