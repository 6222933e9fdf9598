"""One re-scored run: sample the engine under test, ask the reference about every sampled
token's exact prefix, decide.

Why sampling and re-scoring interleave: each seed's prefixes go to the reference as soon as
its sample is drawn, so the two servers work at once, and a reference that dies mid-run loses
nothing already drawn (the result keeps every sample and says how many tokens were re-scored).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from specaudit.client import AsyncClient, ClientError
from specaudit.fixtures import SamplerSettings
from specaudit.llama import presets
from specaudit.llama.presets import draft_chain
from specaudit.outcome import Outcome
from specaudit.reference import (
    ModelIdentity,
    NextToken,
    NextTokenSource,
    Reference,
    ReferenceUnusable,
    SamplerBoundSource,
    aread_next_token,
    completion_body,
    identity_from_models,
    start_reference,
    support_size,
)
from specaudit.rescore import analysis, outside
from specaudit.rescore.analysis import RescoreStats
from specaudit.rescore.batching import Batching, SlotsWatch
from specaudit.rescore.control import CONTROL_REPEATS, Coupling, couple
from specaudit.rescore.flags import DraftFlag
from specaudit.rescore.outside import EdgeLeak, Key
from specaudit.rescore.records import RescoreError, TokenDraw
from specaudit.rescore.request import RescoreRequest, seed_jobs
from specaudit.rescore.sampling import (
    VLLM_PROBE_TOP,
    OpenAISampler,
    Sampler,
    SeededGeneration,
    ServerSampler,
    VllmSampler,
    vllm_top,
)
from specaudit.rescore.scores import ScoreTest
from specaudit.rescore.spread import (
    PROBE_TOLERANCE,
    AnyReference,
    OutsideSorter,
    measure_edge_leak,
    probe_difference,
    reference_spread,
)
from specaudit.vllm.reference import VllmReference, start_vllm_reference

BOUNDARY_MIN = 1e-3  # the smallest top-k boundary margin, in nats (float32 noise)
LOOK_EVERY = 16  # a sequential run reads its anytime evidence after every this many samples

# what a vLLM reference cannot give that a llama-server does, said in the run's notes
VLLM_REFERENCE_NOTE = (
    "the reference is a plain vLLM server (processed logprobs): vLLM has no slot to pin and "
    "no /slots, so its noise floor and top-k edge leak are measured in the batch shapes a "
    "client can cause (four identical requests at once, the prefix batched with its shorter "
    "prefixes, the prefix again on what that left in its prefix cache), not llama-server's "
    "last-k-tokens-on-a-cached-prefix shapes; that it does not speculate is read from its "
    "/metrics; its raw logprobs are its processed ones asked with nothing to process"
)

ProgressFn = Callable[[int, int], None]
# (reference, first prompt's ids) -> TV between what the engine runs and the reference, or None
ProbeFn = Callable[[AnyReference, Sequence[int]], Awaitable[float | None]]


@dataclass
class RescoreResult:
    """What a re-scored run drew, re-scored and decided. `stats` is None when nothing could
    be decided (`error` says why); `rescored` < `sampled_tokens` when the reference failed
    part-way (every sample is still in `samples`)."""

    engine: str
    reference: str
    identity: ModelIdentity | None
    prompts: list[list[int]]
    seeds: int
    tokens: int
    sampler: SamplerSettings
    samples: list[SeededGeneration] = field(default_factory=list)
    rescored: int = 0
    stats: RescoreStats | None = None
    error: str | None = None
    drafted: int | None = None
    accepted: int | None = None
    probe_tv: float | None = None
    total_seconds: float = 0.0
    reference_requests: int = 0
    unreported: int = 0  # --self: tokens the engine reported no covering distribution for
    boundary: int = 0  # tokens outside the top-k at its edge (counted in `outside`, no PIT)
    far: set[Key] = field(default_factory=set)  # draws outside the top-k in every batch shape
    edge: EdgeLeak | None = None  # the reference's own leak across its top-k edge
    stopped_at: int | None = None  # --sequential: samples read when the evidence decided
    # the reference sampled at the same seeds, decided beside the engine (`rescore.control`)
    control: RescoreResult | None = field(default=None, repr=False)
    coupling: Coupling | None = None
    noise_tv: float | None = None  # the reference's own spread across batch shapes
    noise_logprob: float | None = None
    path: str | None = None  # the verification path a registry engine's unit runs
    # the engine's /slots while it sampled: were requests batched, did it speculate
    batching: Batching | None = None
    notes: list[str] = field(default_factory=list)  # e.g. the impossible tokens, named
    draws: list[TokenDraw] = field(default_factory=list, repr=False)
    # the same run at another temperature (`RescoreRequest.arm_temperature`), its own family;
    # each arm was decided at alpha / 2, and `outcome` is both together
    arm: RescoreResult | None = field(default=None, repr=False)

    @property
    def sampled_tokens(self) -> int:
        return sum(len(s.ids) for s in self.samples)

    @property
    def own_outcome(self) -> Outcome:
        """This arm's alone."""
        if self.stats is None or self.error is not None:
            return Outcome.NO_DECISION
        return self.stats.verdict.outcome

    @property
    def outcome(self) -> Outcome:
        """With a temperature arm: a finding if either arm is BROKEN (each was decided at
        alpha / 2, so together they keep alpha), OK only if both are, else no decision."""
        own = self.own_outcome
        if self.arm is None:
            return own
        both = (own, self.arm.own_outcome)
        if Outcome.FINDING in both:
            return Outcome.FINDING
        return Outcome.OK if both == (Outcome.OK, Outcome.OK) else Outcome.NO_DECISION

    @property
    def exit_code(self) -> int:
        return self.outcome.exit_code


