"""Re-scored distribution test and logprob fidelity on any model (`specaudit rescore`).

Why: `dist` proves things about fixtures with a closed form; nobody can load a fixture into the
server they run in production. Here every token an engine samples is re-scored by a
*reference* (`specaudit.reference`): the same model file served without speculation, asked for
its processed next-token distribution given the exact token-id prefix. `records` holds the
per-token value every part shares (the sampler fills it, the statistics read it); `request`
checks a run's inputs; `runner` runs it; `sampling`
draws each seed's generation (`SeededGeneration`) from the engine; `analysis` decides: one Holm
family (`pit`'s KS, `scores`' surprisal, rank bins, two-sided favourite and exact per-prefix
tests, `outside`'s count of tokens beyond the reference's top-k against its own measured leak,
`draft_lr`'s e-process when the draft is known) decides BROKEN, with `sequential` beside
anytime-valid evidence; and `certify`'s time-uniform bounds decide between PRESERVED and
INCONCLUSIVE.
"""

from specaudit.rescore.analysis import RescoreStats, analyse, null_false_alarms
from specaudit.rescore.records import RescoreError, TokenDraw
from specaudit.rescore.request import DEFAULT_PROMPTS, RescoreRequest, make_request
from specaudit.rescore.runner import RescoreResult, run

__all__ = [
    "DEFAULT_PROMPTS",
    "RescoreError",
    "RescoreRequest",
    "RescoreResult",
    "RescoreStats",
    "TokenDraw",
    "analyse",
    "make_request",
    "null_false_alarms",
    "run",
]
