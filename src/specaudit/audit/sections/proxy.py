"""The audit's proxy section: one logprobs request and one plain request through the proxy in
front of the audit's own plain and speculating servers (fixture and Gemma).

It shows what the proxy is for: the logprobs request comes back with real values on every
token (the same request sent straight to the speculating server is shown beside it, full of
placeholders), and the plain request is served by the speculating server (``draft_n > 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from specaudit import logprobs
from specaudit.audit.context import AuditContext, Section
from specaudit.outcome import Outcome
from specaudit.proxy import H_BACKEND, ProxyConfig, serve_in_thread
from specaudit.report import md_table

TOP = 3


@dataclass
class DemoRow:
    model: str
    request: str  # "logprobs" or "plain"
    via: str  # "proxy" or "direct to spec"
    backend: str | None  # X-Specaudit-Backend, or the server sent to directly
    status: int
    tokens: int  # generated tokens (usage.completion_tokens)
    real: int | None  # tokens with real values; None when logprobs were not asked for
    placeholders: int | None
    mean_logprob: float | None  # over real values only
    draft_n: int | None
    draft_n_accepted: int | None


def _chat_body(model: str, with_logprobs: bool) -> dict[str, Any]:
    if model == "fixture":
        content, n = "abcabcab", 12  # the fixture's template concatenates its letters
    else:
        content, n = "Explain how a CPU branch predictor works.", 24
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": n,
        "temperature": 1.0,
        "seed": 1,
    }
    if with_logprobs:
        body.update(logprobs=True, top_logprobs=TOP)
    return body


def _row(model: str, request: str, via: str, backend: str | None, r: httpx.Response) -> DemoRow:
    body = r.json() if r.status_code == 200 else {}
    asked = request == "logprobs"
    recs = logprobs.from_response("chat", body, TOP if asked else 0)
    c = logprobs.counts(recs)
    timings = body.get("timings") or {}
    usage = body.get("usage") or {}
    return DemoRow(
        model=model,
        request=request,
        via=via,
        backend=backend,
        status=r.status_code,
        tokens=int(usage.get("completion_tokens", c.total)),
        real=c.real if asked else None,
        placeholders=c.placeholder if asked else None,
        mean_logprob=logprobs.mean_logprob(recs) if asked else None,
        draft_n=timings.get("draft_n"),
        draft_n_accepted=timings.get("draft_n_accepted"),
    )


def demo(proxy_url: str, spec_url: str, model: str, timeout: float = 300.0) -> list[DemoRow]:
    """The three requests of the section against a running proxy."""
    rows = []
    with httpx.Client(timeout=timeout) as c:
        path = "/v1/chat/completions"
        r = c.post(proxy_url + path, json=_chat_body(model, True))
        rows.append(_row(model, "logprobs", "proxy", r.headers.get(H_BACKEND), r))
        r = c.post(spec_url + path, json=_chat_body(model, True))
        rows.append(_row(model, "logprobs", "direct to spec", "spec", r))
        r = c.post(proxy_url + path, json=_chat_body(model, False))
        rows.append(_row(model, "plain", "proxy", r.headers.get(H_BACKEND), r))
    return rows


def problems(rows: list[DemoRow]) -> list[str]:
    out = []
    for r in rows:
        if r.via != "proxy":
            continue
        where = f"{r.model} {r.request} request"
        if r.status != 200:
            out.append(f"{where}: HTTP {r.status}")
        elif r.request == "logprobs":
            if r.backend != "plain":
                out.append(f"{where}: served by {r.backend}, not plain")
            if r.placeholders or r.real != r.tokens or not r.tokens:
                out.append(f"{where}: {r.real}/{r.tokens} real values")
        else:
            if r.backend != "spec":
                out.append(f"{where}: served by {r.backend}, not spec")
            if not r.draft_n:
                out.append(f"{where}: draft_n {r.draft_n}, the server did not speculate")
    return out


def section(ctx: AuditContext) -> Section:
    rows: list[DemoRow] = []
    for model in ("fixture", "gemma"):
        plain, spec = ctx.server(f"{model}-plain"), ctx.server(f"{model}-spec")
        ctx.progress(f"proxy in front of {model}-plain and {model}-spec")
        with serve_in_thread(ProxyConfig(plain.url, spec.url, port=0)) as px:
            rows += demo(px.url, spec.url, model)
    bad = problems(rows)
    table = md_table(
        [
            "model",
            "request",
            "sent",
            "served by",
            "tokens",
            "real",
            "placeholders",
            "mean logprob (real)",
            "draft_n (accepted)",
        ],
        [
            (
                r.model,
                r.request,
                r.via,
                r.backend,
                r.tokens,
                r.real,
                r.placeholders,
                r.mean_logprob,
                None if r.draft_n is None else f"{r.draft_n} ({r.draft_n_accepted})",
            )
            for r in rows
        ],
    )
    lp = [r for r in rows if r.via == "proxy" and r.request == "logprobs"]
    direct = [r for r in rows if r.via != "proxy"]
    verdict = (
        "Through the proxy every logprobs token is real ("
        + ", ".join(f"{r.model} {r.real}/{r.tokens}" for r in lp)
        + "); sent straight to the speculating server the same request gets "
        + ", ".join(f"{r.model} {r.placeholders}/{r.tokens}" for r in direct)
        + " placeholders. Requests without logprobs are served by the speculating server."
        if not bad
        else "The proxy did not do its job: " + "; ".join(bad) + "."
    )
    return Section(
        key="proxy",
        title="Proxy: real logprobs for those who ask, speed for the rest",
        markdown=table + "\n\n" + verdict,
        data={"rows": rows, "problems": bad},
        status=Outcome.FINDING if bad else Outcome.OK,
        summary=(
            "proxy routes correctly: logprobs all real, other requests speculate"
            if not bad
            else f"proxy problem: {bad[0]}"
        ),
    )
