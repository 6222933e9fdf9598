"""transformers' MTP and Gemma 4 single-position candidate generators, each on tiny models of
the classes it needs, against the target's own exact distribution.

Why: `dist --engine transformers` drives its generators with the llama fixture, and these two
cannot run on a llama (`distribution.hf.NOT_RUNNABLE`): `use_mtp` (`MTPCandidateGenerator`)
needs a target whose config has `num_mtp_layers` and whose checkpoint holds the MTP layers
(`MtpModel.from_pretrained` reads them from the target's folder); a Gemma 4 assistant
(`SinglePositionMultiTokenCandidateGenerator`) needs a `Gemma4AssistantForCausalLM` drafter
and a Gemma 4 / 3n target that returns its shared KV states. Public reports say some of these
generators verify with a draft distribution q they never sampled from. So each runs here on
a model of its own class, built tiny and randomly initialised from fixed seeds (no download):

    mtp               a 2-layer `MellumForCausalLM` (vocabulary 8) with one MTP layer whose
                      weights are written into the saved checkpoint under `mtp.` and loaded
                      back by transformers' own `MtpModel.from_pretrained` (checked equal)
    gemma4-assistant  a 4-layer `Gemma4ForCausalLM` (the last two layers reuse the KV of the
                      first two, so it returns `shared_kv_states`) and a 2-layer
                      `Gemma4AssistantForCausalLM`, 3 draft tokens. transformers 5.23 cannot
                      build that assistant as released: `Gemma4TextConfig.kv_sharing_modes`
                      raises when every layer is shared, which `Gemma4AssistantConfig`
                      requires; the bench sets the modes the assistant's own docstring
                      describes (every layer "reuse") while it is built, and says so

For every generator and sampler setting: `--seeds` seeds of `generate()` with the generator
(`torch.manual_seed(seed)` first, `--tokens` new tokens) and the same seeds of plain
`generate()` on the same target (the reference), both against the exact joint distribution
of the tokens computed from the target's own next-token probabilities after generate()'s
logits processors (chain rule over every prefix). Statistics: the G-test of the joint counts
against the exact distribution (cells with expected count below 5 pooled), the total
variation between the empirical and exact joint, the largest per-position marginal TV, and
`specaudit dist`'s certified bounds (`stats.conditional_tv_bound`, what
`distribution.bounds` gives dist): one-sided upper bounds on each position's prefix-averaged
next-token TV (every generated prefix its own context) and on the TV of the joint of the
first min(3, tokens) positions, each at alpha / (tokens + 1) so that all hold together at
1 - alpha. The reference's rows give the noise floor at the same sample size.

Verdict per row, dist's rule (`stats.decide`): BROKEN when the G-test's p is below `--alpha`
(or the generator produced a sequence the target forbids); PRESERVED when not and every
certified bound is at most `--tolerance` (dist's default 0.15), i.e. with confidence
1 - alpha no position's prefix-averaged TV nor the joint's TV exceeds it; INCONCLUSIVE
otherwise, with the largest bound reached and about how many seeds would bring it within the
tolerance (n (bound / tolerance)^2). A generator's verdict is its worst row. Each row prints
its largest bound (`TV bound`) and all of them; `--json` keeps them (`tv_bound`, `tv_bounds`:
positions, then the joint; `samples_needed`). The first generated token never comes from a
draft (both generators skip drafting until the target has run once), so drafts start at
position 2.

Why 3 tokens by default: position t's bound averages over up to 8^(t-1) prefixes, each with
its own plug-in TV, so it shrinks slowly in the seeds. Drawn from the MTP target's exact
distribution at T=1, position 3's and the joint's bounds are about 0.125 and 0.14 at 2000
seeds, 0.11 and 0.12 at 3000; with 4 tokens position 4's is still 0.16 at 5000 (above the
tolerance).
Under the exact distribution the pooled G-test rejected at 0.01 in 0.3 to 2.3 % of 300
simulated samples of 2000 or 5000 (4 tokens, both samplers): about its level.
A p-value below the smallest float is reported as that float (`stats.TINY_P`; 0 stays for a
forbidden sequence), with its log10 from the chi-square tail (`log10_p`).

    .venv/bin/python benchmarks/bench_hf_generators.py [--generators mtp,gemma4-assistant]
        [--seeds 3000] [--tokens 3] [--samplers t1,t07k4] [--alpha 0.01] [--tolerance 0.15]
        [--json FILE]

Samplers: t1 = temperature 1, no truncation; t07k4 = temperature 0.7, top-k 4.

Exit codes (dist's): 0 every generator PRESERVED at every sampler; 1 some generator BROKEN;
2 none BROKEN but some INCONCLUSIVE (more seeds needed), or the measurement is not valid (the
plain reference itself fails its G-test at alpha / 10, MTP weights not loaded as written,
transformers missing).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as st

from specaudit import stats
from specaudit.distribution import DEFAULT_ALPHA, DEFAULT_TOLERANCE, hf
from specaudit.stats import TINY_P, TvBound, Verdict

VOCAB = 8
PROMPT = (1, 2, 3)
DRAFT_TOKENS = 3  # the Gemma 4 assistant's num_assistant_tokens (MTP drafts one per layer)
MODEL_SEED = 20261201
TARGET_INIT = 0.2  # weight scale of the targets and the MTP layer: entropy about 1.5 nats
ASSISTANT_INIT = 0.1  # the Gemma 4 assistant's weight scale: q neither flat nor one-hot
SAMPLERS: dict[str, dict[str, Any]] = {
    "t1": {"temperature": 1.0, "top_k": 0},
    "t07k4": {"temperature": 0.7, "top_k": 4},
}
GENERATORS = ("mtp", "gemma4-assistant")
JOINT = 3  # the certified joint covers the first min(JOINT, tokens) positions (dist's default)
WORST_FIRST = (Verdict.BROKEN, Verdict.INCONCLUSIVE, Verdict.PRESERVED)


class Invalid(Exception):
    """The measurement cannot be trusted (exit 2)."""


@dataclass
class Row:
    generator: str
    sampler: str
    path: str  # "speculative" or "plain"
    seeds: int
    drafted: int | None
    accepted: int | None
    g_stat: float
    dof: int
    p_value: float
    tv_joint: float
    tv_position_max: float
    tv_positions: list[float]
    seconds: float
    argmax_drafts: int | None = None  # drafted tokens that were q's argmax
    q_token_median: float | None = None  # median q(drafted token)
    tv_if_fixed_median: float | None = None  # exact per-position TV if drafting is argmax
    tv_if_fixed_max: float | None = None
    verdict: str = ""  # `judge`: BROKEN, PRESERVED or INCONCLUSIVE
    tv_bound: float = 1.0  # the largest certified bound (what PRESERVED holds to --tolerance)
    tv_bounds: list[float] | None = None  # positions 1..tokens, then the joint (`certified`)
    joint: int = 0  # the certified joint covers positions 1..joint
    samples_needed: int | None = None  # INCONCLUSIVE: about how many seeds would certify
    log10_p: float | None = None  # the G-test's log10 p (also where p underflows)


@dataclass
class Setup:
    target: Any
    extra: dict[str, Any]  # generate() arguments selecting the generator
    note: str


# --------------------------------------------------------------------------- the models


def _mtp_setup(workdir: Path) -> Setup:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, MellumConfig, MellumForCausalLM
    from transformers.modeling_layers import MtpModel

    cfg = MellumConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        layer_types=["full_attention", "sliding_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=2,
        num_experts_per_tok=1, sliding_window=64, num_mtp_layers=1, initializer_range=TARGET_INIT,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(MODEL_SEED)
    main = MellumForCausalLM(cfg).eval()
    d = workdir / "mellum-mtp"
    main.save_pretrained(d)
    mtp = MtpModel(main, 1)  # random MTP layer, written where a Mellum checkpoint keeps it
    written = {
        "mtp." + k: v.detach().clone().contiguous()
        for k, v in mtp.state_dict().items()
        if not k.startswith(("embed_tokens.", "shared_head.", "rotary_emb."))
    }
    with torch.no_grad():  # MtpModel's own init leaves its fused experts uninitialised memory
        for k, v in written.items():
            v.copy_(torch.ones_like(v) if "norm" in k else torch.randn_like(v) * TARGET_INIT)
    weights = d / "model.safetensors"
    save_file(load_file(weights) | written, weights, metadata={"format": "pt"})
    target = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    loaded = MtpModel.from_pretrained(target).state_dict()
    differ = [k for k, v in written.items() if not torch.equal(loaded[k[4:]], v)]
    if differ:
        raise Invalid(f"MtpModel.from_pretrained did not load the MTP weights written: {differ}")
    note = (
        f"MellumForCausalLM 2 layers + 1 MTP layer ({len(written)} tensors) loaded by "
        "MtpModel.from_pretrained, equal to those written"
    )
    return Setup(target, {"use_mtp": True}, note)


@contextlib.contextmanager
def _assistant_kv_sharing() -> Iterator[None]:
    """While a Gemma 4 assistant is built: every layer of a fully shared config "reuse"s (5.23's
    `Gemma4TextConfig.kv_sharing_modes` raises there: no layer of the assistant produces KV)."""
    from transformers import Gemma4TextConfig

    prop: Any = Gemma4TextConfig.__dict__["kv_sharing_modes"]

    def modes(self: Any) -> list[str | None]:
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return list(prop.fget(self))

    setattr(Gemma4TextConfig, "kv_sharing_modes", property(modes))  # noqa: B010
    try:
        yield
    finally:
        setattr(Gemma4TextConfig, "kv_sharing_modes", prop)  # noqa: B010


def _gemma4_setup(workdir: Path) -> Setup:
    import torch
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4ForCausalLM,
        Gemma4TextConfig,
    )

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        global_head_dim=16, sliding_window=64, pad_token_id=None, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    types = ["sliding_attention", "full_attention"]
    torch.manual_seed(MODEL_SEED)
    target = Gemma4ForCausalLM(
        Gemma4TextConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_kv_shared_layers=2,
            layer_types=types * 2,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB,
            initializer_range=TARGET_INIT,
            **common,
        )  # fmt: skip
    ).eval()
    acfg = Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            layer_types=types,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            initializer_range=ASSISTANT_INIT,
            **common,
        ),
        backbone_hidden_size=32,
    )
    try:
        Gemma4AssistantForCausalLM(acfg)
        as_released = "builds as released"
    except ValueError as e:
        as_released = f"as released: ValueError: {e}"
    with _assistant_kv_sharing():
        assistant = Gemma4AssistantForCausalLM(acfg).eval()
    assistant.generation_config.num_assistant_tokens = DRAFT_TOKENS
    note = (
        "Gemma4ForCausalLM 4 layers (2 KV-shared) + Gemma4AssistantForCausalLM 2 layers "
        f"({as_released}; built with every layer reusing the target's KV)"
    )
    return Setup(target, {"assistant_model": assistant}, note)


SETUPS: dict[str, Callable[[Path], Setup]] = {"mtp": _mtp_setup, "gemma4-assistant": _gemma4_setup}


# --------------------------------------------------------------------------- measurement


def _sampler_kwargs(name: str) -> dict[str, Any]:
    return {
        "do_sample": True, "top_p": 1.0, "min_p": None, "repetition_penalty": None,
        "typical_p": None, "epsilon_cutoff": None, "eta_cutoff": None, "top_h": None,
        **SAMPLERS[name],
    }  # fmt: skip


def exact_joint(target: Any, sampler: str, tokens: int) -> dict[tuple[int, ...], float]:
    """P(next `tokens` ids) under plain sampling: the target's next-token probabilities after
    generate()'s own logits processors, chained over every prefix of positive probability."""
    import torch
    from transformers import GenerationConfig

    cfg = GenerationConfig(**_sampler_kwargs(sampler))
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(tokens):
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, pr in out.items():
            ids = torch.tensor([[*PROMPT, *prefix]])
            procs = target._get_logits_processor(
                cfg, input_ids_seq_length=ids.shape[1], logits_processor=None, device="cpu"
            )
            with torch.no_grad():
                logits = target(ids).logits[:, -1].float()
            p = torch.softmax(procs(ids, logits).double(), -1)[0].numpy()
            for t in np.flatnonzero(p > 0):
                nxt[(*prefix, int(t))] = pr * float(p[t])
        out = nxt
    return out


