"""The statistics behind `specaudit dist`: does an engine sample from a known distribution?

Why these choices:

- **Goodness of fit** is a likelihood-ratio (G) test. The asymptotic chi-square reference is
  only trusted when every expected cell count is at least 5 (with Williams' correction, which
  keeps the G-test honest at moderate counts). Below that the p-value comes from the exact
  multinomial distribution when it can be enumerated, otherwise from a Monte-Carlo simulation
  of the same statistic under the null, so small counts never get an asymptotic p-value they
  have not earned. Pooling sparse cells is offered as an explicit method.
- **Strata**: later positions are tested conditionally on what came before. Each conditioning
  context is a stratum with its own expected distribution; under the null the strata are
  independent multinomials given their sizes, so their G statistics add up (and so do their
  degrees of freedom, or their simulated nulls).
- **Impossible outcomes**: a token whose true probability is exactly zero cannot be sampled by a
  correct engine, whatever the sample size. Observing one gives p = 0 and a BROKEN verdict with
  certainty; no asymptotics involved.
- **Effect size**: the total-variation distance with a simultaneous confidence interval built
  from per-cell Clopper-Pearson bounds (Bonferroni over cells): the interval covers every
  distribution consistent with those bounds, so it is conservative and valid for any n.
- **Certified TV**: a one-sided upper bound on a *prefix-averaged* TV, sum over contexts c of
  (n_c / n) TV(q_c, p_c): the plug-in estimate plus the largest deviation of a mean of n
  independent Bernoullis at level alpha, whatever their probabilities (`deviation_bound`,
  from Hoeffding's 1956 comparison with the binomial). Valid for any n and any number of
  contexts: the union over cell subsets is not needed, because the subset that attains the
  true TV is fixed (unknown, but not chosen from the data).
- **Directed test**: a one-degree-of-freedom score test toward a given alternative direction
  (`directed_test`): the total score of n independent samples, whose null distribution is known
  exactly (a finite distribution of one sample's score), Monte-Carlo or normal.
- **Verdicts**: BROKEN when a Holm-corrected test rejects at alpha; PRESERVED only when nothing
  rejects *and* the data rule out a TV above a stated tolerance (an equivalence statement: absence
  of evidence is not evidence of absence); WITHIN TOLERANCE when only the latter was certified
  (sequential mode stops there); otherwise INCONCLUSIVE.
- **Sequential**: an e-process (a product of predictive likelihood ratios, with a Dirichlet
  mixture as the alternative) is a test martingale under the null, so by Ville's inequality
  stopping the first time it exceeds 1/alpha keeps the false-alarm rate at most alpha however
  often one looks.

- **Full history and seeds**: within a pool of contexts that share a true distribution, is the
  token independent of the context (`homogeneity_test`)? Are consecutive seeds' samples
  independent (`pair_independence_test`)? Both have exact Monte-Carlo references from the
  known null; `mc_pvalue` can stop at a number of hits (Besag-Clifford), so a floor far below
  a small level is cheap where the evidence is weak.
- **Group-sequential spending**: by information fraction (`spent_alpha`, `look_level`:
  Lan-DeMets Pocock- or O'Brien-Fleming-type), since the maximum sample size is known.
- **Power against any deviation**: `detectable_tv`, from the noncentral chi-square and
  TV <= sqrt(chi2) / 2.

Where each part lives: `base` (result types, shared constants, `mc_pvalue`), `gof` (goodness of
fit), `tv` (TV intervals and certified bounds), `directed` (the directed score test),
`homogeneity` (history and seed independence), `power` (detectable TV), `verdicts` (Holm, the
decision rule, `Verdict`, alpha spending), `sequential` (e-processes). Everything public is
re-exported here, so `from specaudit import stats; stats.X` works for every X.
"""

from __future__ import annotations

from specaudit.stats.base import MC_DRAWS, TINY_P, GofResult, TvBound, TvInterval, mc_pvalue
from specaudit.stats.directed import MC_BUDGET, SKEW_LIMIT, directed_test, min_detectable_shift
from specaudit.stats.gof import (
    EXACT_LIMIT,
    METHODS,
    MIN_EXPECTED,
    g_statistic,
    multinomial_gof,
    pool_sparse,
    stratified_gof,
)
from specaudit.stats.homogeneity import (
    PAIR_MC_BUDGET,
    g_independence,
    homogeneity_test,
    pair_independence_test,
)
from specaudit.stats.power import detectable_noncentrality, detectable_tv
from specaudit.stats.sequential import DIRECTED_LAMBDAS, DirectedEProcess, EProcess, mixed_log_e
from specaudit.stats.tv import (
    clopper_pearson,
    conditional_tv_bound,
    deviation_bound,
    samples_needed,
    sequence_tv_bound,
    tv_distance,
    tv_interval,
)
from specaudit.stats.verdicts import (
    SPENDING,
    Verdict,
    alpha_spending,
    decide,
    holm,
    look_level,
    spent_alpha,
)

__all__ = [
    "PAIR_MC_BUDGET",
    "SPENDING",
    "detectable_noncentrality",
    "detectable_tv",
    "g_independence",
    "homogeneity_test",
    "look_level",
    "mc_pvalue",
    "pair_independence_test",
    "sequence_tv_bound",
    "spent_alpha",
    "DIRECTED_LAMBDAS",
    "EXACT_LIMIT",
    "MC_BUDGET",
    "MC_DRAWS",
    "METHODS",
    "MIN_EXPECTED",
    "SKEW_LIMIT",
    "TINY_P",
    "DirectedEProcess",
    "EProcess",
    "GofResult",
    "mixed_log_e",
    "TvBound",
    "TvInterval",
    "Verdict",
    "alpha_spending",
    "clopper_pearson",
    "conditional_tv_bound",
    "decide",
    "deviation_bound",
    "directed_test",
    "g_statistic",
    "holm",
    "min_detectable_shift",
    "multinomial_gof",
    "pool_sparse",
    "samples_needed",
    "stratified_gof",
    "tv_distance",
    "tv_interval",
]
