"""The rows of `check`'s tables, built once for both readers: the `specaudit check` terminal
tables (`cli/check_cmd.py`) and the audit report's check section (`audit/sections/check.py`).

Kept apart from `specaudit.check.probes`, which probes a server and classifies its tokens: this
module only says how a result reads, so the two renderings cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specaudit.check.probes import PROBE_LABELS, CheckResult, EndpointResult
from specaudit.logprobs import TokenRecord


@dataclass(frozen=True)
class EndpointRow:
    """One probe (endpoint kind x stream mode) as every table shows it."""

    endpoint: str  # how people read the probe kind, e.g. "/v1/chat/completions"
    stream: str  # "yes" or "no"
    decided: bool  # the probe got tokens to classify (otherwise the counts mean nothing)
    tokens: int
    real: int
    placeholder: int
    drafted: str  # "draft_n (accepted acc.)" or "-"
    verdict: str  # "real", "placeholders (k/n)", or the status and error


def endpoint_rows(result: CheckResult) -> list[EndpointRow]:
    """One row per probe, in the order the probes ran."""
    return [
        EndpointRow(
            endpoint=PROBE_LABELS[r.kind],
            stream="yes" if r.stream else "no",
            decided=r.decided,
            tokens=r.total,
            real=r.real,
            placeholder=r.placeholder,
            drafted=f"{r.draft_n} ({r.draft_n_accepted} acc.)" if r.draft_n is not None else "-",
            verdict=endpoint_verdict(r),
        )
        for r in result.endpoints
    ]


def fmt_logprob(r: TokenRecord) -> str:
    """The value, or what stood in for a missing one (post_sampling_probs sends prob 1)."""
    if r.logprob is not None:
        return f"{r.logprob:.6g}" + (f" (p={r.prob:.4g})" if r.prob is not None else "")
    if r.reported_logprob is not None:
        if r.form == "prob":
            return f"missing (sent prob {math.exp(r.reported_logprob):g})"
        return f"missing (sent {r.reported_logprob:g})"
    return "missing (no entry)"


def token_rows(r: EndpointResult) -> list[tuple[str, str, str, int, str]]:
    """(index, token, logprob, candidates, class) per token; the first token is marked."""
    return [
        (
            f"{t.index}" + (" first" if t.is_first else ""),
            repr(t.token),
            fmt_logprob(t),
            t.n_candidates,
            t.klass.value,
        )
        for t in r.tokens
    ]


def endpoint_verdict(r: EndpointResult) -> str:
    if r.status != "ok":
        return f"{r.status}: {r.error}" if r.error else r.status
    if r.placeholder:
        return f"placeholders ({r.placeholder}/{r.total})"
    return "real"


__all__ = ["EndpointRow", "endpoint_rows", "endpoint_verdict", "fmt_logprob", "token_rows"]
