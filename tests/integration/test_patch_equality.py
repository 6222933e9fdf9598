"""The spec-logprobs patch, checked token by token against the plain server (real binaries).

A speculating llama-server emits most tokens from its verification loop. Stock b11434 gives them
logprob 0 / prob 1 and no candidates; the patched server must report exactly what the plain
(non-speculating, stock) server reports for the same token after the same prefix: the target's
distribution at that position, pre-sampling (``n_probs`` / ``top_logprobs``) and after the
sampler chain (``post_sampling_probs``).

- Fixture (logits depend only on the last token): with greedy drafting the speculating server
  draws the same sample as the plain one for the same seed, so whole responses are compared,
  to 1e-5, on native ``/completion`` and ``/v1/chat/completions``, streamed and not. A stock
  speculating server answering the same requests is the control: it must show placeholders,
  or the comparison proves nothing. With probabilistic drafting (rejection sampling) and with
  synthetic acceptance (``--spec-synth-len``) the sample differs, so each token is compared
  with the plain server's answer for its own prefix.
- Gemma 3 270M as its own draft: same seeds, same comparison, to float tolerance. All Gemma
  servers run with ``--no-repack -fa on``: with the repacked Q4_K CPU kernels a multi-token
  batch (a verification, or a prompt) gives logits that differ from one-token decoding by up
  to ~0.2 in logprob, so even the plain server's numbers depend on how the prefix was batched.
  The patch reports the logits the target really sampled from; the flags only make the
  two servers' arithmetic comparable.
  Only verification batches of up to 4 tokens compare that closely (a 17-token batch
  already differs by ~0.05), hence short n-gram drafts on Gemma.
- ngram-mod on repetitive text (fixture and Gemma), and on the fixture each other n-gram type
  (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-cache, one server each with
  `presets.NGRAM_TYPE_ARGS`): no placeholder, same values as the plain server; stock servers
  of each type are the control.
- EAGLE3 (the fixture's EAGLE3 head, one slot) and greedy MTP (the mtp fixture, a glm4moe
  drafting with its own MTP layer, against its own plain server): sample-and-match, so whole
  replies are compared as for the greedy draft, every endpoint, streamed and not; MTP with a
  probabilistic draft (rejection sampling) per prefix. Stock servers of each path are the
  control.
- Checkpoint replay (the replay fixture, a Mamba target that cannot drop a rejected suffix):
  the greedy draft's whole replies, the probabilistic draft's tokens per prefix.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared_servers import SharedServers
from specaudit import fixtures
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries

TIMEOUT = 300.0

FIXTURE_TOL = 1e-5
GEMMA_TOL = 1e-3
GEMMA_ARGS = ("--no-repack", "-fa", "on")
GEMMA_CTX = 2048
NGRAM_ARGS: tuple[str, ...] = ("--spec-ngram-mod-n-match", "4", "--spec-ngram-mod-n-min", "1")
NGRAM_ARGS += ("--spec-ngram-mod-n-max", "3")

#: The field report's fixture sampler: top-k 3, T=1, top-p and min-p off.
FIXTURE_SAMPLER = fixtures.REPORT_SAMPLER.request_fields()
N_PROBS = 3


# -------------------------------------------------------------------------------------------
# talking to the servers


@dataclass(frozen=True)
class Tok:
    """One generated token as a response reports it."""

    id: int
    text: str
    value: float  # logprob (pre-sampling) or prob (post_sampling_probs)
    top: tuple[tuple[int, float], ...]  # candidates (id, logprob or prob), in order


@dataclass(frozen=True)
class Reply:
    text: str
    toks: list[Tok]
    draft_n: int
    draft_n_accepted: int


def _toks(items: list[dict[str, Any]], post: bool) -> list[Tok]:
    key, top_key = ("prob", "top_probs") if post else ("logprob", "top_logprobs")
    return [
        Tok(
            int(it["id"]),
            it["token"],
            float(it[key]),
            tuple((int(c["id"]), float(c[key])) for c in it[top_key]),
        )
        for it in items
    ]


def _sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    # llama-server closes the connection after a streamed reply: never reuse it
    limits = httpx.Limits(max_keepalive_connections=0)
    chunks = []
    with (
        httpx.Client(timeout=TIMEOUT, limits=limits) as client,
        client.stream("POST", url, json={**body, "stream": True}) as r,
    ):
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :].strip()
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
    return chunks


def _timings(d: dict[str, Any]) -> tuple[int, int]:
    t = d.get("timings") or {}
    return int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))


def native(
    base: str,
    prompt: str | list[int],
    *,
    seed: int,
    n_predict: int,
    post: bool = False,
    stream: bool = False,
    n_probs: int = N_PROBS,
    sampler: dict[str, Any] | None = None,
) -> Reply:
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": n_predict,
        "seed": seed,
        "n_probs": n_probs,
        "post_sampling_probs": post,
        "cache_prompt": False,
        **(sampler if sampler is not None else FIXTURE_SAMPLER),
    }
    if not stream:
        r = httpx.post(base + "/completion", json=body, timeout=TIMEOUT)
        r.raise_for_status()
        d = r.json()
        return Reply(d["content"], _toks(d["completion_probabilities"], post), *_timings(d))
    chunks = _sse(base + "/completion", body)
    items = [it for c in chunks for it in c.get("completion_probabilities", [])]
    draft = max((_timings(c) for c in chunks), default=(0, 0))
    return Reply("".join(c.get("content", "") for c in chunks), _toks(items, post), *draft)


def chat(
    base: str,
    content: str,
    *,
    seed: int,
    max_tokens: int,
    post: bool = False,
    stream: bool = False,
    sampler: dict[str, Any] | None = None,
) -> Reply:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "seed": seed,
        "logprobs": True,
        "top_logprobs": N_PROBS,
        "post_sampling_probs": post,
        "cache_prompt": False,
        **(sampler if sampler is not None else FIXTURE_SAMPLER),
    }
    if not stream:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=TIMEOUT)
        r.raise_for_status()
        d = r.json()
        choice = d["choices"][0]
        items = (choice.get("logprobs") or {}).get("content") or []
        return Reply(choice["message"]["content"] or "", _toks(items, post), *_timings(d))
    chunks = _sse(base + "/v1/chat/completions", body)
    text, items = "", []
    for c in chunks:
        for choice in c.get("choices", []):
            text += (choice.get("delta") or {}).get("content") or ""
            items += (choice.get("logprobs") or {}).get("content") or []
    draft = max((_timings(c) for c in chunks), default=(0, 0))
    return Reply(text, _toks(items, post), *draft)


# -------------------------------------------------------------------------------------------
# comparing


def placeholders(reply: Reply) -> int:
    """Tokens with candidates requested but none returned (the stock bug's signature)."""
    return sum(1 for t in reply.toks if not t.top)


@dataclass
class Tally:
    """Compared tokens and the largest difference seen, over a whole test."""

    tokens: int = 0
    max_diff: float = 0.0

    def add(self, n: int, diff: float) -> None:
        self.tokens += n
        self.max_diff = max(self.max_diff, diff)


def compare(ref: Reply, got: Reply, tol: float, *, same_sample: bool = True) -> tuple[int, float]:
    """Compare `got` with `ref` token by token while their tokens agree.

    Returns (tokens compared, max difference). With `same_sample` the two must agree on every
    token; otherwise comparison stops where they diverge (after that the prefixes differ).
    """
    if same_sample:
        assert [t.id for t in got.toks] == [t.id for t in ref.toks], (ref.text, got.text)
    n, diff = 0, 0.0
    for i, (a, b) in enumerate(zip(ref.toks, got.toks, strict=False)):
        if a.id != b.id:
            break
        where = f"token {i} {a.text!r}"
        assert b.top, f"{where}: placeholder (no candidates)"
        assert [c for c, _ in b.top] == [c for c, _ in a.top], f"{where}: {a.top} vs {b.top}"
        diff = max(
            diff,
            abs(a.value - b.value),
            *(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top, strict=True)),
        )
        assert diff <= tol, f"{where}: value differs by {diff:.3g} (> {tol})"
        n += 1
    return n, diff