@contextlib.contextmanager
def reference_refusals() -> Iterator[None]:
    """The reference client's refusals (`ReferenceUnusable`: it speculates, it is another model,
    it cannot cover the support) as the run's own one-line `RescoreError`: whichever part
    refuses, a run that cannot be made is a RescoreError."""
    try:
        yield
    except ReferenceUnusable as e:
        raise RescoreError(str(e)) from None


def run(req: RescoreRequest, progress: ProgressFn | None = None) -> RescoreResult:
    """Run `req`, starting (and always stopping) a reference server when given a model, and
    a draft server when given a draft model."""
    with reference_refusals(), contextlib.ExitStack() as stack:
        if req.self_check:
            return asyncio.run(_run_self(req, progress))
        threads = presets.shared_threads(servers_at_work(req))
        if req.draft_model is not None:
            draft_url = stack.enter_context(
                start_reference(req.draft_model, parallel=req.concurrency, threads=threads)
            )
            req = dataclasses.replace(req, draft_url=draft_url, draft_model=None)
        url = req.reference_url
        if req.reference_model is not None:
            url = stack.enter_context(
                start_reference(req.reference_model, parallel=req.concurrency, threads=threads)
            )
        if req.reference_vllm is not None:
            url = stack.enter_context(start_vllm_reference(req.reference_vllm, threads=threads))
        assert url is not None
        if req.arm_temperature is None:
            return asyncio.run(run_against(req, url, progress))
        return asyncio.run(_with_arm(req, url, progress))


def servers_at_work(req: RescoreRequest) -> int:
    """llama-servers computing at once on this machine during the run: the ones it starts
    (reference, draft) and the engine under test when it is local. Each started one gets its
    share of the cores (`presets.shared_threads`)."""
    host = urlsplit(req.url).hostname or ""
    local = host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
    started = (req.reference_model, req.reference_vllm, req.draft_model)
    return sum(x is not None for x in started) + local


async def _with_arm(
    req: RescoreRequest, ref_url: str, progress: ProgressFn | None
) -> RescoreResult:
    """The run at its own settings, then again at `req.arm_temperature`, each a family of its
    own at alpha / 2 (Bonferroni over the two arms: valid whatever the dependence between
    them; both draw the same seeds). The arm is skipped when the first run could not decide."""
    assert req.arm_temperature is not None
    half = dataclasses.replace(req, alpha=req.alpha / 2, arm_temperature=None)
    res = await run_against(half, ref_url, progress)
    if res.error is not None or res.stats is None:
        return res
    n = req.seeds * req.n_prompts
    sampler = dataclasses.replace(req.sampler, temperature=req.arm_temperature)
    # a closed-form draft answers at the arm's settings; one that cannot is left out (q aims
    # the tests, it never makes them valid); a draft server is asked at the arm's settings
    draft = req.draft.at(sampler) if isinstance(req.draft, SamplerBoundSource) else None
    arm = dataclasses.replace(
        half, sampler=sampler, draft=draft,
        label=f"{req.label or req.url} at T = {req.arm_temperature:g}",
    )  # fmt: skip
    res.arm = await run_against(
        arm, ref_url, (lambda done, _t: progress(n + done, 2 * n)) if progress else None
    )
    return res


