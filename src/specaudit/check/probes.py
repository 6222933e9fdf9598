"""`specaudit check`: are a running server's logprobs real, and does it speculate?

Why: a speculating llama-server answers every token of its speculative loop with
``logprob: 0.0`` (or ``prob: 1.0``) and no candidates -- and in streams with no probability
entry at all -- while ``/props`` claims it does not speculate. Nothing in the schema gives that
away, so this module asks for k candidates per token on every endpoint the server has and
counts the tokens that came back without any (`TokenClass.PLACEHOLDER`). A logprob of exactly
0 *with* candidates is real: small models are that sure.

It also reads ``/slots`` (the per-slot truth about speculation) next to ``/props`` (what the
server claims), shows ``timings.draft_n``/``draft_n_accepted``, and probes whether the
per-request ``speculative.n_max: 0`` switch is honoured (at b11434 it is compiled out).

Outcome (`CheckResult.outcome`, `specaudit.outcome`): OK every logprob real, FINDING
placeholders found; "no decision" (unreachable, errors, non-JSON, not an LLM server, no
logprobs at all) raises `CheckError` (exit 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specaudit import logprobs, speculation, validate
from specaudit.client import ENDPOINTS, Client, ClientError, StreamResult
from specaudit.errors import SpecauditError
from specaudit.logprobs import TokenClass, TokenRecord
from specaudit.outcome import Outcome

if TYPE_CHECKING:
    from specaudit.check.with_reference import FidelitySummary

JSON = dict[str, Any]

DEFAULT_PROMPT = "Explain how a CPU branch predictor works."

# One probe per (kind, stream mode). "native-post" is native /completion with
# post_sampling_probs, whose placeholders read prob 1.0 instead of logprob 0.0.
PROBE_KINDS = ("chat", "completions", "native", "native-post")
PROBE_PATHS = {
    "chat": ENDPOINTS["chat"],
    "completions": ENDPOINTS["completions"],
    "native": ENDPOINTS["completion"],
    "native-post": ENDPOINTS["completion"],
}
# How people read the probe kinds (tables, the audit report).
PROBE_LABELS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "native": "/completion n_probs",
    "native-post": "/completion post_sampling_probs",
}
# --endpoint values -> probe kinds.
ENDPOINT_GROUPS: dict[str, tuple[str, ...]] = {
    "chat": ("chat",),
    "completion": ("completions", "native", "native-post"),
    "completions": ("completions",),
    "native": ("native", "native-post"),
    "all": PROBE_KINDS,
}
# Said where nothing tells whether the server speculates (no /slots, no draft counts):
# llama-cpp-python's prompt lookup, for one, speculates without saying so (docs/engines.md).
SILENT_SPECULATION = (
    " and no draft counts; it may speculate without saying so (llama-cpp-python's prompt "
    "lookup does): the logprob verdict reads each token's own candidates and holds either "
    "way; `specaudit dist --engine openai` tests its sampling distribution"
)
# Answers that mean "this endpoint does not exist here" rather than "it failed".
ABSENT_STATUS = (404, 405, 501)


class CheckError(SpecauditError):
    """No decision: the server is unreachable, failing, or not an LLM server."""


@dataclass(frozen=True)
class CheckSettings:
    """What every probe asks for; the same for all endpoints so their answers compare."""

    top_k: int = 3
    tokens: int = 24
    prompt: str = DEFAULT_PROMPT
    seed: int = 1
    temperature: float = 1.0
    kinds: tuple[str, ...] = PROBE_KINDS
    modes: tuple[bool, ...] = (False, True)  # stream off / on
    model: str | None = None  # "model" field, for OpenAI-compatible servers that need one


@dataclass
class EndpointResult:
    """One request (endpoint kind x stream mode) and its classified tokens."""

    kind: str  # "chat", "completions", "native", "native-post"
    path: str
    stream: bool
    # "ok"; "absent" (404/405/501); "error"; "no-logprobs" (no token carried any);
    # "empty" (no tokens generated)
    status: str
    error: str | None = None
    requested: int = 0
    total: int = 0
    real: int = 0
    placeholder: int = 0
    first_real: bool | None = None  # the first token comes from the normal path
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    server_tokens: int | None = None  # tokens the server says it generated (timings/usage)
    spec_types: str | None = None  # generation_settings speculative.types (native only)
    text: str = ""
    tokens: list[TokenRecord] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.kind + (" (stream)" if self.stream else "")

    @property
    def decided(self) -> bool:
        return self.status == "ok"


@dataclass
class Speculation:
    """Whether the server speculates, in the words of each source."""

    state: str  # "yes", "no", "unknown"
    summary: str  # one sentence, e.g. the /props vs /slots disagreement
    slots_total: int | None = None
    slots_speculative: int | None = None
    props_types: str | None = None  # /props default_generation_settings speculative.types
    request_types: str | None = None  # speculative.types echoed in a native response
    draft_n: int | None = None  # summed over the responses that reported it
    draft_n_accepted: int | None = None
    slots_note: str | None = None  # why /slots could not be read
    hidden: bool = False  # speculates while /props says "none"
    metrics: str | None = None  # what vLLM's /metrics says, when /slots could not be read


@dataclass
class SwitchProbe:
    """Does the per-request ``speculative.n_max: 0`` switch turn speculation off?"""

    verdict: str  # "honoured", "ignored", "undetermined", "error"
    detail: str
    kind: str | None = None
    draft_n: int | None = None
    draft_n_switch: int | None = None
    placeholder: int | None = None
    placeholder_switch: int | None = None


@dataclass
class CheckResult:
    url: str
    settings: CheckSettings
    speculation: Speculation
    endpoints: list[EndpointResult]
    switch: SwitchProbe | None
    verdict: str  # "real" or "placeholders"
    outcome: Outcome  # OK (real) or FINDING (placeholders)
    reason: str  # one line
    # `check --reference`: every token classified against a plain reference (with_reference)
    fidelity: FidelitySummary | None = None
    exit_code: int = field(init=False)  # outcome.exit_code, kept in the JSON for scripts

    def __post_init__(self) -> None:
        self.exit_code = self.outcome.exit_code

    @property
    def placeholders(self) -> int:
        return sum(e.placeholder for e in self.endpoints if e.decided)

    @property
    def real(self) -> int:
        return sum(e.real for e in self.endpoints if e.decided)

    def placeholders_by_endpoint(self) -> dict[str, int]:
        return {e.label: e.placeholder for e in self.endpoints if e.decided}


# ---------------------------------------------------------------------------------------------
# requests


def request_body(kind: str, s: CheckSettings) -> JSON:
    """The request for one probe kind: k candidates per token, same sampling everywhere."""
    common: JSON = {"temperature": s.temperature, "seed": s.seed}
    if s.model:
        common["model"] = s.model
    if kind == "chat":
        return {
            **common,
            "messages": [{"role": "user", "content": s.prompt}],
            "max_tokens": s.tokens,
            "logprobs": True,
            "top_logprobs": s.top_k,
        }
    if kind == "completions":
        return {**common, "prompt": s.prompt, "max_tokens": s.tokens, "logprobs": s.top_k}
    if kind in ("native", "native-post"):
        return {
            **common,
            "prompt": s.prompt,
            "n_predict": s.tokens,
            "n_probs": s.top_k,
            "post_sampling_probs": kind == "native-post",
        }
    raise ValueError(f"unknown probe kind {kind!r}")


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _timings(bodies: Sequence[JSON]) -> tuple[int | None, int | None, int | None]:
    """(draft_n, draft_n_accepted, predicted_n) from the last body that has timings/usage."""
    draft_n = accepted = predicted = None
    for b in bodies:
        t = b.get("timings")
        if isinstance(t, dict):
            draft_n = _int(t.get("draft_n"))
            accepted = _int(t.get("draft_n_accepted"))
            predicted = _int(t.get("predicted_n"))
        u = b.get("usage")
        if predicted is None and isinstance(u, dict):
            predicted = _int(u.get("completion_tokens"))
    return draft_n, accepted, predicted


def _text(kind: str, bodies: Sequence[JSON], stream: bool) -> str:
    parts: list[str] = []
    for b in bodies:
        if kind.startswith("native"):
            parts.append(str(b.get("content") or ""))
            continue
        for ch in b.get("choices") or []:
            if not isinstance(ch, dict):
                continue
            if stream:
                d = ch.get("delta")
                parts.append(str((d or {}).get("content") or "") if isinstance(d, dict) else "")
                parts.append(str(ch.get("text") or ""))
            else:
                m = ch.get("message")
                parts.append(str(m.get("content") or "") if isinstance(m, dict) else "")
                parts.append(str(ch.get("text") or ""))
    return "".join(parts)


def _looks_like_completion(kind: str, body: JSON) -> bool:
    if kind.startswith("native"):
        return "content" in body or "completion_probabilities" in body
    return isinstance(body.get("choices"), list)


def _has_logprobs(kind: str, bodies: Sequence[JSON]) -> bool:
    """Whether any body carried a logprobs structure at all (even an empty one)."""
    for b in bodies:
        if kind.startswith("native"):
            if isinstance(b.get("completion_probabilities"), list):
                return True
            continue
        for ch in b.get("choices") or []:
            if isinstance(ch, dict) and isinstance(ch.get("logprobs"), dict):
                return True
    return False


def probe(client: Client, kind: str, stream: bool, s: CheckSettings) -> EndpointResult:
    """Send one request and classify its tokens; failures become a status, not an exception."""
    path = PROBE_PATHS[kind]
    res = EndpointResult(kind=kind, path=path, stream=stream, status="ok", requested=s.top_k)
    body = request_body(kind, s)
    endpoint = "completion" if kind.startswith("native") else kind
    try:
        if stream:
            sr: StreamResult = client.stream(path, body)
            bodies = sr.events
            if not bodies:
                res.status, res.error = "error", f"{path} sent no stream events"
                return res
            records = logprobs.from_stream(endpoint, bodies, s.top_k)
        else:
            resp = client.post(path, body)
            bodies = [resp]
            records = logprobs.from_response(endpoint, resp, s.top_k)
    except ClientError as e:
        if e.status in ABSENT_STATUS:
            res.status, res.error = "absent", str(e)
        else:
            res.status, res.error = "error", str(e)
        return res
    if not any(_looks_like_completion(kind, b) for b in bodies):
        res.status, res.error = "error", f"{path} answered JSON that is not a completion"
        return res
    res.draft_n, res.draft_n_accepted, res.server_tokens = _timings(bodies)
    res.text = _text(kind, bodies, stream)
    for b in bodies:
        res.spec_types = speculation.response_types(b) or res.spec_types
    res.tokens = records
    c = logprobs.counts(records)
    res.total, res.real, res.placeholder = c.total, c.real, c.placeholder
    res.first_real = records[0].klass is TokenClass.REAL if records else None
    if not records and not res.text:
        res.status, res.error = "empty", f"{path} returned no tokens"
    elif c.real == 0 and not _has_logprobs(kind, bodies):
        # Nothing at all, not even on the first token: the server ignores the logprobs
        # request. That is a different fault from placeholders, and no evidence about them.
        res.status, res.error = "no-logprobs", f"{path} returned no logprobs for any token"
    return res


# ---------------------------------------------------------------------------------------------
# speculation


def read_speculation(client: Client) -> Speculation:
    """What /slots and /props say (`specaudit.speculation`). Connection failures propagate:
    nothing else will work."""
    info = speculation.read(client)
    m = info.metrics
    return Speculation(
        state="unknown" if info.speculates is None else ("yes" if info.speculates else "no"),
        summary="",
        slots_total=info.slots_total,
        slots_speculative=info.slots_speculative,
        props_types=info.props_types,
        slots_note=info.slots_note,
        metrics=m.describe() if m is not None and m.speculates is not None else None,
    )


def _summarise(spec: Speculation) -> None:
    """Fill `summary`/`hidden`/`state` once the responses' draft counts are known."""
    props_txt = (
        f"/props says speculative.types {spec.props_types}"
        if spec.props_types is not None
        else "/props says nothing about speculation"
    )
    drafted = (
        f"; the responses drafted {spec.draft_n} tokens, {spec.draft_n_accepted} accepted"
        if spec.draft_n
        else ""
    )
    if spec.request_types is not None and spec.request_types != spec.props_types:
        drafted += f"; a response's own settings say speculative.types {spec.request_types}"
    if spec.slots_total is None and spec.metrics is not None:  # vLLM: no /slots, no /props
        lead = "speculates" if spec.state == "yes" else "does not speculate"
        spec.summary = f"{lead}: {spec.metrics}{drafted}"
        spec.hidden = False  # said openly where vLLM says it
        return
    if spec.slots_total is None:
        if spec.draft_n or not speculation.claims_none(spec.request_types):
            spec.state = "yes"
            spec.summary = f"speculates: {spec.slots_note}, but{drafted[1:]}"
        else:
            spec.summary = f"unknown: {spec.slots_note}{SILENT_SPECULATION}"
        spec.hidden = spec.state == "yes" and speculation.claims_none(spec.props_types)
        return
    slots_txt = f"/slots says {spec.slots_speculative}/{spec.slots_total} slots speculate"
    if spec.state == "yes":
        spec.hidden = speculation.claims_none(spec.props_types)
        lead = "hidden speculation" if spec.hidden else "speculates"
        spec.summary = f"{lead}: {props_txt}; {slots_txt}{drafted}"
    else:
        spec.summary = f"does not speculate: {slots_txt}; {props_txt}{drafted}"