# -------------------------------------------------------------------------------------------
# binaries and servers


@pytest.fixture(scope="module")
def fx(fixture_set: fixtures.FixtureSet) -> fixtures.FixtureSet:
    return fixture_set


class _Servers:
    """Starts named servers (`presets.server`, one slot each) into one ExitStack, each logging
    to ``<log_dir>/<name>.log``: this module's own, for the drafters that keep state across
    requests (the n-gram types) and the configurations no other test runs."""

    def __init__(self, stack: contextlib.ExitStack, log_dir: Path, kind: str) -> None:
        self.stack, self.log_dir, self.kind = stack, log_dir, kind

    def start(self, name: str, bins: LlamaBinaries, model: Path, **kw: Any) -> str:
        srv = presets.server(bins, model, kind=self.kind, parallel=1, name=name,
                             log_path=self.log_dir / f"{name}.log", **kw)  # fmt: skip
        return self.stack.enter_context(srv).url


@pytest.fixture(scope="module")
def fixture_servers(
    llama_bins: LlamaBinaries,
    patched_bins: LlamaBinaries,
    shared_servers: SharedServers,
    fx: fixtures.FixtureSet,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, str]]:
    draft = {"draft": fx.draft, "spec_type": "draft-simple"}

    def shared(bins: LlamaBinaries, path: str) -> str:
        return shared_servers.fixture(bins, fx, path).url

    with contextlib.ExitStack() as stack:
        s = _Servers(stack, tmp_path_factory.mktemp("patch-eq-fixture-logs"), "fixture")
        yield {
            "plain": shared(llama_bins, "plain"),
            "spec": shared(patched_bins, "greedy"),
            # the control: the same build without the patch
            "stock-spec": shared(llama_bins, "greedy"),
            "rejection": shared(patched_bins, "rejection"),
            "synth": s.start(
                "fx-synth", patched_bins, fx.target, **draft,
                extra_args=["--spec-synth-len", "3"],
            ),
            "ngram": s.start("fx-ngram", patched_bins, fx.target, spec_type="ngram-mod"),
            # EAGLE3: the fixture's EAGLE3 head drafts greedily (sample-and-match), patched and
            # (the control) stock
            **{
                f"{v}-eagle3": shared(bins, "eagle3")
                for v, bins in (("patched", patched_bins), ("stock", llama_bins))
            },
            # the other n-gram types, patched and (the control) stock, each with its flags
            **{
                f"{v}-{t}": s.start(
                    f"fx-{v}-{t}", bins, fx.target, spec_type=t,
                    extra_args=list(presets.NGRAM_TYPE_ARGS[t]),
                )
                for t in presets.NGRAM_TYPE_ARGS
                for v, bins in (("patched", patched_bins), ("stock", llama_bins))
            },
        }  # fmt: skip