def _url_sampler(req: RescoreRequest, ref: AnyReference) -> Sampler:
    """The engine at `req.url`, sampled by its protocol (`req.engine`)."""
    if req.engine == "server":
        return ServerSampler(
            req.url, req.sampler, req.tokens, label=req.label,
            timeout=req.timeout, concurrency=req.concurrency,
        )  # fmt: skip
    if req.engine == "vllm":
        return VllmSampler(
            req.url, req.sampler, req.tokens, model=req.vllm_model,
            label=req.label, timeout=req.timeout, concurrency=req.concurrency,
        )  # fmt: skip
    return OpenAISampler(
        req.url, req.sampler, req.tokens, ref, model=req.model, label=req.label,
        timeout=req.timeout, concurrency=req.concurrency,
    )  # fmt: skip


async def _engine_identity(req: RescoreRequest) -> ModelIdentity | None:
    if req.engine != "server":
        return None
    async with AsyncClient(req.url, timeout=req.timeout) as c:
        try:
            return identity_from_models(await c.get("/v1/models"))
        except ClientError as e:
            raise RescoreError(f"the engine under test: {e}") from None


def open_reference(
    req: RescoreRequest, url: str, sampler: SamplerSettings | None = None, concurrency: int = 0
) -> AnyReference:
    """The client of the run's reference at `url` (`req.reference_engine`: a plain
    llama-server or a plain vLLM server), answering under `sampler` (default the run's)."""
    cls = VllmReference if req.reference_engine == "vllm" else Reference
    return cls(
        url, sampler or req.sampler, timeout=req.timeout,
        concurrency=concurrency or req.concurrency,
    )  # fmt: skip


async def _probe(req: RescoreRequest, ref: AnyReference, ids: Sequence[int]) -> float | None:
    """TV between engine and reference next-token distributions for the first prompt (its
    first token always comes from the normal path, never the speculative loop). vLLM is asked
    for its top tokens at temperature 1 with nothing truncated (`sampling.vllm_top`), the
    reference at that top-k and temperature 1."""
    if req.engine == "vllm":
        # never more than the vocabulary: a speculating vLLM 0.32 dies on it (docs/vllm.md)
        k = min(VLLM_PROBE_TOP, req.sampler.top_k or VLLM_PROBE_TOP, ref.n_vocab or VLLM_PROBE_TOP)
        neutral = SamplerSettings(top_k=k, top_p=1.0, min_p=0.0, temperature=1.0)
        try:
            got = await vllm_top(req.url, ids, k, model=req.vllm_model, timeout=req.timeout)
        except ClientError as e:
            raise RescoreError(f"the engine under test: {e}") from None
        async with open_reference(req, ref.url, neutral, concurrency=1) as at_k:
            await at_k.prepare()
            want = await at_k.next_token(ids)
        return probe_difference(got, want.probs)
    if req.engine != "server":
        return None
    nt = await ref.next_token(ids)
    async with AsyncClient(req.url, timeout=req.timeout) as c:
        probs, _ = await aread_next_token(
            c, completion_body(ids, req.sampler, len(nt.probs) + 8), post=True
        )
    return probe_difference(probs, nt.probs)


