"""`specaudit matrix`: the same three questions on several llama.cpp builds, side by side.

People run many builds, not just the one the patches were written for. For each build this
builds (or finds) the stock binaries and, where specaudit ships it, the `spec-logprobs`
patched ones, starts a speculating fixture server (draft model, ``--spec-type
draft-simple``) of each variant and asks:

- placeholders: does `check` find placeholder logprobs (stock / patched)?
- `/props` vs `/slots`: what ``/props`` says about speculation and what ``/slots`` shows;
- `dist`: does the speculating server keep the sampling distribution (stock / patched)? On
  the default (greedy-draft, sample-and-match) path, and on the rejection-sampling path
  (``--spec-draft-sampling probabilistic``, #27694) where the build has it; and where the
  build has the MTP drafter (``--spec-type draft-mtp``), on the mtp fixture (a glm4moe with
  its own MTP layer, `fixtures.mtp_spec`) on the MTP paths: ``mtp`` (greedy MTP drafts,
  sample-and-match) and ``mtp-rejection`` (probabilistic, rejection sampling), each with its
  drafted/accepted counts, which show the MTP path really ran.

Everything is measured on real binaries; a build whose source or patch is missing is an
error (`MatrixError`), never a silently empty row.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specaudit import check, distribution, fixtures, llama, speculation
from specaudit.client import Client
from specaudit.errors import SpecauditError
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import Patch, resolve_all
from specaudit.report import md_table

DEFAULT_BUILDS = (10705, 11205, 11434)
DEFAULT_SEEDS = 1000
REJECTION_FLAG = "--spec-draft-sampling"  # added with the rejection sampler (#27694)
# the --spec-type of the MTP drafter (the MTP paths' presets)
MTP_SPEC_TYPE = presets.PRESETS[presets.fixture_role("fixture-mtp", "mtp")].spec_type


class MatrixError(SpecauditError):
    """A matrix that can't be run: bad build list, failed build, failed server."""


@dataclass
class VariantResult:
    """One variant (stock or patched) of one build."""

    variant: str  # "stock" or "patched"
    bin_dir: str
    real: int  # tokens with real logprobs (check, every endpoint)
    placeholders: int
    check_verdict: str  # "real" or "placeholders"
    draft_n: int | None  # draft tokens the check's requests drafted
    # dist on each verification path this build has: path -> verdict and counts
    dist: dict[str, distribution.EngineResult] = field(default_factory=dict)


@dataclass
class BuildResult:
    build: int
    props_types: str | None  # /props default_generation_settings speculative.types
    slots_speculative: int | None  # /slots: slots that speculate
    slots_total: int | None
    has_rejection: bool  # the server has --spec-draft-sampling (#27694)
    stock: VariantResult
    patched: VariantResult | None  # None: specaudit ships no spec-logprobs patch for it
    patched_note: str | None = None
    # the MTP paths this build has (`build_mtp_paths`; run on the mtp fixture)
    mtp_paths: list[str] = field(default_factory=list)


@dataclass
class MatrixResult:
    builds: list[BuildResult]
    seeds: int
    fixture: str
    mtp_fixture: str | None = None  # the fixture of the MTP paths (None: no build has them)


ProgressFn = Callable[[str], None]
EnsureFn = Callable[[int, tuple[Patch, ...]], LlamaBinaries]


def parse_builds(text: str) -> tuple[int, ...]:
    """``"10705,11205,11434"`` -> (10705, 11205, 11434); MatrixError on anything else."""
    out = []
    for part in text.split(","):
        part = part.strip().removeprefix("b")
        if not part.isdigit() or not 1 <= int(part) <= 2**31 - 1:
            raise MatrixError(f"--builds must be build numbers separated by commas, got {text!r}")
        if int(part) not in out:
            out.append(int(part))
    if not out:
        raise MatrixError("--builds is empty")
    return tuple(out)


