"""Sequential, anytime-valid testing: e-processes (test martingales) that may be looked at
after every token, with Ville's inequality keeping the false-alarm rate at most alpha."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["DIRECTED_LAMBDAS", "DirectedEProcess", "EProcess", "mixed_log_e"]


class EProcess:
    """Test martingale for "every token is drawn from its known conditional distribution".

    For each observed token x in context c, the e-value is multiplied by q_c(x) / p_c(x), where
    p_c is the null (true) distribution and q_c the predictive of a Dirichlet mixture fitted to
    the tokens seen so far in that context (Krichevsky-Trofimov on the null's support; a small
    prior mass on tokens the null forbids, so one such token makes the e-value infinite).
    Under the null E[q/p] = 1 at every step, hence P(sup E >= 1/alpha) <= alpha (Ville).
    """

    def __init__(self, prior: float = 0.5, off_support_prior: float = 0.1) -> None:
        self.prior = prior
        self.off_support_prior = off_support_prior
        self.log_e = 0.0
        self.steps = 0
        self.impossible = 0
        self._counts: dict[Hashable, np.ndarray] = {}
        # per context: its tokens seen so far, and the prior of the last null given for it
        # (the null's bytes, the prior, its sum), recomputed only when the null changes
        self._seen: dict[Hashable, float] = {}
        self._priors: dict[Hashable, tuple[bytes, np.ndarray, float]] = {}

    def update(
        self, context: Hashable, probs: Sequence[float] | np.ndarray, observed: int
    ) -> float:
        """Account for one token; returns the log e-value so far."""
        p = np.asarray(probs, dtype=float)
        counts = self._counts.get(context)
        if counts is None:
            counts = np.zeros(len(p))
            self._counts[context] = counts
            self._seen[context] = 0.0
        key = p.tobytes()
        cached = self._priors.get(context)
        if cached is None or cached[0] != key:
            support = p > 0
            n_off = int((~support).sum())
            prior = np.where(support, self.prior, self.off_support_prior / max(n_off, 1))
            cached = (key, prior, float(prior.sum()))
            self._priors[context] = cached
        _, prior, prior_sum = cached
        # the predictive (counts + prior) / (n + sum(prior)), at the observed token only
        q = (float(counts[observed]) + float(prior[observed])) / (self._seen[context] + prior_sum)
        self.steps += 1
        if p[observed] <= 0:
            self.impossible += 1
            self.log_e = math.inf
        elif math.isfinite(self.log_e):
            self.log_e += math.log(q) - math.log(p[observed])
        counts[observed] += 1
        self._seen[context] += 1.0
        return self.log_e

    @property
    def e_value(self) -> float:
        return math.exp(self.log_e) if self.log_e < 700 else math.inf

    def rejects(self, alpha: float) -> bool:
        return self.log_e >= math.log(1.0 / alpha)


DIRECTED_LAMBDAS = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0)


class DirectedEProcess:
    """Test martingale for one direction of deviation: p_lambda = p + lambda (d - p).

    Each token's factor is p_lambda(x) / p(x) = 1 + lambda u, with u = d(x)/p(x) - 1 (mean 0
    under p, and >= -1, so every factor is >= 0 for lambda in [0, 1]); the e-value is the
    average of the products over a grid of lambdas (an average of test martingales is one).
    Why: one parameter shared by every context pays far less for learning than the omnibus
    `EProcess`, whose per-context mixture pays in every context; a bug that leaks toward the
    draft is caught in a fraction of the samples.
    """

    def __init__(self, lambdas: Sequence[float] = DIRECTED_LAMBDAS) -> None:
        lam = np.asarray(lambdas, dtype=float)
        if lam.size == 0 or np.any(lam <= 0) or np.any(lam > 1):
            raise ValueError("lambdas must lie in (0, 1]")
        self.lambdas = lam
        self._log = np.zeros(lam.size)
        self.steps = 0

    def update(self, u: float) -> float:
        """Account for one token's score u = d(x)/p(x) - 1 (inf: the token is impossible)."""
        if not u >= -1.0:
            raise ValueError(f"score {u} < -1: not d(x)/p(x) - 1")
        self.steps += 1
        if math.isinf(u):
            self._log[:] = math.inf
        else:
            with np.errstate(divide="ignore"):
                self._log += np.log1p(self.lambdas * u)  # lambda = 1, u = -1: that member is 0
        return self.log_e

    @property
    def log_e(self) -> float:
        if np.all(np.isneginf(self._log)):
            return -math.inf
        return float(np.logaddexp.reduce(self._log) - math.log(self.lambdas.size))


def mixed_log_e(*log_es: float) -> float:
    """log of the average of e-processes: still an e-process (Ville holds for the average)."""
    return float(np.logaddexp.reduce(np.asarray(log_es, dtype=float)) - math.log(len(log_es)))