async def run_against(
    req: RescoreRequest,
    ref_url: str,
    progress: ProgressFn | None,
    *,
    engine: Sampler | None = None,
    probe: ProbeFn | None = None,
) -> RescoreResult:
    """`req` against the reference at `ref_url`. `engine` and `probe` replace the sampler
    built from `req.engine` and the same-model probe of a llama-server (`rescore.engines`
    passes a `dist` engine and the fixture's closed form); `engine` is closed once sampling
    starts."""
    t0 = time.monotonic()
    async with (
        open_reference(req, ref_url) as ref,
        contextlib.AsyncExitStack() as stack,
    ):
        ident = await ref.prepare()
        draft = await _open_draft(req, ident, stack)
        eng_ident = await _engine_identity(req)
        if eng_ident is not None and (diff := ident.differences(eng_ident)):
            raise RescoreError(
                f"engine and reference do not serve the same model: {', '.join(diff)}"
            )
        prompts = [list(p) for p in req.prompt_ids] or [await ref.tokenize(t) for t in req.prompts]
        n_probs = support_size(req.sampler, ident.n_vocab)
        tv_floor, lp_floor = await reference_spread(ref, prompts[0], n_probs, req.timeout)
        tv = await (probe or (lambda r, ids: _probe(req, r, ids)))(ref, prompts[0])
        allowed = max(PROBE_TOLERANCE, 2 * tv_floor)
        if tv is not None and tv > allowed:
            raise RescoreError(
                f"engine and reference do not serve the same model: their next-token "
                f"distributions for the first prompt differ by TV {tv:.3f} (> {allowed:.3f}, "
                f"twice the reference's own spread across batch shapes or {PROBE_TOLERANCE})"
            )
        sampler = engine if engine is not None else _url_sampler(req, ref)
        res = RescoreResult(
            engine=req.label or req.url, reference=ref_url, identity=ident, prompts=prompts,
            seeds=req.seeds, tokens=req.tokens, sampler=req.sampler, probe_tv=tv,
            noise_tv=tv_floor, noise_logprob=lp_floor,
        )  # fmt: skip
        if isinstance(ref, VllmReference):
            res.notes.append(VLLM_REFERENCE_NOTE)
        margin = max(2 * lp_floor, BOUNDARY_MIN)
        edges = OutsideSorter(ref, prompts, n_probs, margin, req.timeout)
        watch = (
            SlotsWatch(req.url, req.concurrency, timeout=req.timeout)
            if engine is None and req.engine == "server"
            else None
        )
        try:
            async with watch or contextlib.nullcontext():
                await _sample_and_rescore(
                    req, sampler, (ref, draft), prompts, res, progress, classify=edges
                )
            res.batching = watch.result() if watch is not None else None
            if res.error is None:
                res.far, res.boundary = edges.far, edges.near
                res.edge = await measure_edge_leak(
                    ref, res.prompts, res.draws, n_probs, req.alpha, req.timeout
                )
            if res.error is None and (req.control or req.coupling):
                await _control_arm(req, (ref, draft), res, n_probs, margin)
        finally:
            await sampler.aclose()
            res.reference_requests = ref.requests
            run_counts = getattr(sampler, "run_counts", None)
            if res.drafted is None and run_counts is not None:  # counted for the whole run
                res.drafted, res.accepted = run_counts
    res.total_seconds = time.monotonic() - t0
    if res.error is None:
        extra = []
        if req.coupling and res.coupling is not None:
            c = res.coupling
            extra.append(ScoreTest("same-seed coupling", c.rate, c.p_value, c.summary()))
        res.stats = _decide(req, res, lp_floor, extra)
        if res.control is not None:
            res.control.stats = _decide(req, res.control, lp_floor, [])
    return res


def _decide(
    req: RescoreRequest, res: RescoreResult, lp_floor: float, extra: Sequence[ScoreTest]
) -> RescoreStats:
    return analysis.analyse(
        res.draws, alpha=req.alpha, sequential=req.sequential, tolerance=req.tolerance,
        ratio_bound=math.exp(2 * lp_floor), extra=extra, edge=res.edge, far=res.far,
    )  # fmt: skip


