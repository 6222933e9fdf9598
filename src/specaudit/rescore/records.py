"""The per-token record of a re-scored run: one home for what sampling produced and what the
reference said about it (`specaudit.reference.NextToken`, the reference's answer, which the
fidelity check reads too).

Why a record of its own: the sampler (engines), the statistics (PIT values, tests, power) are
written and tested apart; this is the only thing they pass between them, so each can be tested
on hand-made records.
"""

from __future__ import annotations

from dataclasses import dataclass

from specaudit.errors import SpecauditError
from specaudit.reference import NextToken

# a run's level: its tests together reject a correct engine with probability at most this, and
# its certificate's bounds hold together with probability at least 1 - this
DEFAULT_ALPHA = 0.01


class RescoreError(SpecauditError):
    """A re-scored run cannot be made or cannot decide (one line, exit 2): a reference that
    speculates, a different model, text that does not round-trip, too few samples..."""


@dataclass(frozen=True)
class TokenDraw:
    """One sampled token, re-scored.

    `prefix_key` identifies the exact token-id prefix (prompt ids + tokens generated before
    this one): equal keys are repeated prefixes (per-position G-tests pool them). `draft_token`
    is the draft's proposal at this position when the engine flags it (None otherwise, and
    for the token after a fully accepted draft, which `verified_by` still names);
    `draft_favourite` the draft model's most likely token for this prefix when known (with a
    model that is its own draft, the reference's argmax). `draft` is the draft's processed
    next-token distribution at this exact prefix (what it proposes from, after its own sampler
    chain), when known: an engine that reports it, or a drafter served apart; with it the bugs
    speculation makes have known shapes in (ref, draft) (`rescore.draft_lr`).
    """

    seed: int
    prompt: int  # index of the prompt in the run's prompt list
    position: int  # 0-based index of the generated token
    prefix_key: str
    token: int
    ref: NextToken
    draft_token: int | None = None
    draft_favourite: int | None = None
    draft: NextToken | None = None
    # the rule that verified this token's draft proposal when the engine flags it
    # ("rejection", "match", ...; `rescore.flags`): None for a token sampled one at a time
    verified_by: str | None = None


__all__ = ["DEFAULT_ALPHA", "RescoreError", "TokenDraw"]
