"""Which of llama-server's verification paths a `dist` run exercised, and which it cannot.

llama-server b11434 verifies a draft in one of a few ways (docs/dist.md, "Verification
paths"): `--spec-type draft-simple` with a greedy draft (sample-and-match,
``common_sampler_sample_and_accept_n``), with ``--spec-draft-sampling probabilistic``
(rejection sampling, ``common_sampler_sample_and_accept_n_rejection``, temperature > 0), and
the n-gram drafters (no draft model: sample-and-match on n-gram proposals). `dist --engine
server` runs one server per path (`PATHS`: each n-gram type its own) next to a plain one; the
rest need models the fixtures are not (`NOT_COVERED`). `SPEC_TYPES` maps every --spec-type of
b11434 to the paths that exercise it, so the coverage table (`coverage_rows`) names what no
run of `dist` can check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specaudit.distribution.results import DistError, DistResult, EngineResult
from specaudit.llama.presets import (
    FIXTURE_NGRAM_ARGS,
    MODEL_PATHS,
    MTP_MODEL_PATHS,
    MTP_PATHS,
    NGRAM_TYPE_ARGS,
    PATHS,
    REPLAY_MODEL_PATHS,
    REPLAY_PATHS,
)

# path -> (engine label, engine kind)
PATH_ENGINES: dict[str, tuple[str, str]] = {
    "plain": ("llama-server, no draft", "server-plain"),
    "greedy": ("llama-server + draft, greedy", "server-spec"),
    "rejection": ("llama-server + draft, rejection", "server-spec-rejection"),
    "ngram": ("llama-server + ngram-mod", "server-ngram"),
    **{t: (f"llama-server + {t}", f"server-{t}") for t in NGRAM_TYPE_ARGS},
    "mtp": ("llama-server + MTP, greedy", "server-mtp"),
    "mtp-rejection": ("llama-server + MTP, rejection", "server-mtp-rejection"),
    "eagle3": ("llama-server + EAGLE3 head", "server-eagle3"),
    "dflash": ("llama-server + DFlash draft", "server-dflash"),
    "dspark": ("llama-server + DSpark draft", "server-dspark"),
    "replay": ("llama-server (Mamba) + draft, greedy, replay", "server-replay"),
    "replay-rejection": (
        "llama-server (Mamba) + draft, rejection, replay",
        "server-replay-rejection",
    ),
}

PATH_HELP: dict[str, str] = {
    "plain": "no speculation (the reference)",
    "greedy": "draft model, greedy draft verified by sample-and-match",
    "rejection": "draft model, --spec-draft-sampling probabilistic: rejection sampling (T > 0)",
    "ngram": "--spec-type ngram-mod, no draft model: n-gram drafts, sample-and-match",
    "ngram-simple": "--spec-type ngram-simple (n=1, m=2): n-gram drafts, sample-and-match",
    "ngram-map-k": "--spec-type ngram-map-k (n=1, m=1): n-gram drafts, sample-and-match",
    "ngram-map-k4v": "--spec-type ngram-map-k4v (n=1, m=1, 1 hit): n-gram drafts, sample-and-match",
    "ngram-cache": "--spec-type ngram-cache: n-gram cache drafts, sample-and-match",
    "mtp": "--spec-type draft-mtp, no draft model: the target's MTP layer drafts greedily, "
    "sample-and-match (the mtp fixture)",
    "mtp-rejection": "--spec-type draft-mtp --spec-draft-sampling probabilistic: rejection "
    "sampling of the MTP layer's drafts (T > 0; the mtp fixture)",
    "eagle3": "--spec-type draft-eagle3, -md the fixture's EAGLE3 head: drafts from the "
    "token it is fed and the target's hidden states, sample-and-match",
    "dflash": "--spec-type draft-dflash, -md the fixture's DFlash draft: a block of argmax "
    "drafts from one non-causal pass anchored on the last token, sample-and-match",
    "dspark": "--spec-type draft-dspark, -md the fixture's DSpark draft: the DFlash block plus a "
    "Markov head chaining each draft on the one before, sample-and-match",
    "replay": "draft model, greedy, on a Mamba target: a partial acceptance restores the "
    "target's checkpoint and re-verifies what was accepted (the replay fixture)",
    "replay-rejection": "draft model, --spec-draft-sampling probabilistic, on a Mamba target: "
    "rejection sampling, a partial acceptance restored and re-accepted (T > 0; the replay "
    "fixture; b11434 reuses the rejection draws after a replay: BROKEN from position 4 at "
    "--tokens 8, 15000 seeds)",
}

# What no fixture can exercise, and why (listed under every run of the server engine).
NOT_COVERED: tuple[tuple[str, str], ...] = (
    (
        "synthetic",
        "--spec-synth-len is benchmark-only synthetic acceptance: it never verifies a draft",
    ),
)


def _ngram(spec_type: str, how: str, path: str | None = None) -> tuple[str, tuple[str, ...], str]:
    """A `SPEC_TYPES` row of an n-gram type (path: its name but ngram-mod's), with its flags."""
    args = FIXTURE_NGRAM_ARGS if spec_type == "ngram-mod" else NGRAM_TYPE_ARGS[spec_type]
    flags = " ".join(args) or "no flags"
    return spec_type, (path or spec_type,), f"no draft model; {flags}: {how}; sample-and-match"


# Every --spec-type of llama.cpp b11434 (common/speculative.cpp, common_speculative_type_from_str),
# the `dist` paths that exercise it (empty: not covered) and how, or why not (docs/dist.md).
SPEC_TYPES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("none", ("plain",), "no speculation: the reference"),
    (
        "draft-simple",
        ("greedy", "rejection", "replay", "replay-rejection"),
        "the fixture's draft model (-md): greedy drafts verified by sample-and-match; "
        "--spec-draft-sampling probabilistic drafts by rejection sampling (T > 0); on the "
        "replay fixture's Mamba target (its memory cannot drop a rejected suffix) both through "
        "the checkpoint replay path: restore, re-decode, re-verify (greedy) or re-accept "
        "(probabilistic; b11434 then reuses the rejection sampler's draws in the next "
        "verification, BROKEN at --tokens 8 and 15000 seeds)",
    ),
    (
        "draft-mtp",
        ("mtp", "mtp-rejection"),
        "no -md: the target's own MTP (nextn) layer drafts in a second context on the target "
        "(the mtp fixture, a glm4moe with one MTP layer): greedy drafts verified by "
        "sample-and-match; --spec-draft-sampling probabilistic by rejection sampling (T > 0)",
    ),
    (
        "draft-eagle3",
        ("eagle3",),
        "-md the fixture's EAGLE3 head (fixtures.eagle3_draft: arch eagle3, target_layers "
        "[0, 0, 0], fc over the target's hidden states, one layer attending to its own "
        "position, the draft table as its output): the table's greedy chain from the fed "
        "token, verified by sample-and-match",
    ),
    (
        "draft-dflash",
        ("dflash",),
        "-md the fixture's DFlash draft (fixtures.dflash_draft: arch dflash, target_layers "
        "[0], dflash.block_size 4, UNK as the mask token): one non-causal pass over [last "
        "token, mask, mask, mask] whose every position attends to the last token, drafting "
        "the draft table's argmax for it three times; verified by sample-and-match",
    ),
    (
        "draft-dspark",
        ("dspark",),
        "-md the fixture's DSpark draft (the DFlash draft plus a Markov head: markov_w1 the "
        "identity, markov_w2 the draft table): anchor-first blocks, each draft the argmax of "
        "the anchor's row (scaled) plus the previous draft's (mostly the table's greedy "
        "chain, truth.dflash_draft); verified by "
        "sample-and-match",
    ),
    _ngram("ngram-simple", "the tokens after the last earlier match of the last token"),
    _ngram("ngram-map-k", "a per-slot key map kept across requests"),
    _ngram("ngram-map-k4v", "the most frequent of up to four values per key, per-slot map"),
    _ngram("ngram-mod", "a hash pool of n-grams shared by all slots", "ngram"),
    _ngram("ngram-cache", "a per-slot 1- to 4-gram cache of the context, kept across requests"),
)