def switch_probe(
    client: Client, s: CheckSettings, results: Sequence[EndpointResult]
) -> SwitchProbe:
    """Re-send a drafting request with ``speculative.n_max: 0`` and compare draft_n."""
    base = next((r for r in results if not r.stream and r.decided and r.draft_n), None)
    base = base or next((r for r in results if not r.stream and r.decided), None)
    if base is None:
        # only streamed requests ran: send the plain twin of the first one to compare with
        first = next((r for r in results if r.decided), None)
        if first is None:
            return SwitchProbe("undetermined", "no request succeeded to compare with")
        base = probe(client, first.kind, False, s)
        if not base.decided:
            return SwitchProbe("error", f"request without the switch failed: {base.error}")
    body = {**request_body(base.kind, s), "speculative.n_max": 0}
    endpoint = "completion" if base.kind.startswith("native") else base.kind
    try:
        resp = client.post(base.path, body)
    except ClientError as e:
        return SwitchProbe("error", f"request with speculative.n_max 0 failed: {e}", base.kind)
    draft_n, _, _ = _timings([resp])
    ph = logprobs.counts(logprobs.from_response(endpoint, resp, s.top_k)).placeholder
    out = SwitchProbe(
        "undetermined",
        "",
        base.kind,
        draft_n=base.draft_n,
        draft_n_switch=draft_n,
        placeholder=base.placeholder,
        placeholder_switch=ph,
    )
    if not base.draft_n:
        out.detail = "nothing was drafted without the switch either, so it cannot be tested"
    elif draft_n:
        out.verdict = "ignored"
        out.detail = (
            f"ignored: with speculative.n_max 0 the server still drafted {draft_n} tokens "
            f"(vs {base.draft_n} without) and returned {ph} placeholders (vs {base.placeholder})"
        )
    else:
        out.verdict = "honoured"
        out.detail = (
            f"honoured: with speculative.n_max 0 nothing was drafted (vs {base.draft_n}) "
            f"and {ph} placeholders returned (vs {base.placeholder})"
        )
    return out


