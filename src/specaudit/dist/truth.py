"""The ground truth: a fixture's next-token distributions, in closed form from its definition.

Never taken from the engine under test (see `specaudit.fixtures`).
"""

from __future__ import annotations

import numpy as np

from specaudit import fixtures
from specaudit.dist.results import DistError, Workload


class Truth:
    """Closed-form next-token distributions of a fixture, cached by generated prefix."""

    def __init__(self, spec: fixtures.FixtureSpec, workload: Workload) -> None:
        self.spec = spec
        self.workload = workload
        self.labels: tuple[str, ...] = spec.tokens
        self.index = {t: i for i, t in enumerate(self.labels)}
        self._cache: dict[str, np.ndarray] = {}
        self._marginals: dict[int, np.ndarray] = {}

    def next(self, prefix: str) -> np.ndarray:
        """True distribution over all tokens of the token after prompt + `prefix`."""
        p = self._cache.get(prefix)
        if p is None:
            try:
                d = fixtures.conditional_distribution(
                    self.spec, self.workload.prompt, prefix, self.workload.sampler
                )
            except fixtures.AmbiguousSamplingError as e:
                raise DistError(f"ambiguous sampler settings for this fixture: {e}") from None
            p = np.array([d[t] for t in self.labels], dtype=float)
            self._cache[prefix] = p
        return p

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


def check_text(text: str, tokens: int, spec: fixtures.FixtureSpec, engine: str) -> None:
    """DistError unless `text` is `tokens` letters of the fixture."""
    if len(text) != tokens or any(ch not in spec.letters for ch in text):
        raise DistError(
            f"{engine} generated {text!r}, not {tokens} letters of fixture {spec.name!r} "
            "(is it running that fixture?)"
        )


__all__ = ["Truth", "check_text", "stratum_key"]