COVERAGE_HEADERS = ("spec-type", "covered", "path", "verdict", "drafted", "accepted", "why")


def coverage_rows(res: DistResult | None = None) -> list[tuple[Any, ...]]:
    """One row per (--spec-type, path) of b11434 (`SPEC_TYPES`), with the verdict and draft
    counts of the engine of `res` that ran that path ("not run": covered, but not in `res`;
    None: "-")."""
    by_path = {e.path: e for e in (res.engines if res else ()) if e.path}
    rows: list[tuple[Any, ...]] = []
    for spec_type, paths, why in SPEC_TYPES:
        if not paths:
            rows.append((spec_type, "no", "-", "-", None, None, why))
        for p in paths:
            e = by_path.get(p)
            verdict = e.verdict.value if e else "not run"
            counts = (e.drafted, e.accepted) if e else (None, None)
            rows.append((spec_type, "yes", p, verdict, *counts, why))
    return rows


REJECTION_NEEDS_TEMPERATURE = (
    "temperature 0: llama.cpp verifies a probabilistic draft by sample-and-match there; "
    "rejection sampling needs temperature > 0"
)


#: Paths that verify by rejection sampling: only at temperature > 0.
REJECTION_PATHS = ("rejection", "mtp-rejection", "replay-rejection")


def kind_paths(kind: str) -> tuple[str, ...]:
    """The paths a fixture kind runs: the MTP fixture `MTP_MODEL_PATHS` (only it has an MTP
    layer, and only MTP drafts with it), the replay fixture `REPLAY_MODEL_PATHS` (only its
    Mamba target makes llama-server replay), every other kind every other path."""
    if kind in ("mtp", "mtp-context", "mtp-attention"):
        return MTP_MODEL_PATHS
    if kind == "replay":
        return REPLAY_MODEL_PATHS
    return MODEL_PATHS["fixture"]