# ---------------------------------------------------------------------------------------------
# run


def _no_decision(url: str, results: Sequence[EndpointResult]) -> CheckError:
    if results and all(r.status == "absent" for r in results):
        paths = ", ".join(dict.fromkeys(r.path for r in results))
        return CheckError(f"{url} is not an LLM server: none of {paths} exists there")
    errors = [r for r in results if r.status == "error"]
    if errors:
        hint = ""
        if any("HTTP 400" in (r.error or "") for r in errors):
            hint = " (if the model cannot tokenize the prompt, pass --prompt)"
        return CheckError(f"no endpoint gave a usable answer: {errors[0].error}{hint}")
    other = [r for r in results if r.status not in ("ok", "absent")]
    if other:
        return CheckError(f"no decision: {other[0].error}")
    return CheckError(f"no decision: nothing was checked on {url}")


def _check_inputs(
    url: str,
    endpoint: str,
    prompt: str,
    seed: int,
    temperature: float,
    model: str | None,
    timeout: float,
    api_key: str | None,
) -> None:
    """One-line `CheckError`s for what cannot be sent (the CLI's option types say the same)."""
    validate.url(url, "URL", CheckError)
    if endpoint not in ENDPOINT_GROUPS:
        raise CheckError(f"unknown endpoint {endpoint!r}; choose from {', '.join(ENDPOINT_GROUPS)}")
    validate.text(prompt, "--prompt", allow_empty=False, error=CheckError)
    validate.integer(seed, "--seed", min=0, max=validate.MAX_SEED, error=CheckError)
    validate.number(temperature, "--temperature", min=0, error=CheckError)
    validate.number(
        timeout, "--timeout", min=0, min_open=True, max=validate.MAX_TIMEOUT, error=CheckError
    )
    if model is not None:
        validate.text(model, "--model", error=CheckError)
    if api_key is not None:
        validate.token(api_key, "--api-key", error=CheckError)


