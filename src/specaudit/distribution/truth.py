"""The ground truth over the outcomes a `dist` sample can show, and how an engine's output
becomes those outcomes.

The closed form itself has one home, `specaudit.fixtures.truth` (`FixtureTruth`), never the
engine under test; `Truth` here adds the two outcomes no fixture token is (`<end>`, `<other>`)
and reports ambiguous or undefined settings as `DistError`. `encode_text` and `encode_ids` turn
output into outcomes: one character per generated token, letters as themselves, anything a
correct engine cannot produce as an outcome of probability 0.
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
from specaudit.fixtures.truth import FixtureTruth


class Truth(FixtureTruth):
    """The fixture's truth (`FixtureTruth`) for a `dist` workload, over the outcomes a sample
    can show, with `DistError` for settings whose truth is ambiguous or undefined.

    `next`, `draft_next` and `marginal` are arrays over `labels`, the fixture's tokens (letters,
    then BOS, EOS, UNK). The analysis works over `outcomes`: those, then two outcomes that are
    no fixture token, `<end>` (the output stopped early) and `<other>` (anything outside the
    vocabulary), always of probability 0 (`p`, `draft_p`, `cell`).
    """

    def __init__(self, spec: fixtures.FixtureSpec, workload: Workload) -> None:
        super().__init__(spec, workload.prompt, workload.sampler)
        self.workload = workload
        self.outcomes: tuple[str, ...] = (*spec.tokens, END_LABEL, OTHER_LABEL)
        self._cells = {t: i for i, t in enumerate(spec.letters)}
        for tok, code in SPECIAL_CODES.items():
            self._cells[code] = self.index[tok]
        self._cells[END] = len(spec.tokens)
        self._other = len(spec.tokens) + 1
        self._padded: dict[tuple[str, str], np.ndarray] = {}

    def cell(self, ch: str) -> int:
        """Index in `outcomes` of one outcome character of a sample's text (`encode_text`)."""
        i = self._cells.get(ch)
        return self._other if i is None else i

    def distribution(self, prefix: str, which: fixtures.Which = "target") -> np.ndarray:
        try:
            return super().distribution(prefix, which)
        except fixtures.AmbiguousSamplingError as e:
            raise DistError(f"ambiguous sampler settings for this fixture: {e}") from None

    def _over_outcomes(self, prefix: str, which: fixtures.Which) -> np.ndarray:
        """`distribution` over `outcomes` (the last two always 0); cached."""
        key = (which, prefix)
        p = self._padded.get(key)
        if p is None:
            p = np.append(self.distribution(prefix, which), [0.0, 0.0])
            self._padded[key] = p
        return p

    def p(self, prefix: str) -> np.ndarray:
        """`next` over `outcomes`."""
        return self._over_outcomes(prefix, "target")

    def draft_p(self, prefix: str) -> np.ndarray:
        """`draft_next` over `outcomes`. Settings that are ambiguous for the draft alone (ties
        at a cut-off) are a DistError."""
        return self._over_outcomes(prefix, "draft")

    def joint(self, n: int) -> dict[str, float]:
        try:
            return super().joint(n)
        except fixtures.AmbiguousSamplingError as e:
            raise DistError(f"ambiguous sampler settings for this fixture: {e}") from None
        except ValueError as e:
            raise DistError(f"joint distribution undefined: {e}") from None

    def marginal(self, t: int) -> np.ndarray:
        try:
            return super().marginal(t)
        except ValueError as e:  # a special token is possible: generation may stop
            raise DistError(str(e)) from None


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


def describe(ch: str, spec: fixtures.FixtureSpec) -> str:
    """One outcome for people: the letter, '</s>', '<end>', '<other>' (an id outside the
    vocabulary), or text that is no fixture token, quoted ("'H'")."""
    if ch in _CODES or ch in spec.letters:
        return outcome_label(ch)
    return repr(ch)


__all__ = ["Truth", "describe", "encode_ids", "encode_text", "stratum_key"]