@dataclass
class Drafts:
    """What the candidate generator returned, per drafted position: was the token q's argmax,
    q(token), and the exact TV from the target's p of what speculative sampling outputs there
    if the token is a deterministic function of the context (argmax drafting)."""

    drafted: int = 0
    accepted: int = 0
    argmax: int = 0
    q_token: list[float] | None = None
    tv_if_fixed: list[float] | None = None

    def record(self, tokens: Any, logits: Any, scores: Any) -> None:
        import torch

        q = torch.softmax(logits[0].double(), -1)
        p = torch.softmax(scores[0, : q.shape[0]].double(), -1)
        assert self.q_token is not None and self.tv_if_fixed is not None
        for i, d in enumerate(tokens.tolist()):
            self.argmax += int(d == int(q[i].argmax()))
            self.q_token.append(float(q[i, d]))
            a = min(1.0, float(p[i, d] / q[i, d]))
            resid = torch.clamp(p[i] - q[i], min=0)
            r = resid / resid.sum() if float(resid.sum()) > 0 else p[i]
            out = (1 - a) * r
            out[d] += a
            self.tv_if_fixed.append(0.5 * float((out - p[i]).abs().sum()))


def _instrument(target: Any) -> None:
    """Feed `target._drafts` from the target's candidate generators (`hf.watch_candidates`)."""
    pending: list[Any] = []

    def drafted(input_ids: Any, ids: Any, logits: Any) -> None:
        n = int(ids.shape[1] - input_ids.shape[1])
        target._drafts.drafted += n
        pending[:] = [ids[0, input_ids.shape[1] :], logits] if n and logits is not None else []

    def verified(scores: Any, num_matches: int) -> None:
        target._drafts.accepted += num_matches
        if pending:
            target._drafts.record(pending[0], pending[1], scores)

    hf.watch_candidates(target, drafted, verified)


