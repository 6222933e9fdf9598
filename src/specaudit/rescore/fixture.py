"""The fixture draft's distribution, in closed form: where the draft is known, the re-scored
test's draft-aimed parts (the favourite, `rescore.draft_lr`) aim at what it really proposes.
(The closed form as a reference is `specaudit.fidelity.FixtureReference`.)
"""

from __future__ import annotations

from collections.abc import Sequence

from specaudit import fixtures
from specaudit.fixtures import FixtureSpec, SamplerSettings
from specaudit.reference import NextToken
from specaudit.rescore.records import RescoreError


def text_of(spec: FixtureSpec, ids: Sequence[int]) -> str:
    """The fixture text of letter ids (a special token in a prefix is refused)."""
    n = len(spec.letters)
    if any(not 0 <= i < n for i in ids):
        raise RescoreError(f"prefix {list(ids)} holds a token that is not a fixture letter")
    return "".join(spec.letters[i] for i in ids)


class FixtureDraft:
    """The fixture draft's processed next-token distribution q under `sampler` (token ids of
    `spec`): a `reference.NextTokenSource` that needs no server."""

    def __init__(self, spec: FixtureSpec, sampler: SamplerSettings) -> None:
        self.spec = spec
        self.sampler = sampler

    async def next_token(self, ids: Sequence[int]) -> NextToken:
        dist = fixtures.next_token_distribution(
            self.spec, text_of(self.spec, ids), self.sampler, "draft"
        )
        return NextToken(probs={self.spec.token_ids[t]: p for t, p in dist.items() if p > 0})

    def at(self, sampler: SamplerSettings) -> FixtureDraft:
        """The same draft under other settings (a run's arm at another temperature)."""
        return FixtureDraft(self.spec, sampler)


__all__ = ["FixtureDraft", "text_of"]
