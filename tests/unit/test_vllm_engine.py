"""`--engine vllm` without a server: the sampler settings it lets through are exactly those
where vLLM's order (temperature, min-p, top-k, top-p) gives the closed form's distribution, the
others are one line and exit 2; /metrics counters become per-request drafted and accepted
counts; a server that fails mid-run is one line naming the method and the setting. The real
server's runs are in tests/integration/test_vllm_server.py."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

import fakes
from specaudit import distribution, fixtures
from specaudit.distribution import vllm as dv
from specaudit.distribution.truth import encode_ids

CliFn = Callable[..., tuple[int, str, str]]

SPEC = fixtures.spec_for_kind("last-token")
GRID = list(
    itertools.product((0.5, 1.0, 1.7), (0, 1, 3), (0.5, 0.9, 1.0), (0.0, 0.3))
)  # temperature, top-k, top-p, min-p


def _contexts() -> list[str]:
    return [
        SPEC.prompt + "".join(c) for k in (0, 1) for c in itertools.product(SPEC.letters, repeat=k)
    ]


def _gap(s: fixtures.SamplerSettings) -> float:
    """The largest difference between vLLM's order and the closed form on the fixture."""
    gap = 0.0
    for text in _contexts():
        raw = np.array(list(fixtures.raw_distribution(SPEC, text).values()))
        want = np.array(list(fixtures.next_token_distribution(SPEC, text, s).values()))
        gap = max(gap, float(np.abs(dv.vllm_order(raw, s) - want).max()))
    return gap


@pytest.mark.parametrize(("t", "k", "p", "m"), GRID)
def test_settings_let_through_sample_the_closed_form(t: float, k: int, p: float, m: float) -> None:
    s = fixtures.SamplerSettings(top_k=k, top_p=p, min_p=m, temperature=t)
    if dv.differs(s) is None:
        assert _gap(s) < 1e-12
    else:
        with pytest.raises(distribution.DistError) as ei:
            dv.check_sampler(s)
        assert "\n" not in str(ei.value)