def sample(
    setup: Setup, sampler: str, tokens: int, seeds: range, speculative: bool
) -> tuple[list[tuple[int, ...]], Drafts]:
    """`generate()` once per seed, and what the candidate generator drafted."""
    import torch

    target = setup.target
    _instrument(target)
    target._drafts = drafts = Drafts(q_token=[], tv_if_fixed=[])
    kw = _sampler_kwargs(sampler) | (setup.extra if speculative else {})
    x = torch.tensor([PROMPT])
    got: list[tuple[int, ...]] = []
    for s in seeds:
        torch.manual_seed(s)
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            out = target.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=tokens,
                min_new_tokens=tokens, pad_token_id=0, **kw,
            )  # fmt: skip
        got.append(tuple(int(t) for t in out[0, len(PROMPT) :]))
    return got, drafts


def compare(
    draws: list[tuple[int, ...]], exact: dict[tuple[int, ...], float], tokens: int
) -> tuple[float, int, float, float, list[float]]:
    """G statistic, degrees of freedom, p, joint TV and per-position marginal TVs."""
    n = len(draws)
    counts = Counter(draws)
    outside = sum(c for k, c in counts.items() if k not in exact)
    cells = sorted(exact, key=lambda k: -exact[k])
    obs: list[float] = []
    exp: list[float] = []
    pool_o, pool_e = 0.0, 0.0
    for k in cells:
        e = exact[k] * n
        if e >= 5:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            pool_o += counts.get(k, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    if outside:  # tokens the target forbids: impossible under the null
        g, p = float("inf"), 0.0
    elif len(obs) < 2:  # too few samples for even two cells: no test
        g, p = 0.0, 1.0
    else:
        g, p = st.power_divergence(obs, exp, lambda_="log-likelihood")
        p = max(float(p), TINY_P)  # underflowed: tiny, not impossible (0 is for those)
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)
    tvs = []
    for i in range(tokens):
        m_exact: Counter[int] = Counter()
        for k, pr in exact.items():
            m_exact[k[i]] += pr  # type: ignore[assignment]
        m_obs = Counter(d[i] for d in draws)
        toks = set(m_exact) | set(m_obs)
        tvs.append(0.5 * sum(abs(m_obs.get(t, 0) / n - m_exact.get(t, 0.0)) for t in toks))
    return float(g), len(obs) - 1, float(p), tv, tvs


