"""Mutation testing of `specaudit dist`: how much power does the verifier have against real
speculative-decoding bugs?

Builds llama.cpp b11434 with each bundled mutant (`llama.available_mutants()`; incremental
rebuilds of the cached work tree, then cached), plus the stock and every bundled patch
(`llama.available_patches()`: the controls, which must stay PRESERVED), and runs dist on each
with the available fixtures (the default last-token one; the context-sensitive one when
`specaudit.fixtures` has it) on the verification paths:

- greedy: `--spec-type draft-simple` (llama.cpp's default `--spec-draft-sampling greedy`:
  argmax draft, sample-and-match verification), T = 1;
- probabilistic: `--spec-draft-sampling probabilistic` (sampled draft, rejection sampling),
  at T = 1 and at T = 0.7 (temperature-dependent bugs are invisible at T = 1);
- ngram-mod (`--spec-ngram-mod-n-match 1 --spec-ngram-mod-n-min 1 --spec-ngram-mod-n-max 3`,
  so it drafts on the fixture's short texts), for builds whose patch touches the server's shared
  speculative code (tools/server/), and for the controls.

Per row: N samples (seeds 1..N) are drawn once, then
- verdict: the fixed-sample test on all N at alpha = 1e-3 (LOUD: the server itself failed);
- sequential: samples until the `--sequential` BROKEN rule fires (the e-process, omnibus and
  draft-direction averaged, reaching 2/alpha, or a group-sequential look's fixed tests
  rejecting at their share of alpha/2; its WITHIN TOLERANCE stop switched off so the count is
  not cut short), ">N" if never;
- fixed: the smallest n of 10, 20, 50, 100, 200, 500, 1000, 2000, ... at which the fixed test on
  the first n samples rejects;
- --sequential: what `specaudit dist --sequential --alpha 1e-3` would have answered, and when;
- = stock: whether every sample equals the stock build's for the same seed, fixture and path.

The logprob mutants (``lp-*``: bugs in what spec-logprobs *reports*, not in what is sampled)
get a fidelity row each instead, next to stock and spec-logprobs as controls: every token of
`--fidelity-seeds` seeds x 16 tokens x each probe kind (both endpoints, pre- and
post-sampling, streamed and not; `fidelity_probe.DEFAULT_KINDS`) classified against the closed
form (`specaudit.fidelity`), with the tolerance measured from the plain server's spread;
beside it what `specaudit check`'s classification says of the same tokens.

The MTP mutants (``mtp-*``: bugs in ``--spec-type draft-mtp``'s driver) get rows of their own,
on the mtp fixture (`fixtures.mtp_spec`, a glm4moe with its own MTP layer; the only model the
MTP paths run on) on both MTP paths at T = 1, mtp-rejection (probabilistic MTP drafts,
rejection sampling) and mtp (greedy MTP drafts, sample-and-match), next to stock and
spec-logprobs as controls; the columns above, plus on the mtp path how many samples' drafted /
accepted counts differ from what a correct server drafts and accepts for that very text
(`fixtures.mtp_greedy_counts`), and what each row finds: BROKEN after how many samples, or
equivalent (every sample stock's) / kept, and why.

    .venv/bin/python benchmarks/bench_mutants.py [--seeds 2000] [--only NAME ...]
        [--fidelity-seeds 20] [--fidelity-only] [--mtp-only]
        [--mtp-kind mtp|mtp-context|mtp-attention] [--mtp-tokens 4]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from specaudit import distribution, fidelity, fixtures, llama
from specaudit.check import fidelity_probe
from specaudit.distribution import runner
from specaudit.errors import SpecauditError
from specaudit.fixtures.reference import AmbiguousSamplingError
from specaudit.llama import presets, sources
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.patches import resolve_all
from specaudit.llama.server import LlamaServer
from specaudit.report import md_table
from specaudit.stats import Verdict

ALPHA = 1e-3
GRID = (10, 20, 50, 100, 200, 500, 1000, 2000, 4000, 8000)
NGRAM_ARGS = (
    "--spec-ngram-mod-n-match", "1", "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "3",
)  # fmt: skip
PATHS = ("greedy", "probabilistic", "ngram-mod")
SHARED = "tools/server/"  # a patch touching this runs on every path, ngram-mod included


def log(msg: str) -> None:
    print(f"[bench_mutants] {msg}", file=sys.stderr, flush=True)


@dataclass
class Row:
    build: str
    fixture: str
    path: str
    temperature: float
    verdict: str
    eproc: str = "-"
    fixed: str = "-"
    sequential: str = "-"
    same: str = "-"
    drafted: str = "-"
    counts_off: str = "-"  # mtp path: samples whose counts differ from the closed form's

    def cells(self) -> list[str]:
        return [
            self.build, self.fixture, f"{self.path} T={self.temperature:g}", self.verdict,
            self.eproc, self.fixed, self.sequential, self.same, self.drafted,
        ]  # fmt: skip


HEADERS = [
    "mutant / build", "fixture", "path", "verdict (fixed, all N)", "samples to BROKEN "
    "(sequential rule, α=1e-3)", "fixed test first rejects at", "--sequential answers",
    "= stock", "drafted/accepted",
]  # fmt: skip


def fixtures_available(work: Path) -> list[tuple[str, fixtures.FixtureSet]]:
    """Both fixture kinds: the default last-token one and the context-sensitive one."""
    return [
        ("last-token", runner.load_fixture(None)),
        ("context", fixtures.build(work / "context", fixtures.context_spec())),
    ]


@contextlib.contextmanager
def server(
    bins: LlamaBinaries, fs: fixtures.FixtureSet, path: str, log_dir: Path
) -> Iterator[LlamaServer]:
    if path in presets.MTP_PATHS:  # the mtp fixture: its own MTP layer drafts
        with runner.spawn_server(bins, fs, path=path, log_dir=log_dir) as s:
            yield s
    elif path == "ngram-mod":
        srv = presets.server(
            bins, fs.target, kind="fixture", spec_type="ngram-mod",
            ctx_per_slot=fs.spec.config.context_length, extra_args=NGRAM_ARGS,
            log_path=log_dir / "ngram.log", name="bench-ngram",
        )  # fmt: skip
        with srv:
            yield srv
    else:
        with runner.spawn_server(bins, fs, draft=True, draft_sampling=path, log_dir=log_dir) as s:
            yield s


def first_fixed_rejection(
    fs: fixtures.FixtureSet, wl: distribution.Workload, samples: list[distribution.Sample]
) -> str:
    for n in GRID:
        if n > len(samples):
            break
        if distribution.analyse(fs.spec, wl, samples[:n], alpha=ALPHA).verdict is Verdict.BROKEN:
            return str(n)
    return f">{len(samples)}"


def measure_row(
    build: str,
    bins: LlamaBinaries,
    fx: str,
    fs: fixtures.FixtureSet,
    path: str,
    temps: tuple[float, ...],
    n: int,
    log_dir: Path,
    stock: dict[tuple[str, str, float], tuple[list[str], Row]],
    tokens: int = distribution.DEFAULT_TOKENS,
) -> list[Row]:
    rows = []
    seeds = range(1, n + 1)
    try:
        with server(bins, fs, path, log_dir) as srv:
            got = {}
            for t in temps:
                sampler = fixtures.SamplerSettings(top_k=3, top_p=1.0, min_p=0.0, temperature=t)
                wl = distribution.make_workload(
                    fs.spec, sampler=sampler, tokens=tokens, positions=min(tokens, 4)
                )
                eng = distribution.ServerEngine(
                    srv.url, fs.spec, wl, label=build, kind="server-spec"
                )
                got[t] = (wl, distribution.collect(eng, seeds))
    except (SpecauditError, OSError) as e:
        msg = " ".join(str(e).split())
        tail = msg.split(": ")[-1][:60]
        log(f"{build} {fx} {path}: LOUD: {msg[:160]}")
        return [Row(build, fx, path, t, f"LOUD ({tail})") for t in temps]
    for t, (wl, samples) in got.items():
        texts = [s.text for s in samples]
        key = (fx, path, t)
        dn = sum(s.drafted or 0 for s in samples)
        da = sum(s.accepted or 0 for s in samples)
        off = mtp_counts_off(fs, samples) if path == "mtp" else "-"
        base = stock.get(key)
        if build != "stock" and base is not None and base[0] == texts:
            # the very samples of stock: the (deterministic) analysis would repeat stock's row
            r0 = base[1]
            rows.append(replace(r0, build=build, same="yes", drafted=f"{dn}/{da}", counts_off=off))
        else:
            fixed = distribution.analyse(fs.spec, wl, samples, alpha=ALPHA)
            ev, eseq = distribution.replay_sequential(
                fs.spec, wl, samples, alpha=ALPHA, tolerance=1e-9
            )
            sv, sseq = distribution.replay_sequential(fs.spec, wl, samples, alpha=ALPHA)
            rows.append(
                Row(
                    build,
                    fx,
                    path,
                    t,
                    verdict=fixed.verdict.value,
                    eproc=str(eseq.samples_used) if ev is Verdict.BROKEN else f">{n}",
                    fixed=first_fixed_rejection(fs, wl, samples),
                    sequential=f"{sv.value} @{sseq.samples_used}",
                    same="-" if build == "stock" else "no",
                    drafted=f"{dn}/{da}",
                    counts_off=off,
                )  # fmt: skip
            )
            if build == "stock":
                stock[key] = (texts, rows[-1])
        log(f"{build} {fx} {path} T={t:g}: {rows[-1].cells()[3:]}")
    return rows


def mtp_counts_off(fs: fixtures.FixtureSet, samples: list[distribution.Sample]) -> str:
    """Samples of the greedy mtp path whose drafted/accepted counts differ from what a correct
    server drafts and accepts for that very text (`fixtures.mtp_greedy_counts`), and how many
    the closed form cannot decide (a greedy draft within rounding of a tie; the mtp-attention
    fixture's), which are not counted either way."""
    spec, off, undecided = fs.spec, 0, 0
    for s in samples:
        try:
            expected = fixtures.mtp_greedy_counts(spec, spec.prompt, s.text)
        except AmbiguousSamplingError:
            undecided += 1
            continue
        off += (s.drafted, s.accepted) != expected
    return f"{off} ({undecided} undecided)" if undecided else str(off)


MTP = "mtp-"  # the MTP mutants' prefix: measured on the mtp fixture's paths
MTP_BENCH_PATHS = ("mtp-rejection", "mtp")
MTP_HEADERS = [
    "build", "path", "verdict (fixed, all N)", "samples to BROKEN (sequential rule, α=1e-3)",
    "fixed test first rejects at", "--sequential answers", "= stock", "drafted/accepted",
    "counts ≠ closed form", "finding",
]  # fmt: skip


def mtp_finding(r: Row) -> str:
    """What a row of the MTP table says: BROKEN after how many samples, or why it is not."""
    if r.verdict.startswith("LOUD"):
        return "LOUD: the server fails"
    if r.verdict == Verdict.BROKEN.value:
        return f"BROKEN after {r.eproc} samples (sequential), fixed test at {r.fixed}"
    off, _, undecided = r.counts_off.partition(" ")  # "N" or "N (K undecided)"
    counts = (
        f"; counts differ from the closed form on {off} samples"
        if off not in ("-", "0")
        else ("; counts are the closed form's" if off == "0" else "")
    )
    if undecided and off != "-":
        counts += f"; {undecided.strip('()')} (the closed form within rounding of a tie)"
    if r.same == "yes":
        return f"equivalent: every sample is stock's for its seed{counts}"
    if r.same == "no":
        return f"{r.verdict}: samples differ from stock's, distribution kept{counts}"
    return f"{r.verdict} (control){counts}"


def mtp_table(rows: list[Row]) -> str:
    return md_table(
        MTP_HEADERS,
        [
            [
                r.build,
                f"{r.path} T={r.temperature:g}",
                r.verdict,
                r.eproc,
                r.fixed,
                r.sequential,
                r.same,
                r.drafted,
                r.counts_off,
                mtp_finding(r),
            ]  # fmt: skip
            for r in rows
        ],
    )


def mtp_rows(
    bins: dict[str, LlamaBinaries],
    names: list[str],
    seeds: int,
    work: Path,
    kind: fixtures.FixtureKind = "mtp",
    tokens: int = distribution.DEFAULT_TOKENS,
) -> list[Row]:
    """Stock, spec-logprobs and each MTP mutant on an MTP fixture's MTP paths, T = 1 (`kind`
    "mtp", "mtp-context": the same glm4moe on the context fixture's attention, or
    "mtp-attention": the mtp fixture whose MTP layer attends over its own KV cache, which
    needs `tokens` > 4 to read a cell an accepted draft token left)."""
    fs = fixtures.build(work / f"{kind}-fixture", kind=kind)
    rows: list[Row] = []
    stock: dict[tuple[str, str, float], tuple[list[str], Row]] = {}
    for name in names:
        for path in MTP_BENCH_PATHS:
            d = work / "logs" / name / kind / path
            d.mkdir(parents=True, exist_ok=True)
            rows += measure_row(
                name, bins[name], kind, fs, path, (1.0,), seeds, d, stock, tokens=tokens
            )
    return rows


def _cell(r: Row) -> str:
    if r.verdict.startswith("LOUD"):
        return "LOUD"
    if r.verdict == Verdict.BROKEN.value:
        return f"B {r.eproc}/{r.fixed}"
    return r.verdict[0] + (" =" if r.same == "yes" else "")


def matrix(rows: list[Row]) -> str:
    """One line per build, one column per (fixture, path, T): B sequential/fixed samples to
    BROKEN, P PRESERVED (=: the very samples of stock), I INCONCLUSIVE, LOUD."""
    cols = list(dict.fromkeys((r.fixture, r.path, r.temperature) for r in rows))
    builds = list(dict.fromkeys(r.build for r in rows))
    got = {(r.build, r.fixture, r.path, r.temperature): _cell(r) for r in rows}
    heads = ["build", *(f"{f} {p} T={t:g}" for f, p, t in cols)]
    body = [[b, *(got.get((b, *c), "") for c in cols)] for b in builds]
    legend = (
        "B s/f: BROKEN, sequential-rule samples to BROKEN / fixed test first rejects at; P: "
        "PRESERVED (=: byte-identical to stock); LOUD: the server fails; empty: path not run"
    )
    return md_table(heads, body) + "\n\n" + legend


def goal_lines(rows: list[Row], controls: set[str], seeds: int) -> list[str]:
    """The goal: median sequential-rule samples to BROKEN <= 200 over the mutants on the
    probabilistic path, per fixture and temperature and over both fixtures. Twice: over every
    silent (not LOUD) mutant, and over the non-equivalent ones, whose samples differ from
    stock's for the same seeds (an equivalent mutant changes no sample: nothing to detect)."""

    def med(rs: list[Row]) -> str:
        ns = [int(r.eproc) if r.eproc.isdigit() else 10**9 for r in rs]
        if not ns:
            return "-"
        m = statistics.median_low(ns)
        return f">{seeds}" if m >= 10**9 else f"{m:g}"

    out = []
    fxs = list(dict.fromkeys(r.fixture for r in rows))
    for fx in [*fxs, None]:
        for t in (1.0, 0.7):
            prob = [
                r for r in rows
                if r.build not in controls and r.path == "probabilistic" and r.temperature == t
                and (fx is None or r.fixture == fx)
            ]  # fmt: skip
            if not prob:
                continue
            caught = [r for r in prob if r.verdict == "BROKEN" or r.verdict.startswith("LOUD")]
            silent = [r for r in prob if not r.verdict.startswith("LOUD")]
            differ = [r for r in silent if r.same == "no"]
            out.append(
                f"{fx or 'both fixtures'}, probabilistic, T={t:g}: {len(caught)}/{len(prob)} "
                f"caught (BROKEN or LOUD); median samples to BROKEN (sequential rule): "
                f"{med(silent)} over {len(silent)} silent, {med(differ)} over {len(differ)} "
                f"non-equivalent (goal <= 200)"
            )
    return out


LP = "lp-"  # the logprob mutants' prefix: measured by fidelity, not by dist
FIDELITY_SAMPLER = fixtures.SamplerSettings(top_k=5, top_p=1.0, min_p=0.0, temperature=0.7)
FIDELITY_PROMPT = "bcdbc"
FIDELITY_N_PROBS = 3
FIDELITY_TOKENS = 16
# the path a logprob mutant's bug lives on (the draft's q exists on the rejection path only)
FIDELITY_PATHS = {"lp-draft-probs": "rejection"}
FIDELITY_HEADERS = [
    "build", "path", "tokens", "real-correct", "real-wrong", "placeholder", "missing",
    "check says", "fidelity says", "largest deviation / bound", "where", "drafted/accepted",
]  # fmt: skip


def fidelity_row(
    name: str, bins: LlamaBinaries, fs: fixtures.FixtureSet, path: str, tol: fidelity.Tolerance,
    seeds: int, log_dir: Path,
) -> list[str]:  # fmt: skip
    """One build's fidelity row on the default fixture."""
    ref = fidelity.FixtureReference(fs.spec, FIDELITY_SAMPLER)
    with runner.spawn_server(bins, fs, path=path, log_dir=log_dir) as srv:
        run = fidelity_probe.probe_server(
            srv.url,
            prompt=FIDELITY_PROMPT,
            prompt_ids=fs.spec.tokenize(FIDELITY_PROMPT),
            reference=ref,
            tol=tol,
            sampling=FIDELITY_SAMPLER.request_fields(),
            seeds=range(1, seeds + 1),
            tokens=FIDELITY_TOKENS,
            n_probs=FIDELITY_N_PROBS,
            vocabulary=ref.vocabulary,
        )
    c, k = run.counts, run.check_counts
    check_says = f"{k.real} real, {k.placeholder} placeholder"
    says = [
        f"{n} {cls.value}" for cls in fidelity.Fidelity if cls is not fidelity.Fidelity.REAL_CORRECT
        if (n := c.of(cls))
    ] or ["all real-correct"]  # fmt: skip
    worst, where = "-", "-"
    scored = [t for p in run.probes for t in p.result.tokens if t.worst is not None]
    if scored:
        top = max(scored, key=lambda t: t.worst.score if t.worst else 0.0)
        assert top.worst is not None
        worst = f"{top.worst.error:.3g} / {top.worst.limit:.3g}"
        modes = sorted({t.mode for _, t in run.wrong()})
        where = f"{top.worst.where} ({top.mode}); wrong in: {', '.join(modes) or 'none'}"
    drafted, accepted = run.drafted
    row = [
        name, path, str(c.total), str(c.real_correct), str(c.real_wrong), str(c.placeholder),
        str(c.missing), check_says, ", ".join(says), worst, where, f"{drafted}/{accepted}",
    ]  # fmt: skip
    log(f"fidelity {name} {path}: {row[2:9]}")
    return row


def fidelity_table(
    bins: dict[str, LlamaBinaries], names: list[str], seeds: int, work: Path
) -> tuple[str, fidelity.NoiseFloor]:
    """Stock, spec-logprobs and each logprob mutant: a fidelity row each (the patched build on
    both paths it reports from, the controls for the greedy and the rejection mutants)."""
    fs = runner.load_fixture(None)
    spec = fs.spec
    ref = fidelity.FixtureReference(spec, FIDELITY_SAMPLER)
    with runner.spawn_server(bins["stock"], fs, path="plain", log_dir=work) as plain:
        floor = fidelity_probe.server_noise_floor(
            plain.url,
            [spec.tokenize(FIDELITY_PROMPT + x) for x in spec.letters],
            FIDELITY_SAMPLER.request_fields(),
            spec.n_vocab,
            extra=ref,
        )
    tol = fidelity.tolerance(floor)
    rows = []
    for name in names:
        paths = ["greedy", "rejection"] if name == "spec-logprobs" else None
        for path in paths or [FIDELITY_PATHS.get(name, "greedy")]:
            d = work / "fidelity" / name / path
            d.mkdir(parents=True, exist_ok=True)
            rows.append(fidelity_row(name, bins[name], fs, path, tol, seeds, d))
    return md_table(FIDELITY_HEADERS, rows), floor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=2000, help="samples per row (seeds 1..N)")
    ap.add_argument("--only", nargs="*", default=None, help="mutant names (default: all)")
    ap.add_argument(
        "--fidelity-seeds", type=int, default=20, help="seeds per logprob-mutant fidelity row"
    )
    ap.add_argument(
        "--fidelity-only", action="store_true", help="only the logprob mutants' fidelity rows"
    )
    ap.add_argument(
        "--mtp-only",
        action="store_true",
        help="only the MTP mutants' rows (mtp fixture, MTP paths) and their controls",
    )
    ap.add_argument(
        "--mtp-kind",
        choices=("mtp", "mtp-context", "mtp-attention"),
        default="mtp",
        help="the MTP fixture of the MTP rows (mtp-context: target and draft see the context; "
        "mtp-attention: the MTP layer attends over its own KV cache)",
    )
    ap.add_argument(
        "--mtp-tokens",
        type=int,
        default=distribution.DEFAULT_TOKENS,
        help="tokens per sample of the MTP rows (positions tested: the first 4)",
    )
    args = ap.parse_args()
    t_start = time.perf_counter()
    mutants = llama.available_mutants()
    if args.only:
        mutants = [m for m in mutants if m.split("/", 1)[1] in args.only]
    lp_mutants = [] if args.mtp_only else [
        m.split("/", 1)[1] for m in mutants if m.split("/", 1)[1].startswith(LP)
    ]  # fmt: skip
    mtp_mutants = [] if args.fidelity_only else [
        m.split("/", 1)[1] for m in mutants if m.split("/", 1)[1].startswith(MTP)
    ]  # fmt: skip
    dist_mutants = [] if args.fidelity_only or args.mtp_only else [
        m for m in mutants if not m.split("/", 1)[1].startswith((LP, MTP))
    ]  # fmt: skip
    builds: list[tuple[str, tuple[str, ...]]] = [("stock", ())]
    if args.mtp_only:
        builds += [(presets.PATCH, (presets.PATCH,))]
    else:
        builds += [(p, (p,)) for p in llama.available_patches()]
    builds += [(m.split("/", 1)[1], (m,)) for m in dist_mutants]
    builds += [(m, (f"mutants/{m}",)) for m in lp_mutants]
    builds += [(m, (f"mutants/{m}",)) for m in mtp_mutants]

    build_times: dict[str, str] = {}
    bins: dict[str, LlamaBinaries] = {}
    for name, patches in builds:
        t0 = time.perf_counter()
        values = resolve_all(patches)
        cached = llama.find(patches=values) is not None
        bins[name] = llama.ensure(patches=values)
        dt = time.perf_counter() - t0
        build_times[name] = "cached" if cached else f"built in {dt:.0f} s"
        log(f"{name}: {build_times[name]}")

    work = Path(tempfile.mkdtemp(prefix="bench-mutants-"))
    if lp_mutants:
        names = ["stock", presets.PATCH, *lp_mutants]
        table, floor = fidelity_table(bins, names, args.fidelity_seeds, work)
        print(table)
        print()
        print(
            f"fidelity: {args.fidelity_seeds} seeds x {FIDELITY_TOKENS} tokens x "
            f"{len(fidelity_probe.DEFAULT_KINDS)} probe kinds per row, top-k "
            f"{FIDELITY_SAMPLER.top_k}, T={FIDELITY_SAMPLER.temperature:g}, {FIDELITY_N_PROBS} "
            f"candidates; noise floor (plain server at batch sizes 1, 2, 4 and the closed form, "
            f"{floor.prefixes} prefixes): prob {floor.prob:.3g}, logprob {floor.logprob:.3g}; "
            f"tolerance {fidelity.SPREAD_FACTOR:g} x floor + {fidelity.FLOAT32_ULPS} float32 ulps"
        )
        print()
    if mtp_mutants:
        t_mtp = time.perf_counter()
        mrows = mtp_rows(
            bins,
            ["stock", presets.PATCH, *mtp_mutants],
            args.seeds,
            work,
            args.mtp_kind,
            args.mtp_tokens,
        )
        print(mtp_table(mrows))
        print()
        false = [
            r for r in mrows if r.build in ("stock", presets.PATCH) and r.verdict != "PRESERVED"
        ]
        print(
            f"{args.mtp_kind} fixture, seeds 1..{args.seeds} per row, {args.mtp_tokens} tokens "
            f"(positions 1-{min(args.mtp_tokens, 4)} tested), top-k 3, T=1; "
            "controls "
            f"(stock, {presets.PATCH}) not PRESERVED: "
            + (", ".join(f"{r.build} {r.path}: {r.verdict}" for r in false) or "none")
            + f"; {time.perf_counter() - t_mtp:.0f} s"
        )
        print()
    if args.fidelity_only or args.mtp_only:
        print("builds: " + "; ".join(f"{k} {v}" for k, v in build_times.items()))
        print(f"total {time.perf_counter() - t_start:.0f} s")
        return 0
    fxs = fixtures_available(work)
    rows: list[Row] = []
    stock: dict[tuple[str, str, float], tuple[list[str], Row]] = {}
    for name, patches in builds:
        if name.startswith((LP, MTP)):
            continue  # a fidelity row, or an MTP row, above
        control = name == "stock" or name in llama.available_patches()
        shared = control or any(
            SHARED in f for p in resolve_all(patches) for f in sources.patch_files(p)
        )
        for fx, fs in fxs:
            for path in PATHS:
                if path == "ngram-mod" and not shared:
                    continue
                temps = (1.0, 0.7) if path == "probabilistic" else (1.0,)
                d = work / "logs" / name / fx / path
                d.mkdir(parents=True, exist_ok=True)
                rows += measure_row(name, bins[name], fx, fs, path, temps, args.seeds, d, stock)

    print(md_table(HEADERS, [r.cells() for r in rows]))
    print()
    print(matrix(rows))
    print()
    # the goals: every mutant BROKEN on probabilistic, median e-process samples <= 200, and no
    # false alarm on the controls
    controls = {"stock", *llama.available_patches()}
    false = [r for r in rows if r.build in controls and r.verdict != Verdict.PRESERVED.value]
    n_control = sum(r.build in controls for r in rows)
    shown = ", ".join(
        f"{r.build} {r.fixture} {r.path} T={r.temperature:g}: {r.verdict}" for r in false
    )
    print(
        f"controls ({', '.join(sorted(controls))}): {n_control} rows, "
        f"not PRESERVED: {shown or 'none'}"
    )
    for line in goal_lines(rows, controls, args.seeds):
        print(line)
    print("builds: " + "; ".join(f"{k} {v}" for k, v in build_times.items()))
    print(f"total {time.perf_counter() - t_start:.0f} s; {args.seeds} samples per row")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
