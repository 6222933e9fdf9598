"""Which of llama-server's verification paths a `dist` run exercised, and which it cannot.

llama-server b11434 verifies a draft in one of a few ways (docs/dist.md, "Verification
paths"): `--spec-type draft-simple` with a greedy draft (sample-and-match,
``common_sampler_sample_and_accept_n``), with ``--spec-draft-sampling probabilistic``
(rejection sampling, ``common_sampler_sample_and_accept_n_rejection``, temperature > 0), and
the n-gram drafters (no draft model: sample-and-match on n-gram proposals). `dist --engine
server` runs one server per path (`PATHS`) next to a plain one; the rest need models the
fixtures are not (`NOT_COVERED`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specaudit.distribution.results import DistError, DistResult, EngineResult
from specaudit.llama.presets import PATHS

# path -> (engine label, engine kind)
PATH_ENGINES: dict[str, tuple[str, str]] = {
    "plain": ("llama-server, no draft", "server-plain"),
    "greedy": ("llama-server + draft, greedy", "server-spec"),
    "rejection": ("llama-server + draft, rejection", "server-spec-rejection"),
    "ngram": ("llama-server + ngram-mod", "server-ngram"),
}

PATH_HELP: dict[str, str] = {
    "plain": "no speculation (the reference)",
    "greedy": "draft model, greedy draft verified by sample-and-match",
    "rejection": "draft model, --spec-draft-sampling probabilistic: rejection sampling (T > 0)",
    "ngram": "--spec-type ngram-mod, no draft model: n-gram drafts, sample-and-match",
}

# What no fixture can exercise, and why (listed under every run of the server engine).
NOT_COVERED: tuple[tuple[str, str], ...] = (
    (
        "mtp",
        "--spec-type draft-mtp drafts with the target's own multi-token-prediction heads; "
        "the fixtures have none",
    ),
    (
        "eagle3/dflash/dspark",
        "these drafters need draft heads trained on the target's hidden states; none exist "
        "for the fixtures",
    ),
    (
        "replay",
        "the checkpoint replay path (spec_is_replay) runs only on recurrent/hybrid models whose "
        "cache cannot drop a rejected suffix; the fixtures are plain transformers",
    ),
    (
        "synthetic",
        "--spec-synth-len is benchmark-only synthetic acceptance: it never verifies a draft",
    ),
    (
        "ngram-simple/map-k/map-k4v/cache",
        "the other n-gram drafters propose differently but verify like ngram-mod "
        "(sample-and-match); only ngram-mod runs",
    ),
)

REJECTION_NEEDS_TEMPERATURE = (
    "temperature 0: llama.cpp verifies a probabilistic draft by sample-and-match there; "
    "rejection sampling needs temperature > 0"
)


def check_paths(paths: Sequence[str] | None, temperature: float) -> tuple[str, ...] | None:
    """`paths` checked (None: every path, rejection only at temperature > 0); a DistError on
    an unknown path, a string, an empty list, or rejection asked for at temperature 0."""
    if paths is None:
        return tuple(p for p in PATHS if p != "rejection" or temperature > 0)
    if isinstance(paths, str):
        raise DistError("paths must be a sequence of path names, not one string")
    if not paths:
        raise DistError(f"no --path given (one or more of {', '.join(PATHS)})")
    for p in paths:
        if p not in PATHS:
            raise DistError(f"unknown --path {p!r} (one of {', '.join(PATHS)})")
    if "rejection" in paths and not temperature > 0:
        raise DistError(f"--path rejection needs --temperature > 0 ({REJECTION_NEEDS_TEMPERATURE})")
    return tuple(dict.fromkeys(paths))


def not_covered(paths: Sequence[str], temperature: float) -> list[tuple[str, str]]:
    """What a run of the server engine on `paths` leaves out: `NOT_COVERED`, and rejection
    when temperature 0 dropped it."""
    out = list(NOT_COVERED)
    if "rejection" not in paths and not temperature > 0:
        out.insert(0, ("rejection", REJECTION_NEEDS_TEMPERATURE))
    return out


def rejected(e: EngineResult) -> int | None:
    """Draft tokens the target rejected: drafted − accepted (None without counts)."""
    if e.drafted is None or e.accepted is None:
        return None
    return e.drafted - e.accepted


PATH_HEADERS = ("engine", "path", "verdict", "samples", "drafted", "accepted", "rejected")


def path_rows(res: DistResult) -> list[tuple[Any, ...]]:
    """One row per engine: the path it exercised and its draft counts (None: "-")."""
    return [
        (e.engine, e.path or "-", e.verdict.value, e.n_samples, e.drafted, e.accepted, rejected(e))
        for e in res.engines
    ]


def not_covered_lines(items: Sequence[tuple[str, str]]) -> list[str]:
    """Markdown bullets, one per path not covered."""
    return [f"- `{path}`: {why}" for path, why in items]


def paths_markdown(res: DistResult) -> str:
    """The paths table and the not-covered list (what `render.to_markdown` does not show)."""
    from specaudit.report import md_table

    lines = ["Verification paths:", "", md_table(PATH_HEADERS, path_rows(res))]
    if res.not_covered:
        lines += ["", "Not covered:", "", *not_covered_lines(res.not_covered)]
    return "\n".join(lines)


__all__ = [
    "NOT_COVERED",
    "PATHS",
    "PATH_ENGINES",
    "PATH_HEADERS",
    "PATH_HELP",
    "check_paths",
    "not_covered",
    "not_covered_lines",
    "path_rows",
    "paths_markdown",
    "rejected",
]