def run(
    url: str,
    *,
    top_k: int = 3,
    tokens: int = 24,
    endpoint: str = "all",
    prompt: str = DEFAULT_PROMPT,
    seed: int = 1,
    temperature: float = 1.0,
    stream: bool | None = None,
    model: str | None = None,
    timeout: float = 120.0,
    api_key: str | None = None,
    probe_switch: bool = True,
    reference: str | None = None,
) -> CheckResult:
    """Check one server. `stream`: None = both modes, True = streamed only, False = not.

    `reference`: a plain llama-server of the same model; every token of the native
    /completion probes is then also classified real and correct / real but wrong /
    placeholder / missing against it (`specaudit.check.with_reference`), and real but wrong is a
    finding like placeholders.

    Raises `CheckError` (or `ClientError`) when no decision is possible; every argument is
    checked first (one-line `CheckError`, nothing sent).
    """
    _check_inputs(url, endpoint, prompt, seed, temperature, model, timeout, api_key)
    _check_run_inputs(reference, top_k, tokens)
    modes = (False, True) if stream is None else (stream,)
    kinds = ENDPOINT_GROUPS[endpoint]
    s = CheckSettings(top_k, tokens, prompt, seed, temperature, kinds, modes, model)
    with Client(url, timeout=timeout, api_key=api_key) as client:
        spec = read_speculation(client)
        results = _probe_all(client, s)
        decided = [r for r in results if r.decided]
        _merge_request_speculation(spec, results)
        _summarise(spec)
        if not decided:
            raise _no_decision(url, results)
        switch = None
        if probe_switch and spec.state == "yes":
            switch = switch_probe(client, s, results)
    n_ph = sum(r.placeholder for r in decided)
    verdict, outcome, reason = _verdict(decided, results, n_ph)
    fid = None
    if reference is not None:
        from specaudit.check import with_reference

        fid = with_reference.run(
            url, reference, prompt=prompt, seed=seed, tokens=tokens, top_k=top_k,
            temperature=temperature, timeout=timeout, api_key=api_key,
        )  # fmt: skip
        verdict, outcome, reason = _with_fidelity(fid, n_ph, verdict, outcome, reason)
    return CheckResult(url, s, spec, results, switch, verdict, outcome, reason, fid)