# LLAMA_TRACE set: a replay server logs every checkpoint restore (`replay_restores`)
TRACE = {"LLAMA_TRACE": "1"}


def _path_servers(
    shared_servers: SharedServers,
    fs: fixtures.FixtureSet,
    paths: tuple[str, ...],
    llama_bins: LlamaBinaries,
    patched_bins: LlamaBinaries,
    patched_env: dict[str, str] | None = None,
) -> dict[str, str]:
    """A fixture's plain server, and for each of its speculative `paths` a patched server
    (started with `patched_env`) and (the control) a stock one: the session's
    (`shared_servers`; these drafters keep no state across requests)."""
    servers = {"plain": shared_servers.fixture(llama_bins, fs, "plain").url}
    for path in paths:
        servers[f"patched-{path}"] = shared_servers.fixture(
            patched_bins, fs, path, env=patched_env
        ).url
        servers[f"stock-{path}"] = shared_servers.fixture(llama_bins, fs, path).url
    return servers


@pytest.fixture(scope="module")
def mtp_fx(
    fixture_of_kind: Callable[[fixtures.FixtureKind], fixtures.FixtureSet],
) -> fixtures.FixtureSet:
    return fixture_of_kind("mtp")


@pytest.fixture(scope="module")
def mtp_servers(
    llama_bins: LlamaBinaries,
    patched_bins: LlamaBinaries,
    shared_servers: SharedServers,
    mtp_fx: fixtures.FixtureSet,
) -> dict[str, str]:
    """The mtp fixture (glm4moe with its own MTP layer, no draft model): plain, and each MTP
    path (`presets.MTP_PATHS`: greedy, probabilistic) patched and stock."""
    return _path_servers(shared_servers, mtp_fx, presets.MTP_PATHS, llama_bins, patched_bins)


