"""Reproducer: with a Gemma 4 assistant (`SinglePositionMultiTokenCandidateGenerator`),
`generate(do_sample=True, assistant_model=...)` does not sample from the target's distribution.
The drafter's tokens are its argmax, but speculative sampling verifies them as if they had been
drawn from q = softmax(drafter logits), the distribution the generator returns.

Needs only torch, transformers (5.23.0 here), numpy and scipy; no download. It builds, from
fixed seeds, a tiny random 4-layer `Gemma4ForCausalLM` target (vocabulary 8; its last 2 layers
reuse the first 2's KV, so it returns `shared_kv_states`) and a 2-layer
`Gemma4AssistantForCausalLM` drafter (3 draft tokens), then samples seeds 1..N of 3 new tokens
after the prompt ids [1, 2, 3] at temperature 1 (no truncation: the processed distribution is
the softmax of the target's logits), with and without the assistant, and compares both with the
target's exact joint distribution of the 3 tokens (chain rule over every prefix, from the
target's own logits): G-test over the 8^3 sequences (cells with expected count below 5 pooled)
and each position's marginal TV. It also records every draft: was it q's argmax, and the exact
TV from p of what speculative sampling outputs at that position when the draft is a fixed
token d (a = min(1, p(d)/q(d)) on d, the rest on norm((p - q)+)).

The assistant cannot be built as released (`Gemma4TextConfig.kv_sharing_modes` raises for the
fully KV-shared config `Gemma4AssistantConfig` makes): the script says so, then builds it with
every layer "reuse" (what the assistant's docstring describes). Nothing else is patched.

    python transformers_gemma4_assistant_q.py [--seeds 400] [--alpha 0.01]

Exit codes: 1 the assisted samples reject the target's distribution (G-test p < alpha): the
bug is present; 0 they do not; 2 the control (plain sampling, same seeds) rejects too, so the
measurement says nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter
from typing import Any

import numpy as np
import torch
import transformers
from scipy import stats
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

VOCAB = 8
PROMPT = [1, 2, 3]
TOKENS = 3
DRAFT_TOKENS = 3
MODEL_SEED = 20261201
SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


@contextlib.contextmanager
def fully_shared_kv_reuses() -> Any:
    """While the assistant is built: a config whose every layer is KV-shared "reuse"s on every
    layer, instead of raising (it has no layer producing KV: all of it comes from the target)."""
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


def build() -> tuple[Any, Any]:
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
            initializer_range=0.2,
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
            initializer_range=0.1,
            **common,
        ),  # fmt: skip
        backbone_hidden_size=32,
    )
    try:
        Gemma4AssistantForCausalLM(acfg)
        print("Gemma4AssistantForCausalLM(config) builds as released")
    except ValueError as e:
        print(f"Gemma4AssistantForCausalLM(config) as released: ValueError: {e}")
    with fully_shared_kv_reuses():
        assistant = Gemma4AssistantForCausalLM(acfg).eval()
    assistant.generation_config.num_assistant_tokens = DRAFT_TOKENS
    return target, assistant


def exact_joint(target: Any) -> dict[tuple[int, ...], float]:
    """P(the next TOKENS ids) under plain sampling at temperature 1: chain rule over prefixes."""
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(TOKENS):
        nxt = {}
        for prefix, pr in out.items():
            with torch.no_grad():
                logits = target(torch.tensor([[*PROMPT, *prefix]])).logits[0, -1]
            p = torch.softmax(logits.double(), -1).numpy()
            for t in range(VOCAB):
                nxt[(*prefix, t)] = pr * float(p[t])
        out = nxt
    return out


class Drafts:
    """Every draft the candidate generator returns, with the q it returns and the target's p."""

    def __init__(self) -> None:
        self.n = self.argmax = 0
        self.tv_fixed: list[float] = []
        self.pending: tuple[Any, Any] | None = None

    def watch(self, model: Any) -> None:
        orig = type(model)._get_candidate_generator

        def make(*args: Any, **kwargs: Any) -> Any:
            cg = orig(model, *args, **kwargs)
            get, update = cg.get_candidates, cg.update_candidate_strategy

            def get_candidates(input_ids: Any, *a: Any, **kw: Any) -> Any:
                ids, logits = get(input_ids, *a, **kw)
                new = ids[0, input_ids.shape[1] :]
                self.pending = (new, logits) if logits is not None and len(new) else None
                return ids, logits

            def update_candidate_strategy(input_ids: Any, scores: Any, num_matches: int) -> Any:
                if self.pending is not None:
                    self.record(*self.pending, scores)
                return update(input_ids, scores, num_matches)

            cg.get_candidates = get_candidates
            cg.update_candidate_strategy = update_candidate_strategy
            return cg

        model._get_candidate_generator = make

    def record(self, tokens: Any, logits: Any, scores: Any) -> None:
        q = torch.softmax(logits[0].double(), -1)
        p = torch.softmax(scores[0, : q.shape[0]].double(), -1)
        for i, d in enumerate(tokens.tolist()):
            self.n += 1
            self.argmax += int(d == int(q[i].argmax()))
            a = min(1.0, float(p[i, d] / q[i, d]))
            resid = torch.clamp(p[i] - q[i], min=0)
            out = (1 - a) * (resid / resid.sum() if float(resid.sum()) > 0 else p[i])
            out[d] += a
            self.tv_fixed.append(0.5 * float((out - p[i]).abs().sum()))