def _prefix_probabilities(
    exact: dict[tuple[int, ...], float], tokens: int
) -> list[dict[tuple[int, ...], float]]:
    """P(the first t tokens), t = 0..tokens, from the exact joint."""
    out: list[dict[tuple[int, ...], float]] = [{} for _ in range(tokens + 1)]
    for k, pr in exact.items():
        for t in range(tokens + 1):
            out[t][k[:t]] = out[t].get(k[:t], 0.0) + pr
    return out


def certified(
    draws: list[tuple[int, ...]], exact: dict[tuple[int, ...], float], tokens: int, alpha: float
) -> tuple[list[TvBound], int]:
    """dist's certified bounds (`distribution.bounds`) on these token tuples, and the joint's
    length: each position's prefix-averaged next-token TV (every generated prefix its own
    context), then the TV of the joint of the first min(JOINT, tokens) positions (dist's
    default), each one-sided at alpha / (tokens + 1) so that all hold together at 1 - alpha
    (Bonferroni). `stats.conditional_tv_bound` computes each one."""
    prob = _prefix_probabilities(exact, tokens)
    joint = min(JOINT, tokens)
    a = alpha / (tokens + 1)
    out = []
    for t in range(1, tokens + 1):
        by_prefix: dict[tuple[int, ...], np.ndarray] = {}
        for d in draws:
            by_prefix.setdefault(d[: t - 1], np.zeros(VOCAB, dtype=np.int64))[d[t - 1]] += 1
        strata = []
        for prefix, counts in by_prefix.items():
            base = prob[t - 1].get(prefix, 0.0)
            if base > 0:  # a prefix the target forbids is already BROKEN where it arose
                p = np.array([prob[t].get((*prefix, v), 0.0) for v in range(VOCAB)]) / base
                strata.append((counts, p))
        out.append(stats.conditional_tv_bound(strata, a))
    cells = {k: i for i, k in enumerate(sorted(prob[joint]))}
    counts = np.zeros(len(cells) + 1, dtype=np.int64)  # the last cell: what the target forbids
    for d in draws:
        counts[cells.get(d[:joint], len(cells))] += 1
    probs = np.append([prob[joint][k] for k in cells], 0.0)
    out.append(stats.conditional_tv_bound([(counts, probs)], a))
    return out, joint