@pytest.fixture(scope="module")
def replay_servers(
    llama_bins: LlamaBinaries,
    patched_bins: LlamaBinaries,
    shared_servers: SharedServers,
    replay_fixture: fixtures.FixtureSet,
) -> dict[str, str]:
    """The replay fixture (a Mamba target: a partial acceptance restores a checkpoint and
    replays the accepted tokens): plain, and each replay path (`presets.REPLAY_PATHS`: the
    draft model greedy, probabilistic) patched and stock. The patched servers run with
    LLAMA_TRACE set: they log every checkpoint restore (`replay_restores`)."""
    return _path_servers(
        shared_servers, replay_fixture, presets.REPLAY_PATHS, llama_bins, patched_bins, TRACE
    )


@pytest.fixture(scope="module")
def replay_logs(
    patched_bins: LlamaBinaries,
    shared_servers: SharedServers,
    replay_fixture: fixtures.FixtureSet,
    replay_servers: dict[str, str],
) -> dict[str, Path]:
    """Each replay path's patched server's log."""
    return {
        path: shared_servers.fixture(patched_bins, replay_fixture, path, env=TRACE).log_path
        for path in presets.REPLAY_PATHS
    }


RESTORE = re.compile(r"accepted +\d+/ *\d+ draft tokens \(restore checkpoint\)")


def replay_restores(replay_logs: dict[str, Path], path: str) -> int:
    """Checkpoint restores the patched server of a replay path has logged so far."""
    return len(RESTORE.findall(replay_logs[path].read_text(errors="replace")))


@pytest.fixture(scope="module")
def gemma_servers(
    llama_bins: LlamaBinaries,
    patched_bins: LlamaBinaries,
    gemma_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, str]]:
    g = gemma_path
    common: dict[str, Any] = {"ctx_per_slot": GEMMA_CTX, "extra_args": list(GEMMA_ARGS)}
    with contextlib.ExitStack() as stack:
        s = _Servers(stack, tmp_path_factory.mktemp("patch-eq-gemma-logs"), "gemma")
        yield {
            "plain": s.start("g-plain", llama_bins, g, **common),
            "spec": s.start(
                "g-spec", patched_bins, g, draft=g, spec_type="draft-simple", **common
            ),
            # short n-gram drafts: verification batches of up to 4 tokens, like draft-simple's
            # (a 17-token batch already computes logits that differ by ~0.05 in logprob)
            "ngram": s.start(
                "g-ngram", patched_bins, g, spec_type="ngram-mod",
                ctx_per_slot=GEMMA_CTX, extra_args=[*GEMMA_ARGS, *NGRAM_ARGS],
            ),
        }  # fmt: skip


# -------------------------------------------------------------------------------------------
# (a) fixture, greedy draft: same sample, same numbers

FIXTURE_SEEDS = range(1, 21)
FIXTURE_N = 16


@pytest.mark.parametrize("post", [False, True], ids=["pre", "post"])
@pytest.mark.parametrize("endpoint", ["native", "chat"])
def test_fixture_draft_equals_plain(
    fixture_servers: dict[str, str], fx: fixtures.FixtureSet, endpoint: str, post: bool
) -> None:
    prompt = fx.spec.prompt

    def ask(base: str, seed: int) -> Reply:
        if endpoint == "native":
            return native(base, prompt, seed=seed, n_predict=FIXTURE_N, post=post)
        return chat(base, prompt, seed=seed, max_tokens=FIXTURE_N, post=post)

    tally, accepted, stock_placeholders = Tally(), 0, 0
    for seed in FIXTURE_SEEDS:
        ref = ask(fixture_servers["plain"], seed)
        got = ask(fixture_servers["spec"], seed)
        assert len(got.toks) == FIXTURE_N
        assert got.text == ref.text, f"seed {seed}: the draft changed the sample"
        tally.add(*compare(ref, got, FIXTURE_TOL))
        accepted += got.draft_n_accepted
        stock_placeholders += placeholders(ask(fixture_servers["stock-spec"], seed))
    print(
        f"\n{endpoint}/{'post' if post else 'pre'}: {tally.tokens} tokens, "
        f"max diff {tally.max_diff:.3g}, {accepted} draft tokens accepted, "
        f"stock placeholders {stock_placeholders}"
    )
    assert tally.tokens == len(FIXTURE_SEEDS) * FIXTURE_N
    assert accepted > 0, "the draft was never accepted: the speculative path went untested"
    # the control: without the patch the same requests return placeholders
    assert stock_placeholders > len(FIXTURE_SEEDS), "stock server shows no placeholders"


