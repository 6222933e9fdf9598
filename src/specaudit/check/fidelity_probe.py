"""Logprob fidelity of a running server: ask it for its logprobs on every way a client can
(`ProbeKind`) and classify each token against a reference (`specaudit.fidelity`).

Why apart from the rules: this is the HTTP side (requests, streams, draft counts, a plain
server's own noise floor); the classes and the tolerance are pure functions of records and
answers, tested without a server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from specaudit.client import ENDPOINTS, Client
from specaudit.fidelity import (
    FidelityCounts,
    FidelityError,
    FidelityResult,
    NextTokenSource,
    NoiseFloor,
    TokenFidelity,
    Tolerance,
    classify,
    noise_floor,
)
from specaudit.logprobs import (
    Counts,
    TokenRecord,
    align,
    counts,
    from_response,
    from_stream,
    response_ids,
)
from specaudit.reference import ask_next_token, sampling_fields


@dataclass(frozen=True)
class ProbeKind:
    """One way of asking for probabilities: native ``/completion`` (``n_probs``) or
    ``/v1/chat/completions`` (``top_logprobs``), pre- or post-sampling, streamed or not."""

    endpoint: Literal["completion", "chat"]
    post: bool
    stream: bool = False

    @property
    def label(self) -> str:
        path = "/completion" if self.endpoint == "completion" else "/v1/chat/completions"
        return f"{path} {'post' if self.post else 'pre'}" + (" (stream)" if self.stream else "")


#: Both endpoints in both modes, and one streamed request per endpoint.
DEFAULT_KINDS = (
    ProbeKind("completion", False),
    ProbeKind("completion", True),
    ProbeKind("chat", False),
    ProbeKind("chat", True),
    ProbeKind("completion", True, stream=True),
    ProbeKind("chat", False, stream=True),
)


@dataclass(frozen=True)
class Probe:
    """One response, classified; `records` are `specaudit.check`'s view of the same tokens."""

    kind: ProbeKind
    seed: int
    records: tuple[TokenRecord, ...]
    result: FidelityResult
    draft_n: int | None = None
    draft_accepted: int | None = None


@dataclass(frozen=True)
class FidelityRun:
    """Every probe of one server: fidelity's counts next to check's placeholder counts."""

    url: str
    probes: tuple[Probe, ...]

    @property
    def counts(self) -> FidelityCounts:
        total = FidelityCounts()
        for p in self.probes:
            total = total + p.result.counts
        return total

    def counts_by_kind(self) -> dict[str, FidelityCounts]:
        out: dict[str, FidelityCounts] = {}
        for p in self.probes:
            out[p.kind.label] = out.get(p.kind.label, FidelityCounts()) + p.result.counts
        return out

    @property
    def check_counts(self) -> Counts:
        """What `specaudit.check`'s classification says of the same tokens."""
        return counts([r for p in self.probes for r in p.records])

    @property
    def uncompared(self) -> int:
        """Tokens with a value whose prefix is unknown (`FidelityResult.uncompared`)."""
        return sum(p.result.uncompared for p in self.probes)

    @property
    def drafted(self) -> tuple[int, int]:
        """(drafted, accepted) summed over the non-streamed responses that report them."""
        return (
            sum(p.draft_n or 0 for p in self.probes),
            sum(p.draft_accepted or 0 for p in self.probes),
        )

    def wrong(self) -> list[tuple[Probe, TokenFidelity]]:
        return [(p, t) for p in self.probes for t in p.result.wrong()]


def request_body(
    kind: ProbeKind,
    prompt: str | Sequence[int],
    sampling: Mapping[str, float | int],
    seed: int,
    tokens: int,
    n_probs: int,
) -> dict[str, Any]:
    """The request for one probe: `n_probs` candidates per token and the sampler fields the
    reference is asked with (`specaudit.reference.sampling_fields`: the same chain,
    settings and ``ignore_eos``, so both mean the same distribution; llama-server takes them on
    both endpoints)."""
    common: dict[str, Any] = {
        **sampling_fields(sampling),
        "seed": seed,
        "post_sampling_probs": kind.post,
    }
    if kind.endpoint == "chat":
        if not isinstance(prompt, str):
            raise FidelityError("a chat probe needs the prompt as text")
        return {
            **common,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "logprobs": True,
            "top_logprobs": n_probs,
        }
    text_or_ids = prompt if isinstance(prompt, str) else list(prompt)
    # return_tokens: a streamed chunk without probabilities still names its token id
    return {**common, "prompt": text_or_ids, "n_predict": tokens, "n_probs": n_probs,
            "return_tokens": True}  # fmt: skip


def _draft_counts(bodies: Sequence[dict[str, Any]]) -> tuple[int | None, int | None]:
    for b in reversed(bodies):
        t = b.get("timings")
        if isinstance(t, dict) and isinstance(t.get("draft_n"), int):
            acc = t.get("draft_n_accepted")
            return t["draft_n"], acc if isinstance(acc, int) else None
    return None, None