def path_kind(path: str) -> str:
    """The built-in fixture kind that runs `path`: "mtp" for `MTP_PATHS`, "replay" for
    `REPLAY_PATHS`, "last-token" for the others (the inverse of `kind_paths`)."""
    if path in MTP_PATHS:
        return "mtp"
    if path in REPLAY_PATHS:
        return "replay"
    return "last-token"


def check_paths(
    paths: Sequence[str] | None, temperature: float, kind: str = "last-token"
) -> tuple[str, ...] | None:
    """`paths` checked (None: every path of the fixture `kind`, rejection paths only at
    temperature > 0); a DistError on an unknown path, a string, an empty list, a rejection
    path asked for at temperature 0, or a path the fixture kind cannot run."""
    if paths is None:
        return tuple(p for p in kind_paths(kind) if p not in REJECTION_PATHS or temperature > 0)
    if isinstance(paths, str):
        raise DistError("paths must be a sequence of path names, not one string")
    if not paths:
        raise DistError(f"no --path given (one or more of {', '.join(PATHS)})")
    for p in paths:
        if p not in PATHS:
            raise DistError(f"unknown --path {p!r} (one of {', '.join(PATHS)})")
    for p in REJECTION_PATHS:
        if p in paths and not temperature > 0:
            raise DistError(f"--path {p} needs --temperature > 0 ({REJECTION_NEEDS_TEMPERATURE})")
    for p in paths:
        if p not in kind_paths(kind):
            raise DistError(f"--path {p} needs {_fixture_for(p, kind)}")
    return tuple(dict.fromkeys(paths))


def _fixture_for(path: str, kind: str) -> str:
    """What `path` needs that a fixture of `kind` lacks, in words."""
    if path in MTP_PATHS:
        return (
            "an mtp fixture (--fixture-kind mtp, mtp-context or mtp-attention): only they "
            "have an MTP layer"
        )
    if path in REPLAY_PATHS:
        return (
            "the replay fixture (--fixture-kind replay): only its Mamba target makes "
            "llama-server replay"
        )
    return f"a fixture of another kind (the {kind} fixture runs {', '.join(kind_paths(kind))})"


def not_covered(paths: Sequence[str], temperature: float) -> list[tuple[str, str]]:
    """What a run of the server engine on `paths` leaves out: `NOT_COVERED`, and rejection
    (and mtp-rejection next to mtp) when temperature 0 dropped it."""
    out = list(NOT_COVERED)
    dropped = [
        "rejection",
        *(["mtp-rejection"] if "mtp" in paths else []),
        *(["replay-rejection"] if "replay" in paths else []),
    ]
    for p in reversed(dropped):
        if p not in paths and not temperature > 0:
            out.insert(0, (p, REJECTION_NEEDS_TEMPERATURE))
    return out