def _server_help(bins: LlamaBinaries) -> str:
    """What this llama-server's --help prints (stdout and stderr)."""
    try:
        r = subprocess.run([str(bins.server), "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MatrixError(f"cannot run {bins.server} --help: {e}") from None
    return r.stdout + r.stderr


def has_rejection(bins: LlamaBinaries) -> bool:
    """Whether this llama-server has the rejection sampler's flag (its own --help says)."""
    return REJECTION_FLAG in _server_help(bins)


def has_mtp(bins: LlamaBinaries) -> bool:
    """Whether this llama-server has the MTP drafter (``--spec-type draft-mtp``; its own --help
    lists the types)."""
    return MTP_SPEC_TYPE in _server_help(bins)


def build_mtp_paths(bins: LlamaBinaries) -> list[str]:
    """The MTP paths (`presets.MTP_PATHS`, on the mtp fixture) this llama-server has: none
    without the MTP drafter, mtp-rejection only with the rejection sampler."""
    if not has_mtp(bins):
        return []
    return [p for p in presets.MTP_PATHS if p != "mtp-rejection" or has_rejection(bins)]


def _variant(
    name: str,
    bins: LlamaBinaries,
    runs: Sequence[tuple[str, fixtures.FixtureSet, str]],
    seeds: int,
    logs: Path,
    progress: ProgressFn,
) -> tuple[VariantResult, speculation.SpeculationInfo]:
    """`runs`: (presets model, its fixture, path), one server each; "greedy" among them."""
    results: dict[str, distribution.EngineResult] = {}
    info: speculation.SpeculationInfo | None = None
    chk: check.CheckResult | None = None
    for model, fs, path in runs:
        wl = distribution.make_workload(fs.spec)
        preset = presets.PRESETS[presets.fixture_role(model, path)]
        label = f"b{bins.build} {name} {path}"
        srv = presets.for_preset(
            preset, bins, fs.target, fs.draft, log_path=logs / f"{label.replace(' ', '-')}.log"
        )
        with srv:
            if path == "greedy":  # the default path: also the placeholder and /slots readings
                progress(f"{label}: check")
                chk = check.run(
                    srv.url, endpoint="all", prompt=fs.spec.prompt, tokens=24, top_k=3, seed=1
                )
                with Client(srv.url, timeout=30) as c:
                    info = speculation.read(c)
            progress(f"{label}: dist ({seeds} seeds)")
            kind = distribution.PATH_ENGINES[path][1]
            eng = distribution.ServerEngine(srv.url, fs.spec, wl, label=label, kind=kind)
            res = distribution.measure(eng, fs.spec, wl, range(1, seeds + 1))
            res.path = path
            results[path] = res
    assert chk is not None and info is not None
    v = VariantResult(
        variant=name,
        bin_dir=str(bins.bin_dir),
        real=chk.real,
        placeholders=chk.placeholders,
        check_verdict=chk.verdict,
        draft_n=chk.speculation.draft_n,
        dist=results,
    )
    return v, info


def run(
    builds: Sequence[int] = DEFAULT_BUILDS,
    *,
    seeds: int = DEFAULT_SEEDS,
    work_dir: Path | None = None,
    progress: ProgressFn | None = None,
    ensure: EnsureFn | None = None,
) -> MatrixResult:
    """The matrix over `builds` on the default fixture (built in `work_dir`).

    `ensure(build, patches)` provides binaries (default `llama.ensure`: builds what is not
    cached, minutes per cold build).
    """
    if seeds < 1:
        raise MatrixError("--seeds must be at least 1")
    say = progress or (lambda msg: None)
    get = ensure or (lambda b, p: llama.ensure(b, p))
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work_dir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="specaudit-matrix-"))
            )
        work_dir.mkdir(parents=True, exist_ok=True)
        fs = fixtures.build(work_dir / "fixture")
        mtp_fs: fixtures.FixtureSet | None = None  # built for the first build with MTP
        logs = work_dir / "logs"
        logs.mkdir(exist_ok=True)
        out = []
        for b in builds:
            say(f"b{b}: stock binaries")
            stock_bins = get(b, ())
            rej = has_rejection(stock_bins)
            paths = ["greedy", "rejection"] if rej else ["greedy"]
            runs = [("fixture", fs, p) for p in paths]
            mtp_paths = build_mtp_paths(stock_bins)
            if mtp_paths and mtp_fs is None:
                mtp_fs = fixtures.build(work_dir / "fixture-mtp", kind="mtp")
            if mtp_fs is not None:
                runs += [("fixture-mtp", mtp_fs, p) for p in mtp_paths]
            stock, info = _variant("stock", stock_bins, runs, seeds, logs, say)
            patched: VariantResult | None = None
            note = None
            if presets.PATCH in llama.available_patches(b):
                say(f"b{b}: {presets.PATCH} binaries")
                patched, _ = _variant(
                    "patched", get(b, resolve_all((presets.PATCH,), b)), runs, seeds, logs, say
                )
            else:
                note = f"specaudit ships no {presets.PATCH} patch for b{b}"
            out.append(
                BuildResult(
                    build=b,
                    props_types=info.props_types,
                    slots_speculative=info.slots_speculative,
                    slots_total=info.slots_total,
                    has_rejection=rej,
                    stock=stock,
                    patched=patched,
                    patched_note=note,
                    mtp_paths=mtp_paths,
                )
            )
    return MatrixResult(
        builds=out,
        seeds=seeds,
        fixture=fs.spec.name,
        mtp_fixture=mtp_fs.spec.name if mtp_fs is not None else None,
    )