def _check_run_inputs(reference: str | None, top_k: int, tokens: int) -> None:
    """`run`'s own arguments, after those shared with the other entry points."""
    if reference is not None:
        validate.url(reference, "--reference", CheckError)
    if top_k < 1:
        raise CheckError("--top-k must be at least 1: with no candidates requested nothing shows")
    if tokens < 2:
        raise CheckError("--tokens must be at least 2: the first token is never speculative")
    validate.integer(top_k, "--top-k", max=validate.MAX_INT32, error=CheckError)
    validate.integer(tokens, "--tokens", max=validate.MAX_INT32, error=CheckError)


def _probe_all(client: Client, s: CheckSettings) -> list[EndpointResult]:
    """One probe per (kind, mode), in order; an absent endpoint is not probed again streamed."""
    results: list[EndpointResult] = []
    for kind in s.kinds:
        for mode in s.modes:
            r = probe(client, kind, mode, s)
            results.append(r)
            if r.status == "absent":
                break  # the streamed twin of an absent endpoint is absent too
    return results


def _merge_request_speculation(spec: Speculation, results: Sequence[EndpointResult]) -> None:
    """What the responses themselves said about drafting overrides the server-wide view."""
    drafts = [r.draft_n for r in results if r.draft_n is not None]
    if drafts:
        spec.draft_n = sum(drafts)
        spec.draft_n_accepted = sum(r.draft_n_accepted or 0 for r in results)
    spec.request_types = next((r.spec_types for r in results if r.spec_types), None)


