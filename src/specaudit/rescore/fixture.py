"""The fixture draft's favourite token, in closed form: where the draft is known, the
re-scored test's directed part aims at what it really proposes. (The closed form as a
reference is `specaudit.check.fidelity.FixtureReference`.)
"""

from __future__ import annotations

from collections.abc import Sequence

from specaudit import fixtures
from specaudit.fixtures import FixtureSpec, SamplerSettings
from specaudit.rescore.records import FavouriteFn, RescoreError


def text_of(spec: FixtureSpec, ids: Sequence[int]) -> str:
    """The fixture text of letter ids (a special token in a prefix is refused)."""
    n = len(spec.letters)
    if any(not 0 <= i < n for i in ids):
        raise RescoreError(f"prefix {list(ids)} holds a token that is not a fixture letter")
    return "".join(spec.letters[i] for i in ids)


def draft_favourite(spec: FixtureSpec, sampler: SamplerSettings) -> FavouriteFn:
    """prefix ids -> the fixture draft's most likely next token under `sampler`."""

    def fav(ids: Sequence[int]) -> int | None:
        dist = fixtures.next_token_distribution(spec, text_of(spec, ids), sampler, "draft")
        best = max(dist, key=lambda t: (dist[t], -spec.token_ids[t]))
        return spec.token_ids[best]

    return fav


__all__ = ["draft_favourite", "text_of"]