def judge(
    draws: list[tuple[int, ...]],
    exact: dict[tuple[int, ...], float],
    tokens: int,
    p_value: float,
    alpha: float,
    tolerance: float,
) -> tuple[Verdict, list[TvBound], int, int | None]:
    """dist's decision rule (`stats.decide`) on one row: BROKEN if the G-test's p is below
    alpha or a sequence the target forbids was drawn; PRESERVED if not and every certified
    bound (`certified`) is at most `tolerance`; else INCONCLUSIVE, with about how many seeds
    would bring the largest bound within it (`stats.samples_needed`). Also the bounds, the
    joint's length and that number (None unless INCONCLUSIVE)."""
    bounds, joint = certified(draws, exact, tokens, alpha)
    uppers = [b.upper for b in bounds]
    impossible = any(d not in exact for d in draws)
    verdict = stats.decide([p_value], alpha, uppers, tolerance, impossible)
    needed = (
        stats.samples_needed(len(draws), max(uppers), tolerance)
        if verdict is Verdict.INCONCLUSIVE
        else None
    )
    return verdict, bounds, joint, needed


def log10_chi2_sf(g: float, dof: int) -> float | None:
    """log10 of the chi-square tail beyond g, also where scipy's underflows (mpmath, which
    torch depends on); None without a test (no degrees of freedom, or an impossible draw)."""
    if dof <= 0 or not math.isfinite(g):
        return None
    import mpmath  # type: ignore[import-untyped]

    return float(mpmath.log10(mpmath.gammainc(dof / 2, g / 2, mpmath.inf, regularized=True)))


def measure(
    name: str,
    setup: Setup,
    sampler: str,
    tokens: int,
    seeds: range,
    alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE,
) -> list[Row]:
    exact = exact_joint(setup.target, sampler, tokens)
    rows = []
    for speculative in (True, False):
        t0 = time.monotonic()
        draws, c = sample(setup, sampler, tokens, seeds, speculative)
        g, dof, p, tv, tvs = compare(draws, exact, tokens)
        verdict, bounds, joint, needed = judge(draws, exact, tokens, p, alpha, tolerance)
        row = Row(
            name, sampler, "speculative" if speculative else "plain", len(seeds), None, None,
            g, dof, p, tv, max(tvs), tvs, time.monotonic() - t0, verdict=verdict.value,
            tv_bound=max(b.upper for b in bounds), tv_bounds=[b.upper for b in bounds],
            joint=joint, samples_needed=needed,
            log10_p=log10_chi2_sf(g, dof),
        )  # fmt: skip
        if speculative:
            row.drafted, row.accepted, row.argmax_drafts = c.drafted, c.accepted, c.argmax
            if c.q_token and c.tv_if_fixed:
                row.q_token_median = float(np.median(c.q_token))
                row.tv_if_fixed_median = float(np.median(c.tv_if_fixed))
                row.tv_if_fixed_max = float(np.max(c.tv_if_fixed))
        rows.append(row)
    return rows