async def _control_arm(
    req: RescoreRequest,
    sources: tuple[AnyReference, NextTokenSource | None],
    res: RescoreResult,
    n_probs: int,
    margin: float,
) -> None:
    """The reference sampled at the engine's seeds (`rescore.control`): its own samples
    re-scored and its tokens outside the top-k classified as the engine's are, against the
    same measured leak (`res.control`, decided beside
    the engine's), and the same-seed coupling against the engine's samples, with the
    reference asked again for `CONTROL_REPEATS` of them."""
    ref = sources[0]
    smp: ServerSampler | VllmSampler
    if isinstance(ref, VllmReference):  # its own API, its own ids; no drafts to count
        smp = VllmSampler(
            ref.url, req.sampler, req.tokens, model=ref.model, label="reference (control)",
            timeout=req.timeout, concurrency=req.concurrency,
        )  # fmt: skip
    else:
        smp = ServerSampler(
            ref.url, req.sampler, req.tokens, label="reference (control)", timeout=req.timeout,
            concurrency=req.concurrency,
        )  # fmt: skip
    sem = asyncio.Semaphore(req.concurrency)

    async def draw(g: SeededGeneration) -> SeededGeneration:
        async with sem:
            return await _draw(smp, g.prompt, res.prompts[g.prompt], g.seed)

    try:
        own = list(await asyncio.gather(*(draw(g) for g in res.samples)))
        again = list(await asyncio.gather(*(draw(g) for g in res.samples[:CONTROL_REPEATS])))
    finally:
        await smp.aclose()
    ctl = dataclasses.replace(
        res, engine=smp.label, samples=own, draws=[], rescored=0, boundary=0, control=None
    )
    edges = OutsideSorter(ref, res.prompts, n_probs, margin, req.timeout)
    for g in own:
        got = await _rescored(sources, g.seed, g.prompt, res.prompts[g.prompt], g.ids, g.flags)
        await edges.classify(got)
        ctl.draws += got
    ctl.rescored = len(ctl.draws)
    ctl.far, ctl.boundary = edges.far, edges.near
    _counts(ctl)
    res.control = ctl
    res.coupling = couple(res.samples, own, again)


async def _open_draft(
    req: RescoreRequest, ident: ModelIdentity, stack: contextlib.AsyncExitStack
) -> NextTokenSource | None:
    """The draft's distributions for the run: a plain llama-server serving the draft model
    (checked as a reference is: it must not speculate, and it must share the reference's
    vocabulary), else `req.draft` (a closed form), else None."""
    if req.draft_url is None:
        return req.draft
    chain = draft_chain(req.sampler, req.draft_top_k)
    draft = await stack.enter_async_context(
        Reference(req.draft_url, chain, timeout=req.timeout, concurrency=req.concurrency)
    )
    try:
        d_ident = await draft.prepare()
    except ReferenceUnusable as e:
        raise RescoreError(f"the draft: {e}") from None
    if (d_ident.n_vocab, d_ident.vocab_type) != (ident.n_vocab, ident.vocab_type):
        raise RescoreError(
            f"the draft {req.draft_url} does not share the reference's vocabulary "
            f"(n_vocab {d_ident.n_vocab} vs {ident.n_vocab})"
        )
    return draft


def generated_ids(res: RescoreResult, d: TokenDraw) -> list[int]:
    """The tokens generated before draw `d` (its prefix without the prompt)."""
    return outside.generated_ids(d)


async def _ask(ref: NextTokenSource, prefix: Sequence[int]) -> NextToken:
    """The reference's answer, asked again once after a transport error: an in-process
    engine (transformers, OpenVINO) holds the event loop while it generates, long enough for
    the reference to close an idle keep-alive connection that is then reused (a ReadError).
    The question is a pure read, so asking again is safe; a reference that is down fails
    twice."""
    try:
        return await ref.next_token(prefix)
    except ClientError:
        return await ref.next_token(prefix)


async def _draw(sampler: Sampler, prompt: int, ids: Sequence[int], seed: int) -> SeededGeneration:
    """One seeded sample, drawn again once after a transport error (no HTTP status): a
    keep-alive connection the engine closed while the event loop was held (a progress
    callback that stops a server, an in-process engine) fails on reuse. Its answer was never
    read, so drawing the seed again loses nothing and counts nothing twice; an engine that is
    down fails twice."""
    try:
        return await sampler.sample(prompt, ids, seed)
    except ClientError as e:
        if e.status is not None:
            raise
        return await sampler.sample(prompt, ids, seed)


