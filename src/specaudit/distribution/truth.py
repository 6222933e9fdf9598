"""The ground truth: a fixture's next-token distributions, in closed form from its definition.

Never taken from the engine under test (see `specaudit.fixtures`). Also how an engine's output
becomes outcomes (`encode_text`): one character per generated token, letters as themselves,
anything a correct engine cannot produce as an outcome of probability 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specaudit import fixtures
from specaudit.distribution.results import (
    END,
    END_LABEL,
    OTHER,
    OTHER_LABEL,
    SPECIAL_CODES,
    DistError,
    Workload,
    outcome_label,
)


class Truth:
    """Closed-form next-token distributions of a fixture, cached by generated prefix.

    `next`, `draft_next` and `marginal` are arrays over `labels`, the fixture's tokens (letters,
    then BOS, EOS, UNK). The analysis works over `outcomes`: those, then two outcomes that are
    no fixture token, `<end>` (the output stopped early) and `<other>` (anything outside the
    vocabulary), always of probability 0 (`p`, `draft_p`, `cell`).
    """

    def __init__(self, spec: fixtures.FixtureSpec, workload: Workload) -> None:
        self.spec = spec
        self.workload = workload
        self.labels: tuple[str, ...] = spec.tokens
        self.index = {t: i for i, t in enumerate(self.labels)}
        self.outcomes: tuple[str, ...] = (*spec.tokens, END_LABEL, OTHER_LABEL)
        self._cells = {t: i for i, t in enumerate(spec.letters)}
        for tok, code in SPECIAL_CODES.items():
            self._cells[code] = self.index[tok]
        self._cells[END] = len(spec.tokens)
        self._other = len(spec.tokens) + 1
        self._cache: dict[tuple[str, str], np.ndarray] = {}
        self._marginals: dict[int, np.ndarray] = {}

    def cell(self, ch: str) -> int:
        """Index in `outcomes` of one outcome character of a sample's text (`encode_text`)."""
        i = self._cells.get(ch)
        return self._other if i is None else i

    def is_prefix(self, prefix: str) -> bool:
        """Is `prefix` letters only (a context the fixture defines a next token after)?"""
        letters = self.spec.letters
        return all(ch in letters for ch in prefix)

    def _dist(self, prefix: str, which: fixtures.Which) -> np.ndarray:
        """Over `outcomes` (the last two always 0); cached."""
        key = (which, prefix)
        p = self._cache.get(key)
        if p is None:
            try:
                d = fixtures.conditional_distribution(
                    self.spec, self.workload.prompt, prefix, self.workload.sampler, which
                )
            except fixtures.AmbiguousSamplingError as e:
                raise DistError(f"ambiguous sampler settings for this fixture: {e}") from None
            p = np.array([d[t] for t in self.spec.tokens] + [0.0, 0.0], dtype=float)
            self._cache[key] = p
        return p

    def next(self, prefix: str) -> np.ndarray:
        """True distribution over `labels` of the token after prompt + `prefix`."""
        return self._dist(prefix, "target")[: len(self.labels)]

    def p(self, prefix: str) -> np.ndarray:
        """`next` over `outcomes`."""
        return self._dist(prefix, "target")

    def draft_next(self, prefix: str) -> np.ndarray:
        """The draft model's next-token distribution after prompt + `prefix` under the same
        sampler (from the fixture's definition: its draft tables), over `labels`.

        The direction a speculating engine's output leaks toward when verification is wrong.
        Settings that are ambiguous for the draft alone (ties at a cut-off) are a DistError.
        """
        return self._dist(prefix, "draft")[: len(self.labels)]

    def draft_p(self, prefix: str) -> np.ndarray:
        """`draft_next` over `outcomes`."""
        return self._dist(prefix, "draft")

    def joint(self, n: int) -> dict[str, float]:
        try:
            return fixtures.sequence_distribution(
                self.spec, self.workload.prompt, n, self.workload.sampler
            )
        except fixtures.AmbiguousSamplingError as e:
            raise DistError(f"ambiguous sampler settings for this fixture: {e}") from None
        except ValueError as e:
            raise DistError(f"joint distribution undefined: {e}") from None

    def marginal(self, t: int) -> np.ndarray:
        """True distribution of the token at position t (1-based), averaged over prefixes.

        A forward pass over the fixture's state (`FixtureSpec.state_key`): for the last-token
        kind the last letter is all the past its logits see, so prefixes ending alike are
        merged (at most one state per letter); for the context kind every generated prefix
        is its own state (the fixtures are tiny and positions few: at most
        letters^(t-1) of them, far fewer under top-k).
        """
        cached = self._marginals.get(t)
        if cached is not None:
            return cached
        prompt = self.workload.prompt
        # state key -> (a generated prefix with that state, its probability)
        state: dict[str, tuple[str, float]] = {self.spec.state_key(prompt): ("", 1.0)}
        letters = set(self.spec.letters)
        for _ in range(t - 1):
            nxt: dict[str, tuple[str, float]] = {}
            for prefix, w in state.values():
                for j, q in enumerate(self.next(prefix)):
                    if q <= 0:
                        continue
                    tok = self.labels[j]
                    if tok not in letters:
                        raise DistError(f"special token {tok!r} is possible: generation may stop")
                    longer = prefix + tok
                    key = self.spec.state_key(prompt + longer)
                    rep, acc = nxt.get(key, (longer, 0.0))
                    nxt[key] = (rep, acc + w * float(q))
            state = nxt
        out = np.zeros(len(self.labels))
        for prefix, w in state.values():
            out += w * self.next(prefix)
        self._marginals[t] = out
        return out

    def most_likely_prefix(self, length: int) -> str:
        """The generated prefix of this length the target is most likely to produce."""
        if length == 0:
            return ""
        d = self.joint(length)
        return max(d, key=lambda s: (d[s], s))