HEADERS = (
    "build",
    "placeholders (stock / patched)",
    "/props speculative.types vs /slots",
    "dist greedy draft (stock / patched)",
    "dist rejection (stock / patched)",
    "dist mtp (stock / patched)",
    "dist mtp-rejection (stock / patched)",
)


def _ph(v: VariantResult | None) -> str:
    if v is None:
        return "n/a"
    return f"{v.placeholders} of {v.real + v.placeholders}"


def _dv(v: VariantResult | None, path: str) -> str:
    if v is None:
        return "n/a"
    e = v.dist.get(path)
    if e is None:
        return "no such path"
    return f"{e.verdict.value} ({e.accepted}/{e.drafted} acc.)"


def rows(res: MatrixResult) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for b in res.builds:
        slots = (
            f"{b.slots_speculative}/{b.slots_total} slots speculate"
            if b.slots_total is not None
            else "unreadable"
        )
        rej = (
            f"{_dv(b.stock, 'rejection')} / {_dv(b.patched, 'rejection')}"
            if b.has_rejection
            else "no rejection sampler (before #27694)"
        )
        out.append(
            (
                f"b{b.build}",
                f"{_ph(b.stock)} / {_ph(b.patched)}",
                f"`{b.props_types}` vs {slots}",
                f"{_dv(b.stock, 'greedy')} / {_dv(b.patched, 'greedy')}",
                rej,
                *(_mtp_cell(b, p) for p in presets.MTP_PATHS),
            )
        )
    return out


def _mtp_cell(b: BuildResult, path: str) -> str:
    if path in b.mtp_paths:
        return f"{_dv(b.stock, path)} / {_dv(b.patched, path)}"
    if not b.mtp_paths:
        return f"no MTP drafter (no --spec-type {MTP_SPEC_TYPE})"
    return "no rejection sampler (before #27694)"


def to_markdown(res: MatrixResult) -> str:
    return "\n".join(
        [
            md_table(HEADERS, rows(res)),
            "",
            f"Fixture `{res.fixture}`, speculating llama-server (draft model, draft-simple); "
            f"`check` tokens with placeholders of all tokens (24 per endpoint); `dist` "
            f"{res.seeds} seeds, top-k 3, temperature 1; acc. = draft tokens accepted/drafted.",
            *(
                [
                    "",
                    f"MTP paths on fixture `{res.mtp_fixture}` (a glm4moe with its own MTP "
                    f"layer, --spec-type {MTP_SPEC_TYPE}, no draft model): mtp greedy MTP "
                    "drafts (sample-and-match), mtp-rejection probabilistic ones (rejection "
                    "sampling); drafted > 0 shows the MTP path ran.",
                ]
                if res.mtp_fixture is not None
                else []
            ),
        ]
    )


__all__ = [
    "DEFAULT_BUILDS",
    "BuildResult",
    "MatrixError",
    "MatrixResult",
    "VariantResult",
    "build_mtp_paths",
    "has_mtp",
    "has_rejection",
    "parse_builds",
    "rows",
    "run",
    "to_markdown",
]