@pytest.mark.parametrize("post", [False, True], ids=["pre", "post"])
def test_fixture_draft_streaming(
    fixture_servers: dict[str, str], fx: fixtures.FixtureSet, post: bool
) -> None:
    """Streamed replies carry the same per-token values as the plain server's."""
    tally = Tally()
    for seed in (3, 4, 5):
        for ask in (
            lambda base, s: native(
                base, fx.spec.prompt, seed=s, n_predict=FIXTURE_N, post=post, stream=True
            ),
            lambda base, s: chat(
                base, fx.spec.prompt, seed=s, max_tokens=FIXTURE_N, post=post, stream=True
            ),
        ):
            ref = ask(fixture_servers["plain"], seed)
            got = ask(fixture_servers["spec"], seed)
            assert len(got.toks) == FIXTURE_N and got.text == ref.text
            tally.add(*compare(ref, got, FIXTURE_TOL))
    assert tally.tokens == 6 * FIXTURE_N


# -------------------------------------------------------------------------------------------
# (a'') the other sample-and-match drafters: EAGLE3 (fixture head), MTP (the mtp fixture's
# layer), checkpoint replay (the replay fixture)

SAME_SAMPLE_SEEDS = range(1, 9)


@dataclass
class PathResult:
    """One speculating server's replies against the plain server's, seed by seed."""

    tally: Tally
    drafted: int
    accepted: int
    stock_placeholders: int


def same_sample_equality(
    plain: str, patched: str, stock: str, prompt: str, *, endpoint: str, post: bool, stream: bool
) -> PathResult:
    """For a drafter verified by sample-and-match: every seed's reply from `patched` is the
    plain server's sample with the plain server's values token for token; `stock` (the same
    path without the patch) is asked the same, and its placeholders counted."""

    def ask(base: str, seed: int) -> Reply:
        kw: dict[str, Any] = {"seed": seed, "post": post, "stream": stream}
        if endpoint == "native":
            return native(base, prompt, n_predict=FIXTURE_N, **kw)
        return chat(base, prompt, max_tokens=FIXTURE_N, **kw)

    res = PathResult(Tally(), 0, 0, 0)
    for seed in SAME_SAMPLE_SEEDS:
        ref = ask(plain, seed)
        got = ask(patched, seed)
        assert len(got.toks) == FIXTURE_N
        assert got.text == ref.text, f"seed {seed}: the draft changed the sample"
        res.tally.add(*compare(ref, got, FIXTURE_TOL))
        res.drafted += got.draft_n
        res.accepted += got.draft_n_accepted
        stock_reply = ask(stock, seed)
        assert stock_reply.text == ref.text, f"seed {seed}: stock changed the sample"
        # streamed, a stock placeholder token comes with no probabilities entry at all
        res.stock_placeholders += placeholders(stock_reply) + FIXTURE_N - len(stock_reply.toks)
    return res


def _assert_path_result(res: PathResult, label: str) -> None:
    print(
        f"\n{label}: {res.tally.tokens} tokens, max diff {res.tally.max_diff:.3g}, "
        f"draft {res.accepted}/{res.drafted}, stock placeholders {res.stock_placeholders}"
    )
    assert res.tally.tokens == len(SAME_SAMPLE_SEEDS) * FIXTURE_N
    assert res.accepted > 0, f"{label}: no draft token accepted, the speculative path went untested"
    # the control: without the patch the same requests return placeholders
    assert res.stock_placeholders > 0, f"{label}: the stock server shows no placeholders"