def _verdict(
    decided: Sequence[EndpointResult], results: Sequence[EndpointResult], n_ph: int
) -> tuple[str, Outcome, str]:
    """The verdict, outcome and one-line reason from the placeholder counts alone."""
    n_real = sum(r.real for r in decided)
    if n_ph:
        where = ", ".join(f"{r.label} {r.placeholder}/{r.total}" for r in decided if r.placeholder)
        verdict, outcome = "placeholders", Outcome.FINDING
        reason = f"{n_ph} placeholder logprobs (candidates requested, none returned): {where}"
    else:
        verdict, outcome = "real", Outcome.OK
        reason = f"every logprob is real: {n_real} tokens on {len(decided)} requests"
    absent = list(dict.fromkeys(r.path for r in results if r.status == "absent"))
    if absent:
        reason += "; absent: " + ", ".join(absent)
    failed = [f"{r.label} ({r.status})" for r in results if r.status not in ("ok", "absent")]
    if failed:
        reason += "; no decision on: " + ", ".join(failed)
    return verdict, outcome, reason


def _with_fidelity(
    fid: FidelitySummary, n_ph: int, verdict: str, outcome: Outcome, reason: str
) -> tuple[str, Outcome, str]:
    """The verdict once the reference has spoken: real but wrong logprobs are a finding too."""
    c = fid.counts
    line = (
        f"against the reference: {c.real_correct} real and correct, {c.real_wrong} real but "
        f"wrong, {c.placeholder} placeholders, {c.missing} missing"
    )
    if c.real_wrong:
        outcome = Outcome.FINDING
        verdict = "placeholders" if n_ph else "real but wrong"
        reason = f"{c.real_wrong} real but wrong logprobs ({line}); {reason}"
    else:
        reason += f"; {line}"
    return verdict, outcome, reason


__all__ = [
    "DEFAULT_PROMPT",
    "ENDPOINT_GROUPS",
    "PROBE_KINDS",
    "PROBE_LABELS",
    "CheckError",
    "CheckResult",
    "CheckSettings",
    "EndpointResult",
    "Speculation",
    "SwitchProbe",
    "probe",
    "read_speculation",
    "request_body",
    "run",
    "switch_probe",
]
