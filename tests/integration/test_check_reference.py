"""`check --reference` on real servers: every /completion token classified against a plain
server of the same model (fixture and Gemma 3 270M).

What `check` alone calls "real" is split here: the spec-logprobs fix is real and correct; a
logprob mutant of it (lp-no-temperature: post-sampling probabilities without the temperature)
is real but wrong, a finding; the stock speculating server keeps its placeholders.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shared_servers import SharedServers
from specaudit import check, llama
from specaudit.check import fidelity_probe
from specaudit.check.with_reference import KINDS, SAMPLER_TOP_K, FidelityCheckError
from specaudit.client import Client
from specaudit.fixtures import SamplerSettings
from specaudit.llama.patches import resolve
from specaudit.llama.server import LlamaServer
from specaudit.outcome import Outcome
from specaudit.reference import (
    ServerReference,
    completion_body,
    read_next_token,
    reference_server,
)

FIXTURE: dict[str, Any] = {
    "prompt": "bcdbc",
    "tokens": 12,
    "top_k": 3,
    "temperature": 0.7,
    "seed": 3,
}
GEMMA: dict[str, Any] = {
    "prompt": "Once upon a time",
    "tokens": 12,
    "top_k": 5,
    "temperature": 0.7,
    "seed": 3,
}


def _check(url: str, ref: str, kw: dict[str, Any]) -> check.CheckResult:
    return check.run(url, endpoint="native", reference=ref, probe_switch=False, **kw)


def test_patched_fixture_tokens_are_real_and_correct(server: Callable[..., Any]) -> None:
    res = _check(server("fixture-spec-patched").url, server("fixture-plain").url, FIXTURE)
    f = res.fidelity
    assert f is not None and f.counts.total > 0
    assert f.counts.real_correct == f.counts.total, (f.by_kind, f.worst)
    assert f.accepted > 0  # speculative tokens were among them
    assert res.outcome is Outcome.OK


def test_stock_fixture_placeholders_are_classified(server: Callable[..., Any]) -> None:
    res = _check(server("fixture-spec").url, server("fixture-plain").url, FIXTURE)
    f = res.fidelity
    assert f is not None
    assert f.counts.placeholder + f.counts.missing > 0 and f.counts.real_wrong == 0
    assert res.verdict == "placeholders" and res.outcome is Outcome.FINDING


def test_a_logprob_mutant_is_real_but_wrong_on_the_fixture(
    server: Callable[..., Any], fixture_set: Any, shared_servers: SharedServers
) -> None:
    bins = llama.ensure(patches=(resolve("mutants/lp-no-temperature"),))
    srv = shared_servers.fixture(bins, fixture_set, "greedy")
    plain_check = check.run(srv.url, endpoint="native", probe_switch=False, **FIXTURE)
    res = _check(srv.url, server("fixture-plain").url, FIXTURE)
    assert plain_check.verdict == "real"  # what check alone says
    f = res.fidelity
    assert f is not None
    assert f.counts.real_wrong > 0, f.by_kind
    assert res.verdict == "real but wrong" and res.outcome is Outcome.FINDING


def test_gemma_patched_is_correct_and_a_logprob_mutant_is_wrong(
    server: Callable[..., Any], gemma_path: Path, shared_servers: SharedServers
) -> None:
    ref = server("gemma-plain").url
    good = _check(server("gemma-spec-patched").url, ref, GEMMA)
    assert good.fidelity is not None
    assert good.fidelity.counts.real_correct == good.fidelity.counts.total > 0, (
        good.fidelity.by_kind,
        good.fidelity.worst,
    )
    bins = llama.ensure(patches=(resolve("mutants/lp-no-temperature"),))
    bad = _check(shared_servers.gemma_spec(bins, gemma_path, "greedy").url, ref, GEMMA)
    assert bad.fidelity is not None and bad.fidelity.counts.real_wrong > 0
    assert bad.verdict == "real but wrong"


def test_a_reference_of_another_model_is_refused(server: Callable[..., Any]) -> None:
    with pytest.raises(FidelityCheckError, match="same model"):
        _check(server("gemma-spec-patched").url, server("fixture-plain").url, GEMMA)


# Supplementary-plane CJK: Gemma's vocabulary has no token for most of these characters, so
# Gemma writes them as four byte tokens, and the first three end inside the character.
SPLIT: dict[str, Any] = {
    "prompt": "𠀀𠀁𠀂𠀃𠀄𠀅𠀆𠀇𠀈𠀉",
    "tokens": 12,
    "top_k": 5,
    "temperature": 0.7,
    "seed": 1,
}


def test_stock_gemma_tokens_split_inside_a_character_are_aligned(gemma_path: Path) -> None:
    """A stock llama-server writes no probability entry for a token that ends inside a UTF-8
    character. With the entries placed at their token ids, each of the response's tokens is
    classified once: every entry real and correct at its own prefix (a misplaced entry is
    compared at another prefix and comes out wrong), every held-back token missing; streamed,
    the tokens the stream never sent are missing and the later ones counted as uncompared."""
    n = SPLIT["tokens"]
    with (
        LlamaServer(llama.ensure(), gemma_path, parallel=1, ctx_size=4096) as eng,
        reference_server(gemma_path, parallel=4, ctx_size=4096) as ref,
    ):
        # the server's answer to the probes' request: fewer entries than token ids
        sampler = SamplerSettings(
            top_k=SAMPLER_TOP_K, top_p=1.0, min_p=0.0, temperature=SPLIT["temperature"]
        )
        ids = ServerReference(ref.url, sampler).tokenize(SPLIT["prompt"])
        kind = fidelity_probe.ProbeKind("completion", False)
        body = fidelity_probe.request_body(
            kind, ids, sampler.request_fields(), SPLIT["seed"], n, SPLIT["top_k"]
        )
        with Client(eng.url) as c:
            got = c.post("/completion", body)
        assert len(got["tokens"]) == n > len(got["completion_probabilities"]) > 0

        res = _check(eng.url, ref.url, SPLIT)
    f = res.fidelity
    assert f is not None
    for post in (False, True):
        k = f.by_kind[fidelity_probe.ProbeKind("completion", post).label]
        assert k.real_correct + k.missing == n and k.missing > 0, (f.by_kind, f.worst)
        assert k.real_wrong == k.placeholder == 0, (f.by_kind, f.worst)
        k = f.by_kind[fidelity_probe.ProbeKind("completion", post, stream=True).label]
        assert k.missing > 0 and k.real_wrong == k.placeholder == 0, (f.by_kind, f.worst)
    assert f.counts.total + f.uncompared == 4 * n, (f.by_kind, f.uncompared)


# A complete C program: the model (Gemma 3 270M pretrained, which knows no chat turns) is likely
# to end the document here, so its end-of-generation tokens carry most of the probability at the
# prompt, more than the check's tolerance on this model (2x the reference's own spread over
# batch shapes, 0.1 to 0.5 in probability: a few percent of EOG mass would go unseen).
EOG: dict[str, Any] = {
    "prompt": "int main() {\n    return 0;\n}\n",
    "tokens": 12,
    "top_k": 5,
    "temperature": 0.7,
    "seed": 3,
}


def test_engine_probes_mask_end_of_generation_tokens_as_the_reference_does(
    server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine probes and reference requests both carry ``ignore_eos`` (`sampling_fields`).
    After a complete C program the end-of-generation tokens have visible probability at the
    prefixes the check compares (measured on the reference, asked without ``ignore_eos``); the
    patched speculating server's tokens are all real and correct, and a probe that forgets
    ``ignore_eos`` puts that mass back into the engine's post-sampling probabilities, which
    the check must call real but wrong (its raw logprobs are unaffected)."""
    eng, ref_url = server("gemma-spec-patched").url, server("gemma-plain").url
    sampler = SamplerSettings(
        top_k=SAMPLER_TOP_K, top_p=1.0, min_p=0.0, temperature=EOG["temperature"]
    )
    ref = ServerReference(ref_url, sampler)
    ids = ref.tokenize(EOG["prompt"])
    with Client(ref_url) as c:
        # the tokens llama-server masks for ignore_eos: the logit biases it adds to the request
        settings = c.post("/completion", completion_body(ids, sampler, 1))["generation_settings"]
        eog = {int(b["token"]) for b in settings["logit_bias"]}
        eos_text = c.get("/props")["eos_token"]
    # they include the vocabulary's end of sequence and Gemma's <end_of_turn>
    for text in (eos_text, "<end_of_turn>"):
        named = ref.tokenize(text)[1:]  # after the BOS the server adds
        assert len(named) == 1 and named[0] in eog, (text, named, eog)
    # the prefixes the check compares: the engine's own tokens under the probes' request
    kind = fidelity_probe.ProbeKind("completion", False)
    body = fidelity_probe.request_body(
        kind, ids, sampler.request_fields(), EOG["seed"], EOG["tokens"], EOG["top_k"]
    )
    with Client(eng) as c:
        gen = [int(t) for t in c.post("/completion", body)["tokens"]]
    with Client(ref_url) as c:
        unmasked = [
            read_next_token(
                c, {**completion_body(ids + gen[:j], sampler, ref.support), "ignore_eos": False},
                post=True,
            )
            for j in range(len(gen))
        ]  # fmt: skip
    mass = [sum(p for t, p in probs.items() if t in eog) for probs in unmasked]
    print(f"\nEOG tokens {sorted(eog)} ({eos_text!r} and <end_of_turn> among them)")
    print("EOG probability per compared position:", " ".join(f"{m:.3g}" for m in mass))
    assert max(mass) >= 0.05, mass

    good = _check(eng, ref_url, EOG)
    g = good.fidelity
    assert g is not None
    print(f"with ignore_eos: {g.counts}, tolerance {g.tolerance_prob:.3g} in probability")
    assert g.counts.real_correct == g.counts.total > 0, (g.by_kind, g.worst)
    # the mass a forgetful probe puts back is more than the check tolerates on this model
    assert max(mass) > g.tolerance_prob, (mass, g.tolerance_prob)

    original = fidelity_probe.request_body
    calls: list[dict[str, Any]] = []

    def forgets_ignore_eos(*args: Any, **kwargs: Any) -> dict[str, Any]:
        body = original(*args, **kwargs)
        del body["ignore_eos"]
        calls.append(body)
        return body

    monkeypatch.setattr(fidelity_probe, "request_body", forgets_ignore_eos)
    bad = _check(eng, ref_url, EOG)
    b = bad.fidelity
    assert b is not None
    print(f"probes without ignore_eos: {b.counts}, tolerance {b.tolerance_prob:.3g}")
    print(f"  by kind {b.by_kind}")
    print(f"  worst {b.worst}")
    assert len(calls) == len(KINDS)  # every probe of the check was built without it
    assert b.counts.real_wrong > 0, (b.by_kind, b.worst)
    assert bad.verdict == "real but wrong"
    for label, k in b.by_kind.items():  # the post-sampling probabilities only
        assert (k.real_wrong > 0) == ("post" in label), (label, b.by_kind, b.worst)