# each sample-and-match drafter: (its servers' fixture, its fixture set's fixture); the
# rejection paths `mtp-rejection` and `replay-rejection` run on the same servers' fixtures
SAME_SAMPLE_PATHS = {
    "eagle3": ("fixture_servers", "fx"),
    "mtp": ("mtp_servers", "mtp_fx"),
    "replay": ("replay_servers", "replay_fixture"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("post", [False, True], ids=["pre", "post"])
@pytest.mark.parametrize("endpoint", ["native", "chat"])
@pytest.mark.parametrize("path", list(SAME_SAMPLE_PATHS))
def test_sample_and_match_drafts_equal_plain(
    request: pytest.FixtureRequest, path: str, endpoint: str, post: bool, stream: bool
) -> None:
    """Drafts verified by sample-and-match give the plain server's sample and values, token
    for token: the fixture's EAGLE3 head (`eagle3`); greedy MTP drafts from the target's own
    MTP layer on the mtp fixture's glm4moe (`mtp`); checkpoint replay with a greedy draft on
    the replay fixture's Mamba model (`replay`: after a partial acceptance the accepted tokens
    are re-decoded and re-verified, and the logged checkpoint restores prove it ran). Each
    against the plain server of its own model."""
    servers_fixture, fs_fixture = SAME_SAMPLE_PATHS[path]
    servers: dict[str, str] = request.getfixturevalue(servers_fixture)
    fs: fixtures.FixtureSet = request.getfixturevalue(fs_fixture)
    logs: dict[str, Path] | None = (
        request.getfixturevalue("replay_logs") if path == "replay" else None
    )
    before = replay_restores(logs, path) if logs is not None else 0
    res = same_sample_equality(
        servers["plain"], servers[f"patched-{path}"], servers[f"stock-{path}"], fs.spec.prompt,
        endpoint=endpoint, post=post, stream=stream,
    )  # fmt: skip
    _assert_path_result(res, f"{path} {endpoint}/{'post' if post else 'pre'}/{stream=}")
    if logs is not None:
        restores = replay_restores(logs, path) - before
        print(f"  {restores} checkpoint restores (each followed by a replay)")
        assert restores > 0, "no checkpoint was restored: the replay path went untested"


# -------------------------------------------------------------------------------------------
# (a') fixture, tokens that are not the plain sample: per-token against the plain server


def check_per_prefix(
    plain: str, spec: str, fx: fixtures.FixtureSet, post: bool, seeds: range
) -> tuple[Tally, int, int]:
    """Each token of `spec`'s replies against the plain server's answer for that token's prefix.

    For replies whose sample differs from the plain server's (one request per prefix).
    Returns the tally, draft tokens accepted, draft tokens proposed.
    """
    tally, accepted, drafted = Tally(), 0, 0
    for seed in seeds:
        got = native(spec, fx.spec.prompt, seed=seed, n_predict=12, post=post)
        accepted += got.draft_n_accepted
        drafted += got.draft_n
        assert placeholders(got) == 0
        prefix = fx.spec.prompt
        for i, tok in enumerate(got.toks):
            # all candidates, so the token's own value can be looked up whatever it is
            ref = native(plain, prefix, seed=seed, n_predict=1, post=post, n_probs=fx.spec.n_vocab)
            full = dict(ref.toks[0].top)
            want = [c for c, _ in ref.toks[0].top[:N_PROBS]]
            assert [c for c, _ in tok.top] == want, f"seed {seed} token {i}"
            # outside the post-sampling candidates a token keeps the plain path's default, 1.0
            own = full.get(tok.id, 1.0)
            diff = max(abs(own - tok.value), *(abs(full[c] - v) for c, v in tok.top))
            assert diff <= FIXTURE_TOL, f"seed {seed} token {i} {tok.text!r}: off by {diff:.3g}"
            tally.add(1, diff)
            prefix += tok.text
    return tally, accepted, drafted


@pytest.mark.parametrize("post", [False, True], ids=["pre", "post"])
def test_fixture_rejection_sampling_per_prefix(
    fixture_servers: dict[str, str], fx: fixtures.FixtureSet, post: bool
) -> None:
    """Tokens drawn by rejection sampling, including residual draws after a rejected draft."""
    tally, accepted, drafted = check_per_prefix(
        fixture_servers["plain"], fixture_servers["rejection"], fx, post, range(1, 5)
    )
    print(
        f"\nrejection/{'post' if post else 'pre'}: {tally.tokens} tokens, "
        f"max diff {tally.max_diff:.3g}, {accepted}/{drafted} accepted"
    )
    assert drafted > accepted > 0, "need both accepted and rejected draft tokens"


@pytest.mark.parametrize("post", [False, True], ids=["pre", "post"])
@pytest.mark.parametrize("path", ["mtp-rejection", "replay-rejection"])
def test_rejection_sampling_per_prefix_mtp_and_replay(
    request: pytest.FixtureRequest, path: str, post: bool
) -> None:
    """Probabilistic drafts verified by rejection sampling, from the mtp fixture's MTP layer
    and, on the replay fixture, replayed after a checkpoint restore (`server_accept_replay`):
    accepted draft tokens and residual draws each carry the target's distribution at their
    prefix; the stock server's replies to the same requests show placeholders."""
    which = "mtp" if path in presets.MTP_PATHS else "replay"
    servers_fixture, fs_fixture = SAME_SAMPLE_PATHS[which]
    servers: dict[str, str] = request.getfixturevalue(servers_fixture)
    fs: fixtures.FixtureSet = request.getfixturevalue(fs_fixture)
    seeds = range(1, 5)
    tally, accepted, drafted = check_per_prefix(
        servers["plain"], servers[f"patched-{path}"], fs, post, seeds
    )
    stock_placeholders = sum(
        placeholders(
            native(servers[f"stock-{path}"], fs.spec.prompt, seed=seed, n_predict=12, post=post)
        )
        for seed in seeds
    )
    print(
        f"\n{path}/{'post' if post else 'pre'}: {tally.tokens} tokens, "
        f"max diff {tally.max_diff:.3g}, {accepted}/{drafted} accepted, "
        f"stock placeholders {stock_placeholders}"
    )
    assert tally.tokens == len(seeds) * 12
    assert drafted > accepted > 0, "need both accepted and rejected draft tokens"
    assert stock_placeholders > 0, f"the stock {path} server shows no placeholders"
    if which == "replay":
        restores = replay_restores(request.getfixturevalue("replay_logs"), path)
        print(f"  {restores} checkpoint restores so far (each followed by a replay)")
        assert restores > 0, "no checkpoint was restored: the replay path went untested"


@pytest.mark.parametrize("post", [False, True], ids=["pre", "post"])
def test_fixture_synthetic_acceptance_per_prefix(
    fixture_servers: dict[str, str], fx: fixtures.FixtureSet, post: bool
) -> None:
    """--spec-synth-len (benchmarking only) accepts draft tokens at random, unverified.

    The emitted tokens are then the draft's, not the target's samples; each still carries the
    target's distribution at its position.
    """
    tally, accepted, drafted = check_per_prefix(
        fixture_servers["plain"], fixture_servers["synth"], fx, post, range(1, 4)
    )
    assert accepted > 0 and tally.tokens == 3 * 12


# -------------------------------------------------------------------------------------------
# (c) n-gram drafting on repetitive text


def test_fixture_ngram_mod_no_placeholder(
    fixture_servers: dict[str, str], fx: fixtures.FixtureSet
) -> None:
    plain = fixture_servers["plain"]
    # the fixture's greedy continuation cycles, so a prompt made of it repeats itself
    cycle = native(
        plain, fx.spec.prompt, seed=0, n_predict=40, sampler={**FIXTURE_SAMPLER, "temperature": 0.0}
    ).text
    prompt = fx.spec.prompt + cycle
    sampler = {**FIXTURE_SAMPLER, "temperature": 0.3}
    tally, drafted = Tally(), 0
    for seed in range(1, 7):
        for post in (False, True):
            ref = native(plain, prompt, seed=seed, n_predict=FIXTURE_N, post=post, sampler=sampler)
            got = native(
                fixture_servers["ngram"],
                prompt,
                seed=seed,
                n_predict=FIXTURE_N,
                post=post,
                sampler=sampler,
            )
            assert placeholders(got) == 0
            tally.add(*compare(ref, got, FIXTURE_TOL))
            drafted += got.draft_n
    assert drafted > 0, "ngram-mod never drafted: the speculative path went untested"
    assert tally.tokens == 12 * FIXTURE_N


@pytest.mark.parametrize("ngram_type", list(presets.NGRAM_TYPE_ARGS))
def test_fixture_ngram_types_equal_plain(
    fixture_servers: dict[str, str], fx: fixtures.FixtureSet, ngram_type: str
) -> None:
    """ngram-simple, ngram-map-k, ngram-map-k4v, ngram-cache: same sample as the plain server
    (sample-and-match), every token's values the plain server's, pre- and post-sampling; the
    same requests to the stock server show placeholders (the comparison is not vacuous)."""
    plain = fixture_servers["plain"]
    cycle = native(
        plain, fx.spec.prompt, seed=0, n_predict=40, sampler={**FIXTURE_SAMPLER, "temperature": 0.0}
    ).text
    prompt = fx.spec.prompt + cycle
    sampler = {**FIXTURE_SAMPLER, "temperature": 0.3}
    tally, drafted, accepted, stock_placeholders = Tally(), 0, 0, 0
    for seed in range(1, 7):
        for post in (False, True):
            kw: dict[str, Any] = {"seed": seed, "n_predict": FIXTURE_N, "post": post}
            ref = native(plain, prompt, sampler=sampler, **kw)
            got = native(fixture_servers[f"patched-{ngram_type}"], prompt, sampler=sampler, **kw)
            assert placeholders(got) == 0
            tally.add(*compare(ref, got, FIXTURE_TOL))
            drafted += got.draft_n
            accepted += got.draft_n_accepted
            stock = native(fixture_servers[f"stock-{ngram_type}"], prompt, sampler=sampler, **kw)
            assert [t.id for t in stock.toks] == [t.id for t in ref.toks]
            stock_placeholders += placeholders(stock)
    print(
        f"\n{ngram_type}: {tally.tokens} tokens, max diff {tally.max_diff:.3g}, "
        f"draft {accepted}/{drafted}, stock placeholders {stock_placeholders}"
    )
    assert tally.tokens == 12 * FIXTURE_N
    assert accepted > 0, f"{ngram_type} never had a draft accepted: its path went untested"
    assert stock_placeholders > 0, f"stock {ngram_type} shows no placeholders"


# -------------------------------------------------------------------------------------------
# (b) Gemma 3 270M as its own draft, and ngram-mod on Gemma

GEMMA_PROMPT = "Explain how a CPU branch predictor works."
GEMMA_SAMPLER: dict[str, Any] = {"temperature": 1.0}
GEMMA_N = 40


@pytest.mark.gemma
@pytest.mark.parametrize("post", [False, True], ids=["pre", "post"])
@pytest.mark.parametrize("endpoint", ["native", "chat"])
def test_gemma_draft_equals_plain(gemma_servers: dict[str, str], endpoint: str, post: bool) -> None:
    def ask(base: str, seed: int) -> Reply:
        if endpoint == "native":
            prompt = f"<start_of_turn>user\n{GEMMA_PROMPT}<end_of_turn>\n<start_of_turn>model\n"
            return native(
                base, prompt, seed=seed, n_predict=GEMMA_N, post=post, sampler=GEMMA_SAMPLER
            )
        return chat(
            base, GEMMA_PROMPT, seed=seed, max_tokens=GEMMA_N, post=post, sampler=GEMMA_SAMPLER
        )

    ref = ask(gemma_servers["plain"], 1)
    got = ask(gemma_servers["spec"], 1)
    assert placeholders(got) == 0, f"{placeholders(got)} of {len(got.toks)} tokens empty"
    assert got.draft_n_accepted > 0
    n, diff = compare(ref, got, GEMMA_TOL, same_sample=False)
    print(
        f"\ngemma {endpoint}/{'post' if post else 'pre'}: {n}/{len(got.toks)} tokens compared, "
        f"max diff {diff:.3g}, draft {got.draft_n_accepted}/{got.draft_n}"
    )
    # the arithmetic matches closely enough that the samples agree; a divergence at a near-tie
    # is tolerated, but most of the reply must be compared
    assert n >= GEMMA_N // 2, f"samples diverged at token {n}"


@pytest.mark.gemma
def test_gemma_ngram_mod_no_placeholder(gemma_servers: dict[str, str]) -> None:
    content = (
        "Repeat this sentence four times, one per line: "
        "The quick brown fox jumps over the lazy dog near the quiet river bank."
    )
    sampler = {"temperature": 0.7}
    ref = chat(gemma_servers["plain"], content, seed=7, max_tokens=64, sampler=sampler)
    got = chat(gemma_servers["ngram"], content, seed=7, max_tokens=64, sampler=sampler)
    assert got.draft_n > 0, "ngram-mod never drafted on repetitive text"
    assert placeholders(got) == 0, f"{placeholders(got)} of {len(got.toks)} tokens empty"
    n, diff = compare(ref, got, GEMMA_TOL, same_sample=False)
    print(
        f"\ngemma ngram-mod: {n}/{len(got.toks)} tokens compared, max diff {diff:.3g}, "
        f"draft {got.draft_n_accepted}/{got.draft_n}"
    )
    assert n >= 32