def records(
    kind: ProbeKind,
    bodies: Sequence[dict[str, Any]],
    n_probs: int,
    pieces: Callable[[Sequence[int]], Mapping[int, bytes]] | None = None,
) -> list[TokenRecord]:
    """One record per generated token of a probe's response, in order.

    Why not the entries as they come: llama-server writes no probability entry for a token
    whose text ends inside a UTF-8 character, so on a native ``/completion`` each entry is
    placed at its token among the response's ids (``return_tokens``; `specaudit.logprobs.align`),
    and a streamed response gets a missing record for every token it counts but never sent."""
    if kind.stream:
        return from_stream(kind.endpoint, bodies, n_probs, unsent=kind.endpoint == "completion")
    recs = from_response(kind.endpoint, bodies[0], n_probs)
    ids = response_ids(bodies[0]) if kind.endpoint == "completion" else None
    if ids is None:
        return recs
    bytes_of = pieces(ids) if pieces is not None and len(recs) != len(ids) else None
    return align(recs, ids, n_probs, bytes_of)


def probe_server(
    url: str,
    *,
    prompt: str | Sequence[int],
    prompt_ids: Sequence[int],
    reference: NextTokenSource,
    tol: Tolerance,
    sampling: Mapping[str, float | int],
    seeds: Iterable[int],
    tokens: int = 16,
    n_probs: int = 3,
    kinds: Sequence[ProbeKind] = DEFAULT_KINDS,
    vocabulary: Mapping[str, int] | None = None,
    pieces: Callable[[Sequence[int]], Mapping[int, bytes]] | None = None,
    timeout: float = 120.0,
) -> FidelityRun:
    """Ask a server for `tokens` tokens per seed and probe kind and classify every token.

    `prompt_ids` must be what the server makes of `prompt` on both endpoints (on the fixtures
    the chat template is the bare concatenation, so it is); `vocabulary` (piece -> id) lets a
    token streamed without an id extend the prefix; `pieces` (token ids -> their bytes, e.g.
    `specaudit.reference.ServerReference.pieces`) places a probability entry whose token id
    repeats around a character split into several tokens (`records`).
    """
    probes: list[Probe] = []
    with Client(url, timeout=timeout) as client:
        for seed in seeds:
            for kind in kinds:
                body = request_body(kind, prompt, sampling, seed, tokens, n_probs)
                path = ENDPOINTS["completion" if kind.endpoint == "completion" else "chat"]
                if kind.stream:
                    bodies = client.stream(path, body).events
                else:
                    bodies = [client.post(path, body)]
                recs = records(kind, bodies, n_probs, pieces)
                if not recs:
                    raise FidelityError(f"{kind.label} returned no tokens")
                res = classify(recs, prompt_ids, reference, tol, vocabulary)
                dn, da = _draft_counts(bodies)
                probes.append(Probe(kind, seed, tuple(recs), res, dn, da))
    return FidelityRun(url, tuple(probes))


def reclassify(
    run: FidelityRun,
    prompt_ids: Sequence[int],
    reference: NextTokenSource,
    tol: Tolerance,
    vocabulary: Mapping[str, int] | None = None,
) -> FidelityRun:
    """The same responses classified again with another tolerance (the reference is asked
    again only for prefixes it does not cache)."""
    probes = tuple(
        Probe(
            p.kind,
            p.seed,
            p.records,
            classify(p.records, prompt_ids, reference, tol, vocabulary),
            p.draft_n,
            p.draft_accepted,
        )  # fmt: skip
        for p in run.probes
    )
    return FidelityRun(run.url, probes)


def server_noise_floor(
    url: str,
    prefixes: Sequence[Sequence[int]],
    sampling: Mapping[str, float | int],
    n_probs: int,
    *,
    batches: Sequence[int] = (1, 2, 4),
    extra: NextTokenSource | None = None,
    timeout: float = 120.0,
) -> NoiseFloor:
    """The noise floor of a plain server: for each prefix, its answers when the same request
    comes `b` at a time for each `b` of `batches` (the server batches them across its slots),
    plus `extra`'s answer (e.g. the closed form) when given. Each answer is the reference's own
    request (`specaudit.reference.ask_next_token`), the prefix in one batch (no prompt
    cache); `n_probs` must cover the sampler's support."""
    groups = []
    for ids in prefixes:
        answers = [extra.next_token(ids)] if extra is not None else []
        for b in batches:
            with ThreadPoolExecutor(b) as ex:
                futs = [
                    ex.submit(
                        ask_next_token, url, ids, sampling, n_probs, cache_prompt=False,
                        timeout=timeout,
                    )
                    for _ in range(b)
                ]  # fmt: skip
                answers += [f.result() for f in futs]
        groups.append(answers)
    return noise_floor(groups)


__all__ = [
    "DEFAULT_KINDS",
    "FidelityRun",
    "Probe",
    "ProbeKind",
    "probe_server",
    "reclassify",
    "records",
    "request_body",
    "server_noise_floor",
]
