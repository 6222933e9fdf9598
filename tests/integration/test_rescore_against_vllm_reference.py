"""`rescore --engine vllm` against a plain vLLM reference, for real: the default fixture
exported as Hugging Face folders (tests/integration/conftest.py) served by a speculating vLLM
CPU server, every token re-scored against a plain vLLM server of the same folder reporting its
processed logprobs (`specaudit.vllm.reference`). The stock n-gram server samples tokens its
top-p removes (docs/vllm.md): BROKEN, with `--reference-vllm` (rescore starts and stops the
reference itself). The n-gram server with specaudit's cpu-sampler fix: nothing rejects, against
a running reference given by `--reference-url --reference-engine vllm`. Both at top-k 0, top-p
0.8, T = 1, 100 seeds x 8 tokens (the stock server's BROKEN is certain far earlier)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from specaudit.fixtures.hf import HfExport
    from specaudit.vllm.env import VllmEnv
    from specaudit.vllm.server import VllmServer

CliFn = Callable[..., tuple[int, str, str]]
# three vLLM starts (the session's stock n-gram server, the fixed one, the reference rescore
# starts) and one reference started here: minutes each on a busy 2-core machine
pytestmark = pytest.mark.timeout(3600)
SETTING = ("--top-k", "0", "--top-p", "0.8", "--min-p", "0", "--temperature", "1")
RUN = ("--seeds", "100", "--tokens", "8", "--arm-temperature", "off", "--json")
FLOAT32 = 1e-5  # the same folder on the same build: the probe's TV is float32 noise


@pytest.fixture(scope="module")
def vllm_reference(vllm_export: HfExport) -> Iterator[str]:
    """A plain vLLM server on the fixture's target folder, as `--reference-vllm` starts it."""
    from specaudit.vllm.reference import start_vllm_reference

    with start_vllm_reference(vllm_export.target) as url:
        yield url


@pytest.fixture(scope="module")
def vllm_ngram_fixed(
    vllm_env: VllmEnv, vllm_export: HfExport, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """The n-gram server with specaudit's cpu-sampler fix (`specaudit.vllm.fixes`)."""
    from specaudit.distribution import vllm as dv
    from specaudit.vllm.fixes import resolve
    from specaudit.vllm.server import VllmServer

    log = tmp_path_factory.mktemp("vllm-ngram-fixed") / "vllm.log"
    with VllmServer(
        vllm_env, vllm_export.target, speculative=dv.speculative_config("ngram", vllm_export.draft),
        log_path=log, fixes=resolve(["cpu-sampler"]), **dv.server_args(vllm_export.spec),
    ) as srv:  # fmt: skip
        yield srv


def _rejecting(r: dict[str, Any]) -> list[str]:
    return [t["name"] for t in r["stats"]["tests"] if t.get("rejects")]


def _summary(r: dict[str, Any]) -> str:
    """The measured numbers, printed for the record (``pytest -rP`` shows them)."""
    o, c = r["outside"], r["control"]
    return (
        f"{r['verdict']}: {r['rescored']} tokens, outside {o['count']} ({o['impossible']} "
        f"impossible, bound {o['expected_bound']:.3g}), rejecting {_rejecting(r)}, drafted "
        f"{r['drafted']} / accepted {r['accepted']}, probe TV {r['probe_tv']:.2g}, noise TV "
        f"{r['noise_tv']:.2g} / logprob {r['noise_logprob']:.2g}, leak units max "
        f"{max(o['leak_units'], default=0):.3g}, control {c['verdict']} (outside "
        f"{c['outside']['count']}), {r['reference_requests']} reference requests, "
        f"{r['total_seconds']:.0f} s"
    )


def test_a_plain_vllm_reference_sees_the_stock_ngram_server_break(
    vllm_ngram: VllmServer, vllm_export: HfExport, cli: CliFn
) -> None:
    code, out, err = cli(
        "rescore", "--engine", "vllm", "--url", vllm_ngram.url,
        "--reference-vllm", str(vllm_export.target), "--prompt", vllm_export.spec.prompt,
        *SETTING, *RUN,
    )  # fmt: skip
    assert code == 1 and out, err[-800:]
    r = json.loads(out)
    print(_summary(r))
    assert r["verdict"] == "BROKEN", r["stats"]["reason"][:500]
    assert r["rescored"] == r["sampled_tokens"] == 800
    assert r["outside"]["count"] > 0  # tokens top-p 0.8 removes, sampled
    assert r["drafted"] > 0 and r["probe_tv"] is not None and r["probe_tv"] < FLOAT32
    assert r["control"]["verdict"] != "BROKEN"  # the plain reference sampled at the same seeds
    assert any("plain vLLM server" in n for n in r["notes"])
    assert vllm_ngram.alive()


def test_a_plain_vllm_reference_finds_nothing_wrong_with_the_fixed_ngram_server(
    vllm_ngram_fixed: VllmServer, vllm_reference: str, vllm_export: HfExport, cli: CliFn
) -> None:
    code, out, err = cli(
        "rescore", "--engine", "vllm", "--url", vllm_ngram_fixed.url,
        "--reference-url", vllm_reference, "--reference-engine", "vllm",
        "--prompt", vllm_export.spec.prompt, *SETTING, *RUN,
    )  # fmt: skip
    assert out, err[-800:]
    r = json.loads(out)
    print(_summary(r))
    assert r["verdict"] in ("PRESERVED", "INCONCLUSIVE"), r["stats"]["reason"][:500]
    assert code == (0 if r["verdict"] == "PRESERVED" else 2)
    assert _rejecting(r) == [] and r["outside"]["count"] == 0
    assert r["rescored"] == r["sampled_tokens"] == 800
    assert r["drafted"] > 0 and r["probe_tv"] is not None and r["probe_tv"] < FLOAT32
    assert r["control"]["verdict"] != "BROKEN"