INCONSISTENT = "inconsistent"  # what a table says where the engine's counters contradict


def counts_consistent(e: EngineResult) -> bool:
    """Whether the engine's draft counters can both be true: never more tokens accepted than
    drafted (OpenVINO GenAI's draft path reports more, docs/openvino.md)."""
    return e.drafted is None or e.accepted is None or e.accepted <= e.drafted


def rejected(e: EngineResult) -> int | None:
    """Draft tokens the target rejected: drafted − accepted (None without counts, and when the
    counters are inconsistent: a negative count would be printed as if it were one)."""
    if e.drafted is None or e.accepted is None or not counts_consistent(e):
        return None
    return e.drafted - e.accepted


# Accepted and rejected draft tokens each, below which a speculating engine's verification ran
# too rarely for its verdict to certify the path: a PRESERVED over 3 drafted tokens says the
# outputs kept the distribution, not that the path's accept and reject branches are right.
MIN_EXERCISED = 100


def too_rarely(e: EngineResult) -> str | None:
    """Why the engine's speculative machinery ran too rarely to certify its path (with its
    counts), or None: exercised enough, not speculating (the plain path), or no counts."""
    rej = rejected(e)
    if e.path == "plain" or e.drafted is None or e.accepted is None or rej is None:
        return None
    if e.accepted >= MIN_EXERCISED and rej >= MIN_EXERCISED:
        return None
    return (
        f"its speculation ran too rarely to certify the path: {e.drafted} drafted, "
        f"{e.accepted} accepted, {rej} rejected (certifying a path takes at least "
        f"{MIN_EXERCISED} accepted and {MIN_EXERCISED} rejected draft tokens)"
    )


def exercised(e: EngineResult) -> str:
    """The paths table's cell: "yes", "too rarely", or "-" (nothing to exercise or count)."""
    if too_rarely(e) is not None:
        return "too rarely"
    if e.path == "plain" or rejected(e) is None:
        return "-"
    return "yes"


PATH_HEADERS = (
    "engine", "path", "verdict", "samples", "drafted", "accepted", "rejected", "exercised",
)  # fmt: skip


def path_rows(res: DistResult) -> list[tuple[Any, ...]]:
    """One row per engine: the path it exercised and its draft counts (None: "-")."""
    return [
        (
            e.engine, e.path or "-", e.verdict.value, e.n_samples, e.drafted, e.accepted,
            rejected(e) if counts_consistent(e) else INCONSISTENT, exercised(e),
        )
        for e in res.engines
    ]  # fmt: skip


def not_covered_lines(items: Sequence[tuple[str, str]]) -> list[str]:
    """Markdown bullets, one per path not covered."""
    return [f"- `{path}`: {why}" for path, why in items]


def paths_markdown(res: DistResult) -> str:
    """The paths table and the not-covered list (what `render.to_markdown` does not show)."""
    from specaudit.report import md_table

    lines = ["Verification paths:", "", md_table(PATH_HEADERS, path_rows(res))]
    if any(e.path for e in res.engines):
        rows = coverage_rows(res)
        lines += ["", "Every --spec-type of b11434:", "", md_table(COVERAGE_HEADERS, rows)]
    if res.not_covered:
        lines += ["", "Not covered:", "", *not_covered_lines(res.not_covered)]
    return "\n".join(lines)


__all__ = [
    "COVERAGE_HEADERS",
    "NOT_COVERED",
    "PATHS",
    "PATH_ENGINES",
    "PATH_HEADERS",
    "PATH_HELP",
    "REJECTION_PATHS",
    "SPEC_TYPES",
    "MIN_EXERCISED",
    "check_paths",
    "coverage_rows",
    "kind_paths",
    "path_kind",
    "not_covered",
    "not_covered_lines",
    "path_rows",
    "paths_markdown",
    "rejected",
    "counts_consistent",
    "exercised",
    "too_rarely",
    "INCONSISTENT",
]