def test_the_refusal_is_needed_on_the_fixture() -> None:
    """Each refused kind of setting does sample another distribution on the fixture."""
    hot = fixtures.SamplerSettings(top_k=0, top_p=0.5, min_p=0.0, temperature=0.5)
    both = fixtures.SamplerSettings(top_k=0, top_p=0.5, min_p=0.3, temperature=1.0)
    assert dv.differs(hot) and _gap(hot) > 0.01
    assert dv.differs(both) and _gap(both) > 0.01


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (("--temperature", "0.5", "--top-p", "0.9"), "at --temperature != 1 use --top-p 1"),
        (("--temperature", "2", "--min-p", "0.1"), "at --temperature != 1 use --top-p 1"),
        (("--top-p", "0.9", "--min-p", "0.1"), "min-p before top-p"),
        (("--temperature", "0"), "--temperature must be > 0"),
    ],
)
def test_dist_refuses_settings_vllm_samples_otherwise_in_one_line(
    cli: CliFn, args: tuple[str, ...], why: str
) -> None:
    code, out, err = cli("dist", "--engine", "vllm", *args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and why in lines[0]


def test_speculative_configs_name_vllms_methods() -> None:
    draft = Path("/d")
    assert dv.speculative_config("plain", draft) is None
    for method in dv.METHODS[1:]:
        cfg = dv.speculative_config(method, draft, Path("/e"))
        assert cfg is not None and cfg["method"] == method
        assert cfg["num_speculative_tokens"] == dv.SPECULATIVE_TOKENS
    assert dv.speculative_config("draft_model", draft)["model"] == "/d"  # type: ignore[index]
    for method in ("eagle", "eagle3"):
        assert dv.speculative_config(method, draft, Path("/e"))["model"] == "/e"  # type: ignore[index]
        with pytest.raises(distribution.DistError, match=f"{method} needs a head folder"):
            dv.speculative_config(method, draft)


METRICS = """# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 4.0
vllm:spec_decode_num_accepted_tokens_total_created{engine="0"} 1.7e9
"""


def test_counters_sum_a_metric_over_its_labels_only() -> None:
    assert dv.counters(METRICS) == {dv.DRAFTED: 12.0, dv.ACCEPTED: 5.0}
    assert dv.counters("# nothing\nvllm:num_requests_running 0.0\n") == {}


class FakeVllm:
    """/v1/completions answering fixed ids, /metrics counting 3 drafts and 2 acceptances per
    completion; `die_after` completions, then connection errors."""

    def __init__(self, die_after: int = 1000) -> None:
        self.done = 0
        self.die_after = die_after
        self.bodies: list[dict[str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.done >= self.die_after:
            raise httpx.ConnectError("connection refused")
        if request.url.path == "/metrics":
            text = f"{dv.DRAFTED} {3.0 * self.done}\n{dv.ACCEPTED} {2.0 * self.done}\n"
            return httpx.Response(200, text=text)
        self.bodies.append(json.loads(request.content))
        self.done += 1
        return httpx.Response(200, json={"choices": [{"token_ids": [0, 1, 2, 9], "text": ""}]})


def _engine(fake: FakeVllm, alive: bool = True) -> dv.VllmEngine:
    wl = distribution.make_workload(SPEC)
    return dv.VllmEngine(
        "http://vllm", "m", SPEC, wl, "ngram", family="vLLM", alive=lambda: alive,
        transport=httpx.MockTransport(fake),
    )  # fmt: skip


def test_a_sample_is_token_ids_with_its_own_metric_deltas() -> None:
    fake = FakeVllm()
    eng = _engine(fake)

    async def two() -> list[distribution.Sample]:
        try:
            return [await eng.sample(1), await eng.sample(2)]
        finally:
            await eng.aclose()

    a, b = asyncio.run(two())
    assert a.text == encode_ids([0, 1, 2, 9], 4, SPEC) and a.text.startswith("abc")
    assert (a.drafted, a.accepted, b.drafted, b.accepted) == (3, 2, 3, 2)
    body = fake.bodies[0]
    assert body["prompt"] == SPEC.tokenize(SPEC.prompt) and body["return_token_ids"] is True
    assert (body["seed"], fake.bodies[1]["seed"]) == (1, 2)
    assert (body["top_k"], body["top_p"], body["min_p"], body["temperature"]) == (3, 1.0, 0.0, 1.0)


def test_a_server_that_does_not_speculate_is_sampled_several_at_a_time_uncounted() -> None:
    """Nothing is counted per request on a plain server, so nothing forces requests to go
    one at a time: they overlap (vLLM batches them) and /metrics is never read."""
    fake = FakeVllm()
    paths: list[str] = []
    in_flight = [0, 0]  # now, most at once

    async def slow(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        await asyncio.sleep(0.01)
        in_flight[0] -= 1
        return fake(request)

    wl = distribution.make_workload(SPEC)
    eng = dv.VllmEngine(
        "http://vllm", "m", SPEC, wl, "plain", family="vLLM", transport=httpx.MockTransport(slow)
    )
    assert eng.concurrency == dv.PLAIN_CONCURRENCY > 1

    async def many() -> list[distribution.Sample]:
        try:
            return list(await asyncio.gather(*(eng.sample(s) for s in range(8))))
        finally:
            await eng.aclose()

    samples = asyncio.run(many())
    assert in_flight[1] == 8  # they overlapped
    assert all(s.drafted is None and s.accepted is None for s in samples)
    assert "/metrics" not in paths and len(paths) == 8


def test_a_server_that_dies_is_one_line_naming_the_method_and_setting() -> None:
    eng = _engine(FakeVllm(die_after=0), alive=False)

    async def one() -> None:
        try:
            await eng.sample(7)
        finally:
            await eng.aclose()

    with pytest.raises(distribution.DistError) as ei:
        asyncio.run(one())
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith("vLLM ngram (temperature 1, top-k 3, top-p 1, min-p 0): the server died")


def test_the_root_cause_is_vllms_own_exception_not_the_api_servers(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(
        "(Worker pid=9) ERROR 12-05 13:40:40 [multiproc_executor.py:1063]     max_top_k = k.max()\n"
        "(Worker pid=9) ERROR 12-05 13:40:40 [multiproc_executor.py:1063] RuntimeError: max(): "
        "Expected reduction dim to be specified for input.numel() == 0.\n"
        "(EngineCore pid=8) ERROR 12-05 13:40:40 [core.py:1512] RuntimeError: Worker failed "
        "with error 'max(): ...', please check the stack trace above for the root cause\n"
        "(APIServer pid=7) ERROR 12-05 13:40:40 [async_llm.py:906] vllm.v1.engine.exceptions."
        "EngineDeadError: EngineCore encountered an issue. See stack trace (above)\n"
        'INFO:     127.0.0.1:49338 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error\n'
    )
    assert dv.root_cause(log) == (
        "RuntimeError: max(): Expected reduction dim to be specified for input.numel() == 0."
    )
    quiet = tmp_path / "quiet.log"
    quiet.write_text("INFO started\nsomething failed here\n")
    assert dv.root_cause(quiet) == "something failed here"


# ------------------------------------------------------------------------ --vllm-url


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (("--vllm-url", "http://127.0.0.1:9"), "expected NAME=URL"),
        (("--vllm-url", "=http://127.0.0.1:9"), "expected NAME=URL"),
        (("--vllm-url", "a b=http://127.0.0.1:9"), "expected NAME=URL"),
        (("--vllm-url", "ngram=ftp://x"), "--vllm-url"),
        (
            ("--vllm-url", "ngram=http://127.0.0.1:9", "--vllm-url", "ngram=http://127.0.0.1:8"),
            "names ngram twice",
        ),
        (
            ("--vllm-url", "plain=http://127.0.0.1:9", "--vllm-method", "plain"),
            "names plain twice",
        ),
        (
            ("--vllm-url", "x=http://127.0.0.1:9", "--vllm-fix", "cpu-sampler"),
            "--vllm-fix applies to the servers dist starts",
        ),
        (("--vllm-fix", "nope"), "Invalid value for '--vllm-fix'"),
        (
            ("--vllm-url", "x=http://127.0.0.1:9", "--vllm-logprobs-mode", "raw_logprobs"),
            "--vllm-logprobs-mode applies to the servers dist starts",
        ),
        (
            ("--vllm-logprobs-mode", "raw_logprobs", "--vllm-logprobs-mode", "processed_logprobs"),
            "one mode per run",
        ),
        (("--vllm-logprobs-mode", "logits"), "Invalid value for '--vllm-logprobs-mode'"),
    ],
)
def test_vllm_url_values_are_checked_before_anything_runs(
    cli: CliFn, args: tuple[str, ...], why: str
) -> None:
    code, out, err = cli("dist", "--engine", "vllm", "--top-k", "0", *args)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and why in line, line


def _not_vllm(asked: fakes.Asked) -> fakes.Answer:
    if asked.path == "/v1/models":
        return fakes.Answer.json({"data": [{"id": "m"}]})
    return fakes.Answer.json({"detail": "Not Found"}, status=404)


def _two_models(asked: fakes.Asked) -> fakes.Answer:
    if asked.path == "/v1/models":
        return fakes.Answer.json({"data": [{"id": "a"}, {"id": "b"}]})
    return fakes.Answer.json({"version": "0.32.0"})


def _few_logprobs(asked: fakes.Asked) -> fakes.Answer:
    if asked.path == "/v1/models":
        return fakes.Answer.json({"data": [{"id": "m"}]})
    if asked.path == "/version":
        return fakes.Answer.json({"version": "0.32.0"})
    return fakes.Answer.json(
        {"error": {"message": "Requested sample logprobs of 10, which is greater than max "
                   "allowed: 5"}}, status=400,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("canned", "why"),
    [
        (_not_vllm, "no /version: not a vLLM server"),
        (_two_models, "with 2 models (one expected"),
        (_few_logprobs, "answered 400"),
    ],
)
def test_a_vllm_url_that_cannot_be_audited_is_one_line(
    cli: CliFn, canned: fakes.Canned, why: str
) -> None:
    with fakes.serve(fakes.serving(canned)) as srv:
        code, out, err = cli(
            "dist", "--engine", "vllm", "--top-k", "0", "--vllm-url", f"ngram={srv.url}"
        )
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and why in line, line
    if canned is _few_logprobs:
        assert "--max-logprobs -1" in line


def test_a_vllm_url_nobody_listens_on_is_one_line(cli: CliFn) -> None:
    from specaudit.llama.process import free_port

    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = cli("dist", "--engine", "vllm", "--top-k", "0", "--vllm-url", f"x={url}")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: --vllm-url {url}: ConnectError"), line