async def _sample_and_rescore(
    req: RescoreRequest,
    sampler: Sampler,
    sources: tuple[AnyReference, NextTokenSource | None],
    prompts: list[list[int]],
    res: RescoreResult,
    progress: ProgressFn | None,
    *,
    classify: OutsideSorter | None = None,
) -> None:
    """Sample every job and re-score it; `classify` sorts each generation's tokens outside
    the reference's top-k as soon as it is re-scored, so a sequential run stops at an
    impossible token at once."""
    far: set[Key] = classify.far if classify is not None else set()
    jobs = seed_jobs(req.seed_start, req.seeds, len(prompts))
    sem = asyncio.Semaphore(req.concurrency)
    samples: dict[tuple[int, int], SeededGeneration] = {}
    draws: dict[tuple[int, int], list[TokenDraw]] = {}
    ref_failed: list[str] = []
    eng_failed: list[str] = []
    done = [0]
    looks = _Looks(jobs, req.alpha) if req.sequential else None

    async def one(seed: int, p: int) -> None:
        if eng_failed or (looks and looks.decided_at):
            return
        async with sem:
            try:
                s = await _draw(sampler, p, prompts[p], seed)
            except (ClientError, RescoreError) as e:
                eng_failed.append(str(e))
                return
        samples[(seed, p)] = s
        if ref_failed:
            return
        try:
            got = await _rescored(sources, seed, p, prompts[p], s.ids, s.flags)
            await OutsideSorter.sort(classify, got)
            draws[(seed, p)] = got
        except (ClientError, ReferenceUnusable, RescoreError) as e:
            if not ref_failed:
                ref_failed.append(str(e))
            return
        done[0] += 1
        if looks:
            looks.completed(draws, far)
        if progress:
            progress(done[0], len(jobs))

    tasks = [asyncio.ensure_future(one(s, p)) for s, p in jobs]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        res.samples = [samples[k] for k in sorted(samples)]
    res.draws = [d for k in sorted(draws) for d in draws[k]]
    res.rescored = len(res.draws)
    res.stopped_at = looks.decided_at if looks else None
    _counts(res)
    wanted = len(jobs) if res.stopped_at is None else len(samples)
    res.error = _failure(res, wanted, eng_failed, ref_failed)


class _Looks:
    """A sequential run's looks: after every `LOOK_EVERY` samples completed in sampling order
    (the first k jobs, whatever finished beyond them), the anytime-valid evidence is read on
    them, and at once when a token impossible in every batch shape arrives; once it decides
    (`analysis.anytime_decides`), no new sample starts. Stopping on
    evidence valid at every look keeps the level; the jobs' order never depends on N
    (`seed_jobs`), so a longer run is the same run continued."""

    def __init__(self, jobs: Sequence[tuple[int, int]], alpha: float) -> None:
        self.jobs = list(jobs)
        self.alpha = alpha
        self.ready = 0  # the first `ready` jobs are all complete
        self.looked = 0
        self.decided_at: int | None = None  # samples read when the evidence decided

    def completed(
        self, draws: dict[tuple[int, int], list[TokenDraw]], far: Collection[Key] = ()
    ) -> None:
        while self.ready < len(self.jobs) and self.jobs[self.ready] in draws:
            self.ready += 1
        if self.decided_at is None and far:
            # an impossible token: the outside count test rejects on it (`anytime_decides`)
            self.decided_at = len(draws)
            return
        if self.decided_at is not None or self.ready - self.looked < LOOK_EVERY:
            return
        self.looked = self.ready
        ordered = [d for job in self.jobs[: self.ready] for d in draws[job]]
        if analysis.anytime_decides(ordered, alpha=self.alpha, far=far):
            self.decided_at = self.ready


