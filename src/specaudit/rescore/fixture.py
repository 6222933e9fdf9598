"""The fixtures' closed form as a re-scoring reference: the cross-check of the re-scored test
against a truth no server computes, and the draft's favourite token where the draft is known.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specaudit import fixtures
from specaudit.fixtures import FixtureSpec, SamplerSettings
from specaudit.rescore.records import FavouriteFn, NextToken, RescoreError


def text_of(spec: FixtureSpec, ids: Sequence[int]) -> str:
    """The fixture text of letter ids (a special token in a prefix is refused)."""
    n = len(spec.letters)
    if any(not 0 <= i < n for i in ids):
        raise RescoreError(f"prefix {list(ids)} holds a token that is not a fixture letter")
    return "".join(spec.letters[i] for i in ids)


def closed_form(spec: FixtureSpec, ids: Sequence[int], sampler: SamplerSettings) -> NextToken:
    """The exact processed (post-sampling) and raw next-token distributions after `ids`."""
    text = text_of(spec, ids)
    ids_of = spec.token_ids
    post = fixtures.next_token_distribution(spec, text, sampler)
    raw = fixtures.raw_distribution(spec, text)
    return NextToken(
        probs={ids_of[t]: p for t, p in post.items() if p > 0},
        logprobs={ids_of[t]: math.log(p) for t, p in raw.items() if p > 0},
    )


def draft_favourite(spec: FixtureSpec, sampler: SamplerSettings) -> FavouriteFn:
    """prefix ids -> the fixture draft's most likely next token under `sampler`."""

    def fav(ids: Sequence[int]) -> int | None:
        dist = fixtures.next_token_distribution(spec, text_of(spec, ids), sampler, "draft")
        best = max(dist, key=lambda t: (dist[t], -spec.token_ids[t]))
        return spec.token_ids[best]

    return fav


__all__ = ["closed_form", "draft_favourite", "text_of"]