def sample(target: Any, seeds: range, **extra: Any) -> list[tuple[int, ...]]:
    x = torch.tensor([PROMPT])
    got = []
    for s in seeds:
        torch.manual_seed(s)
        with torch.no_grad():
            out = target.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=TOKENS,
                min_new_tokens=TOKENS, pad_token_id=0, **SAMPLING, **extra,
            )  # fmt: skip
        got.append(tuple(int(t) for t in out[0, len(PROMPT) :]))
    return got


def compare(draws: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> tuple[str, float]:
    """G-test of the joint counts (expected < 5 pooled) and each position's marginal TV: the
    line to print, and the p-value."""
    n = len(draws)
    counts = Counter(draws)
    obs: list[float] = []
    exp: list[float] = []
    pool_o, pool_e = 0.0, 0.0
    for k in sorted(exact, key=lambda k: -exact[k]):
        if exact[k] * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(exact[k] * n)
        else:
            pool_o += counts.get(k, 0)
            pool_e += exact[k] * n
    obs.append(pool_o)
    exp.append(pool_e)
    g, p = stats.power_divergence(obs, exp, lambda_="log-likelihood")
    tvs = []
    for i in range(TOKENS):
        m = np.zeros(VOCAB)
        for k, pr in exact.items():
            m[k[i]] += pr
        o = np.bincount([d[i] for d in draws], minlength=VOCAB) / n
        tvs.append(0.5 * float(np.abs(o - m).sum()))
    line = f"G={g:.1f} ({len(obs) - 1} dof), p={p:.2g}; marginal TV per position " + " ".join(
        f"{t:.3f}" for t in tvs
    )
    return line, float(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=400)
    ap.add_argument("--alpha", type=float, default=0.01)
    a = ap.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    target, assistant = build()
    exact = exact_joint(target)
    seeds = range(1, a.seeds + 1)
    drafts = Drafts()
    drafts.watch(target)
    plain, p_plain = compare(sample(target, seeds), exact)
    print(f"plain generate(), seeds 1..{a.seeds}: {plain}")
    assisted, p_assisted = compare(sample(target, seeds, assistant_model=assistant), exact)
    print(f"assistant_model=Gemma4Assistant, seeds 1..{a.seeds}: {assisted}")
    print(
        f"  drafts that were argmax q: {drafts.argmax}/{drafts.n}; exact TV from p at a drafted "
        f"position given its draft: median {np.median(drafts.tv_fixed):.3f}, "
        f"max {np.max(drafts.tv_fixed):.3f}"
    )
    if p_plain < a.alpha:
        print("the control rejects: no conclusion")
        return 2
    broken = p_assisted < a.alpha
    print("BUG PRESENT: assisted sampling is not the target's distribution" if broken else "ok")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