async def _rescored(
    sources: tuple[AnyReference, NextTokenSource | None],
    seed: int,
    prompt: int,
    prompt_ids: Sequence[int],
    ids: Sequence[int],
    flags: Sequence[DraftFlag | None] = (),
) -> list[TokenDraw]:
    """Every token of one generation with the reference's distribution for its exact prefix
    (and the draft's there, with its favourite, when the run knows the draft), with the
    engine's flag for it where it flags its speculated tokens (`rescore.flags`)."""
    ref, draft = sources
    out = []
    for i, tok in enumerate(ids):
        prefix = [*prompt_ids, *ids[:i]]
        nt = await _ask(ref, prefix)
        q = await _ask(draft, prefix) if draft is not None else None
        fav = min(q.probs, key=lambda t: (-q.probs[t], t)) if q is not None and q.probs else None
        key = f"{prompt}:" + ",".join(map(str, ids[:i]))
        flag = flags[i] if i < len(flags) else None
        out.append(
            TokenDraw(
                seed,
                prompt,
                i,
                key,
                tok,
                nt,
                draft_favourite=fav,
                draft=q,
                draft_token=flag.draft if flag else None,
                verified_by=flag.rule if flag else None,
            )  # fmt: skip
        )
    return out


def _failure(
    res: RescoreResult, jobs: int, eng_failed: list[str], ref_failed: list[str]
) -> str | None:
    """The run's error: the engine's first failure (and how far it got), else the
    reference's; None if neither failed."""
    if eng_failed:
        error = eng_failed[0]
        if len(res.samples) < jobs:
            error += f" (after {len(res.samples)} of {jobs} samples)"
        return error
    if ref_failed:
        return (
            f"the reference failed after {res.rescored} of {res.sampled_tokens} sampled tokens "
            f"were re-scored: {ref_failed[0]}"
        )
    return None


async def _run_self(req: RescoreRequest, progress: ProgressFn | None) -> RescoreResult:
    """Every sampled token against the distribution the engine itself reported for it
    (post-sampling): no reference, so it needs nothing but the engine. It tests whether the
    engine samples what it says it samples; tokens it reported nothing for (placeholders) are
    counted, not tested."""

    t0 = time.monotonic()
    ident = await _engine_identity(req)
    n_probs = support_size(req.sampler, ident.n_vocab if ident else None)
    async with Reference(req.url, req.sampler, timeout=req.timeout) as tok:  # its tokenizer
        prompts = [list(p) for p in req.prompt_ids] or [await tok.tokenize(t) for t in req.prompts]
    sampler = ServerSampler(
        req.url, req.sampler, req.tokens, label=req.label, timeout=req.timeout,
        concurrency=req.concurrency, report_probs=n_probs,
    )  # fmt: skip
    res = RescoreResult(
        engine=req.label or req.url, reference="the engine's own reported distributions",
        identity=ident, prompts=prompts, seeds=req.seeds, tokens=req.tokens, sampler=req.sampler,
    )  # fmt: skip
    sem = asyncio.Semaphore(req.concurrency)
    jobs = seed_jobs(req.seed_start, req.seeds, len(prompts))
    got: dict[tuple[int, int], SeededGeneration] = {}

    async def one(seed: int, p: int) -> None:
        async with sem:
            got[(seed, p)] = await _draw(sampler, p, prompts[p], seed)
        if progress:
            progress(len(got), len(jobs))

    try:
        await asyncio.gather(*(one(s, p) for s, p in jobs))
    except (ClientError, RescoreError) as e:
        res.error = f"{e} (after {len(got)} of {len(jobs)} samples)"
    finally:
        await sampler.aclose()
    res.samples = [got[k] for k in sorted(got)]
    for s in res.samples:
        for i, (tok_id, nt) in enumerate(zip(s.ids, s.reported, strict=True)):
            if nt is None:
                res.unreported += 1
                continue
            key = f"{s.prompt}:" + ",".join(map(str, s.ids[:i]))
            res.draws.append(TokenDraw(s.seed, s.prompt, i, key, tok_id, nt))
    res.rescored = len(res.draws)
    _counts(res)
    res.total_seconds = time.monotonic() - t0
    if res.error is None:
        if not res.draws:
            res.error = "the engine reported no distribution for any token (placeholders only)"
        else:
            res.stats = analysis.analyse(
                res.draws, alpha=req.alpha, sequential=req.sequential, tolerance=req.tolerance
            )
    return res


def _counts(res: RescoreResult) -> None:
    dr = [s.drafted for s in res.samples if s.drafted is not None]
    ac = [s.accepted for s in res.samples if s.accepted is not None]
    res.drafted = sum(dr) if dr else None
    res.accepted = sum(ac) if ac else None


__all__ = ["RescoreResult", "generated_ids", "run", "run_against"]