def stratum_key(p: np.ndarray) -> tuple[float, ...]:
    """A hashable key of a distribution: contexts with equal keys are pooled."""
    return tuple(float(x) for x in p)


_CODES = frozenset((END, OTHER, *SPECIAL_CODES.values()))


def encode_text(text: str, tokens: int, spec: fixtures.FixtureSpec) -> str:
    """An engine's generated text as `tokens` outcomes, one character each (idempotent).

    Letters stay; the special tokens' texts (``<s>``, ``</s>``, ``<unk>``, as
    llama-speculative prints them) become their codes (`results.SPECIAL_CODES`); any other
    character is kept as it is (not a fixture token: probability 0). A text with fewer than
    `tokens` outcomes ends in `END` at the first missing position; nothing follows `END`.
    """
    out: list[str] = []
    i = 0
    specials = sorted(SPECIAL_CODES.items(), key=lambda kv: -len(kv[0]))
    while i < len(text) and len(out) < tokens:
        ch = text[i]
        if ch == END:
            break
        for tok, code in specials:
            if text.startswith(tok, i):
                out.append(code)
                i += len(tok)
                break
        else:
            out.append(ch)
            i += 1
    if len(out) < tokens:
        out.append(END)
    return "".join(out)


def encode_ids(ids: Sequence[int], tokens: int, spec: fixtures.FixtureSpec) -> str:
    """Generated token ids (llama-server's ``return_tokens``) as outcomes, like `encode_text`:
    ids of letters are letters, BOS/EOS/UNK their codes, ids outside the vocabulary `OTHER`."""
    out: list[str] = []
    toks = spec.tokens
    n_letters = len(spec.letters)
    for t in ids[:tokens]:
        if 0 <= t < n_letters:
            out.append(toks[t])
        elif n_letters <= t < len(toks):
            out.append(SPECIAL_CODES[toks[t]])
        else:
            out.append(OTHER)
    if len(out) < tokens:
        out.append(END)
    return "".join(out)


def check_text(text: str, tokens: int, spec: fixtures.FixtureSpec, engine: str) -> str:
    """`encode_text` (the old name: text that is not `tokens` fixture letters is no longer an
    error but outcomes of probability 0, judged by the analysis). `engine` is unused."""
    del engine
    return encode_text(text, tokens, spec)


def describe(ch: str, spec: fixtures.FixtureSpec) -> str:
    """One outcome for people: the letter, '</s>', '<end>', '<other>' (an id outside the
    vocabulary), or text that is no fixture token, quoted ("'H'")."""
    if ch in _CODES or ch in spec.letters:
        return outcome_label(ch)
    return repr(ch)


__all__ = ["Truth", "check_text", "describe", "encode_ids", "encode_text", "stratum_key"]