def _print_rows(name: str, sampler: str, spec: Row, plain: Row, tolerance: float) -> None:
    for r in (spec, plain):
        verdict = r.verdict
        if r is plain and r.verdict == Verdict.BROKEN.value:
            # plain generate() is the reference, not a verdict on a generator: the run stays
            # valid above alpha / 10 (the G-test rejects exact samples about alpha of the time)
            verdict = "REFERENCE REJECTED at alpha (plain generate(); valid above alpha / 10)"
        tvp = " ".join(f"{x:.3f}" for x in r.tv_positions)
        bounds = " ".join(f"{x:.3f}" for x in r.tv_bounds or [])
        more = f" (~{r.samples_needed} seeds would do)" if r.samples_needed else ""
        tiny = f" (log10 p {r.log10_p:.1f})" if r.log10_p is not None and r.log10_p < -300 else ""
        print(
            f"  {name:16} {sampler:6} {r.path:11} n={r.seeds} drafted={r.drafted} "
            f"accepted={r.accepted} G={r.g_stat:.1f} dof={r.dof} p={r.p_value:.3g}{tiny} "
            f"TV joint={r.tv_joint:.3f} positions=[{tvp}] {verdict} "
            f"TV bound={r.tv_bound:.3f} (tolerance {tolerance:g}; positions, joint 1-{r.joint}: "
            f"[{bounds}]){more} {r.seconds:.0f}s",
            flush=True,
        )
    if spec.tv_if_fixed_median is not None:
        fixed = spec.argmax_drafts == spec.drafted  # argmax drafting: no sampling
        print(
            f"    drafts that were q's argmax: {spec.argmax_drafts}/{spec.drafted}; "
            f"median q(draft) {spec.q_token_median:.3f}"
            + (
                f"; exact TV of the output from p at a drafted position: median "
                f"{spec.tv_if_fixed_median:.3f}, max {spec.tv_if_fixed_max:.3f}"
                if fixed
                else " (drafts sampled from q)"
            ),
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generators", default=",".join(GENERATORS))
    ap.add_argument("--seeds", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--samplers", default=",".join(SAMPLERS))
    ap.add_argument("--alpha", type=float, default=DEFAULT_ALPHA)
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    try:
        import torch
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        print(f"needs torch and transformers: {e}", file=sys.stderr)
        return 2
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    seeds = range(1, a.seeds + 1)
    rows: list[Row] = []
    notes: dict[str, str] = {}
    verdicts: dict[str, Verdict] = {}
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, sampler in itertools.product(a.generators.split(","), a.samplers.split(",")):
                if name not in notes:
                    setup = SETUPS[name](Path(tmp))
                    notes[name] = setup.note
                    print(f"{name}: {setup.note}", flush=True)
                spec, plain = measure(name, setup, sampler, a.tokens, seeds, a.alpha, a.tolerance)
                rows += [spec, plain]
                _print_rows(name, sampler, spec, plain, a.tolerance)
                if plain.p_value < a.alpha / 10:
                    raise Invalid(
                        f"{name} {sampler}: the plain reference fails (p={plain.p_value})"
                    )
                v = Verdict(spec.verdict)
                if name not in verdicts or WORST_FIRST.index(v) < WORST_FIRST.index(verdicts[name]):
                    verdicts[name] = v
    except Invalid as e:
        print(f"invalid measurement: {e}", file=sys.stderr)
        return 2
    for name, v in verdicts.items():
        bound = max(r.tv_bound for r in rows if r.generator == name and r.path == "speculative")
        print(f"{name}: {v.value} (largest TV bound {bound:.3f}, tolerance {a.tolerance:g})")
    print(f"wall time {time.monotonic() - t0:.0f}s", flush=True)
    if a.json:
        doc = {
            "command": " ".join(["benchmarks/bench_hf_generators.py", *(argv or sys.argv[1:])]),
            "alpha": a.alpha,
            "tolerance": a.tolerance,
            "tokens": a.tokens,
            "seconds": time.monotonic() - t0,
            "notes": notes,
            "verdicts": {k: v.value for k, v in verdicts.items()},
            "rows": [asdict(r) for r in rows],
        }
        a.json.write_text(json.dumps(doc, indent=1))
    return exit_code(verdicts.values())


def exit_code(verdicts: Iterable[Verdict]) -> int:
    """dist's convention: 1 if any BROKEN; else 2 if any INCONCLUSIVE; else 0."""
    seen = set(verdicts)
    if Verdict.BROKEN in seen:
        return 1
    return 2 if Verdict.INCONCLUSIVE in seen else 0


if __name__ == "__main__":
    sys.exit(main())
