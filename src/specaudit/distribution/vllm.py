"""The vLLM engine: vLLM's OpenAI server (its CPU build, from `specaudit.vllm`'s env) started
by `dist` on the fixture, one server per speculative method, each always stopped.

Life cycle (`build`), in this order:
- the fixture is exported as Hugging Face folders (`fixtures.hf.export_hf`: vLLM has no GGUF
  loader for it), at head size `MIN_HEAD_SIZE` when the fixture's is smaller (vLLM's CPU
  attention takes head sizes 32 to 512; the last-token fixture's 8 is widened with zeros, and
  the export proves its logits bitwise equal to the GGUF's and its probabilities the closed
  form's before anything else runs);
- per method (`METHODS`): a `VllmServer` on the exported target, whose own probabilities are
  compared with the closed form before any seed is sampled (`measure_truth`: vLLM's raw
  logprobs of every token on the prompt and each one-letter continuation; beyond
  `TRUTH_TOLERANCE` it is a DistError, not a verdict); then the seeds; then the server stops.

Sampler: vLLM applies temperature, then min-p, then top-k and top-p; llama.cpp's chain (the
closed form) applies top-k, top-p, min-p, then temperature. They give the same distribution
when temperature is 1 and min-p and top-p are not both on, or when top-p is 1 and min-p 0
(top-k commutes with a positive temperature, min-p with top-k). `check_sampler` refuses
everything else in one line, as the transformers and OpenVINO engines do.

Samples: one ``/v1/completions`` per seed, the prompt as token ids, the generated ids read
from ``return_token_ids`` (no detokenisation in between). Requests go one at a time: vLLM
reports speculation only as process-wide counters on ``/metrics``, so a request's drafted and
accepted counts are the deltas of ``vllm:spec_decode_num_draft_tokens_total`` and
``vllm:spec_decode_num_accepted_tokens_total`` across it.

A server that fails to start, or dies while sampled, is one DistError line naming the method
and the setting (exit 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from specaudit import fixtures, speculation
from specaudit import validate as checks
from specaudit.distribution.inprocess import TruthCheck, one_line
from specaudit.distribution.registry import EngineEntry, EngineOption, Register, RunContext, Unit
from specaudit.distribution.request import DistRequest
from specaudit.distribution.results import DistError, EngineResult, Sample, Workload
from specaudit.distribution.truth import encode_ids
from specaudit.errors import SpecauditError
from specaudit.llama.process import last_error, log_tail
from specaudit.speculation import VLLM_ACCEPTED, VLLM_DRAFTED, prometheus_counters
from specaudit.vllm.fidelity import MODES as LOGPROBS_MODES  # vLLM's default first
from specaudit.vllm.fixes import resolve as resolve_fixes
from specaudit.vllm.request import completions_body

if TYPE_CHECKING:  # the export needs transformers, an extra: imported where it is used
    from specaudit.fixtures.hf import HfExport

METHODS = ("plain", "ngram", "draft_model", "suffix", "eagle", "eagle3", "mtp", "dflash", "medusa")
# the methods that load a folder built beside the target (`head`, `fixtures.hf_heads.HEADS`)
HEAD_METHODS = ("eagle", "eagle3", "dflash", "medusa")
DEFAULT_METHODS = ("plain", "ngram")
SPECULATIVE_TOKENS = 3  # num_speculative_tokens of every speculating method
METHOD_HELP = {
    "plain": "no speculation",
    "ngram": f"ngram, num_speculative_tokens={SPECULATIVE_TOKENS}, prompt_lookup 1-3 (n-grams "
    "of the context, no draft model)",
    "draft_model": f"draft_model on the fixture's draft, num_speculative_tokens="
    f"{SPECULATIVE_TOKENS}",
    "suffix": f"suffix (suffix trees of the context), num_speculative_tokens={SPECULATIVE_TOKENS}",
    "eagle": "eagle, an EAGLE-1 head built on the target (fixtures.hf_heads.export_eagle_head: it "
    f"drafts the target's favourite after the token it is fed), num_speculative_tokens="
    f"{SPECULATIVE_TOKENS}",
    "eagle3": "eagle3, an EAGLE3 head built on the target (fixtures.hf_heads."
    "export_eagle3_head: aux states of target layers 0 and 1, its own lm_head over a draft "
    "vocabulary of the letters; it drafts the target's favourite two tokens after the "
    "position it is handed), "
    f"num_speculative_tokens={SPECULATIVE_TOKENS}",
    "mtp": "mtp, the target exported as a MiMo (Qwen2) whose main model is the llama and whose "
    "one MTP layer drafts the target's favourite after the token it is fed "
    f"(fixtures.hf_heads.export_mtp_target), num_speculative_tokens={SPECULATIVE_TOKENS}",
    "dflash": "dflash, a DFlash draft built on the target (fixtures.hf_heads."
    "export_dflash_head: each masked slot of the block drafts the target's favourite after "
    "the block's first token), "
    f"num_speculative_tokens={SPECULATIVE_TOKENS}",
    "medusa": "medusa, Medusa heads built on the target (fixtures.hf_heads.export_medusa_head: "
    "head k drafts the target's favourite k + 2 tokens after the position it is handed), "
    f"num_speculative_tokens={SPECULATIVE_TOKENS}",
}
NOT_RUNNABLE = (
    (
        "vllm mlp_speculator",
        "vLLM 0.32's v1 engine has no proposer for it: its config accepts the method, its model "
        "runner raises 'Unknown speculative decoding method' (v1/worker/gpu_model_runner.py, "
        "which the CPU runner inherits)",
    ),
)
# seconds a server may take to get healthy: a ceiling, not a wait (2-6.5 min measured here
# with other work running, load 14-21; the server's own default is 300)
STARTUP_TIMEOUT = 900.0
MIN_HEAD_SIZE = 32  # vLLM's CPU attention: head sizes 32 to 512
TRUTH_TOLERANCE = 1e-5  # max |vLLM's probability - closed form| before sampling
DRAFTED = VLLM_DRAFTED
ACCEPTED = VLLM_ACCEPTED
ORDER = "temperature, then min-p, then top-k and top-p"
# requests in flight on a server that does not speculate (nothing to count per request; vLLM
# batches them, each with its own seeded generator)
PLAIN_CONCURRENCY = 4


# ------------------------------------------------------------------------ the sampler


def differs(s: fixtures.SamplerSettings) -> str | None:
    """Why vLLM's order samples `s` differently from the closed form; None when it does not."""
    if s.temperature <= 0:
        return "--engine vllm samples: --temperature must be > 0"
    if s.min_p > 0 and s.top_p < 1:
        return "min-p before top-p renormalises what top-p sums: use --min-p 0 or --top-p 1"
    if s.temperature != 1 and (s.top_p < 1 or s.min_p > 0):
        return "at --temperature != 1 use --top-p 1 --min-p 0"
    return None


def check_sampler(s: fixtures.SamplerSettings) -> None:
    """Refuse, in one line, the settings where vLLM's order differs from the closed form."""
    why = differs(s)
    if why is None:
        return
    if s.temperature <= 0:
        raise DistError(why)
    raise DistError(f"--engine vllm applies {ORDER} (llama.cpp: temperature last): {why}")


def vllm_order(p: np.ndarray, s: fixtures.SamplerSettings) -> np.ndarray:
    """What vLLM samples from given the model's probabilities `p`: temperature, min-p, top-k,
    top-p (vllm/v1/sample/sampler.py and ops/topk_topp_sampler.py), each renormalising."""
    with np.errstate(divide="ignore"):
        z = np.log(np.asarray(p, dtype=np.float64)) / s.temperature
    q = np.exp(z - z.max())
    q /= q.sum()
    if s.min_p > 0:
        q = np.where(q < s.min_p * q.max(), 0.0, q)
        q /= q.sum()
    order = np.argsort(-q, kind="stable")
    if s.top_k > 0:
        q[order[s.top_k :]] = 0.0
        q /= q.sum()
    if s.top_p < 1:
        kept = q[order]
        before = np.cumsum(kept) - kept  # mass of the more likely tokens
        q[order[before >= s.top_p]] = 0.0
        q /= q.sum()
    return q


# ------------------------------------------------------------------------ the server


def speculative_config(
    method: str, draft: Path, head_dir: Path | None = None
) -> dict[str, Any] | None:
    """vLLM's ``--speculative-config`` of `method` (`METHODS`); None for plain. `head_dir`:
    the folder a `HEAD_METHODS` method loads (`head`)."""
    n = SPECULATIVE_TOKENS
    if method == "plain":
        return None
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": n,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    if method == "draft_model":
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": n}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": n}
    if method in HEAD_METHODS:
        if head_dir is None:
            raise DistError(
                f"vllm {method} needs a head folder (fixtures.hf_heads.export_{method}_head)"
            )
        return {"method": method, "model": str(head_dir), "num_speculative_tokens": n}
    if method == "mtp":  # the MTP layers are the served target's own
        return {"method": "mtp", "num_speculative_tokens": n}
    raise DistError(f"unknown vllm method {method!r} (one of {', '.join(METHODS)})")


def setting(label: str, s: fixtures.SamplerSettings) -> str:
    """An engine's label (vLLM, its version, the method) and sampler setting, as an error
    names them."""
    return (
        f"{label} (temperature {s.temperature:g}, top-k {s.top_k}, top-p {s.top_p:g}, "
        f"min-p {s.min_p:g})"
    )


def counters(text: str, names: Sequence[str] = (DRAFTED, ACCEPTED)) -> dict[str, float]:
    """The sum over labels of each counter in `names` in Prometheus text; absent ones left
    out (a plain server has no speculation counters)."""
    return prometheus_counters(text, names)


# ------------------------------------------------------------------------ the sampler


class VllmEngine:
    """One running vLLM server of one method, sampled one seed at a time when it speculates
    (the /metrics deltas around a request are that request's), `PLAIN_CONCURRENCY` at a time
    when it does not."""

    def __init__(
        self,
        url: str,
        model: str,
        spec: fixtures.FixtureSpec,
        workload: Workload,
        method: str,
        *,
        family: str,
        speculative: bool | None = None,
        alive: Callable[[], bool] | None = None,
        log: Path | None = None,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.spec = spec
        self.workload = workload
        self.method = method
        self.label = f"{family} {method}"
        self.kind = f"vllm-{method}"
        # whether /metrics is read around each request: a server specaudit started knows its
        # method; one at a URL is read anyway (a plain vLLM has no speculation counters)
        self.speculative = method != "plain" if speculative is None else speculative
        self.concurrency = 1 if self.speculative else PLAIN_CONCURRENCY
        self.where = setting(self.label, workload.sampler)
        self._alive = alive  # is the server still running?
        self._log = log  # the server's log: a failure names it and its last error
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout, transport=transport)
        self._lock = asyncio.Lock()
        self._last: dict[str, float] | None = None
        # no ignore_eos: dist samples the fixture as a user would, end tokens included
        self._body = completions_body(
            workload.sampler, tokens=workload.tokens, ignore_eos=False, model=model,
            prompt_ids=spec.tokenize(workload.prompt),
        )  # fmt: skip

    def body(self, seed: int) -> dict[str, Any]:
        return {**self._body, "seed": seed}

    def _failed(self, what: str) -> DistError:
        dead = self._alive is not None and not self._alive()
        why = f"{'the server died: ' if dead else ''}{what}"
        if self._log is not None:
            why += f" (log {self._log}: {root_cause(self._log)})"
        return DistError(f"{self.where}: {why}")

    async def _counters(self) -> dict[str, float]:
        try:
            r = await self._http.get("/metrics")
        except httpx.HTTPError as e:
            raise self._failed(f"/metrics: {type(e).__name__}: {one_line(e, 200)}") from None
        if r.status_code != 200:
            raise self._failed(f"/metrics answered {r.status_code}")
        return counters(r.text)

    async def _post(self, seed: int) -> httpx.Response:
        try:
            r = await self._http.post("/v1/completions", json=self.body(seed))
        except httpx.HTTPError as e:
            raise self._failed(f"seed {seed}: {type(e).__name__}: {one_line(e, 200)}") from None
        if r.status_code != 200:
            raise self._failed(f"seed {seed}: HTTP {r.status_code}: {one_line_text(r.text)}")
        return r

    async def sample(self, seed: int) -> Sample:
        if self.speculative:  # one at a time: the /metrics growth around it is its own
            async with self._lock:
                if self._last is None:
                    self._last = await self._counters()
                r = await self._post(seed)
                now = await self._counters()
                before, self._last = self._last, now
        else:  # nothing counted: requests overlap, and vLLM batches them
            r = await self._post(seed)
            before = now = {}
        choices = r.json().get("choices")
        ids = choices[0].get("token_ids") if isinstance(choices, list) and choices else None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise self._failed(f"seed {seed}: the answer has no choices[0].token_ids")
        drafted = accepted = None
        if DRAFTED in now:
            drafted = round(now[DRAFTED] - before.get(DRAFTED, 0.0))
            accepted = round(now.get(ACCEPTED, 0.0) - before.get(ACCEPTED, 0.0))
        return Sample(seed, encode_ids(ids, self.workload.tokens, self.spec), drafted, accepted)

    async def aclose(self) -> None:
        await self._http.aclose()


_RAISED = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception)): (.*)")


def root_cause(log: Path) -> str:
    """The exception that stopped vLLM, from its log: the last ``SomethingError: why`` line that
    is not the API server's EngineDeadError (which only says to look above); else the log's
    last error line."""
    tail = log_tail(log, lines=400)
    found = ""
    for line in tail.splitlines():
        m = _RAISED.search(line)
        if m and "EngineDeadError" not in m.group(1) and "Worker failed" not in m.group(2):
            found = f"{m.group(1)}: {m.group(2).strip()}"
    return one_line_text(found or last_error(tail), 300)


def one_line_text(text: str, limit: int = 200) -> str:
    return " ".join(text.split())[:limit]


def truth_contexts(spec: fixtures.FixtureSpec, workload: Workload) -> list[str]:
    """The generated prefixes the truth check asks about: none, and each letter."""
    return ["", *spec.letters]


def measure_truth(
    url: str,
    model: str,
    spec: fixtures.FixtureSpec,
    workload: Workload,
    method: str,
    *,
    engine: str | None = None,
) -> TruthCheck:
    """The server's own next-token probabilities (raw logprobs of all `spec.n_vocab` tokens,
    one token generated at temperature 1) after the prompt and each one-letter continuation,
    against the closed form; and `vllm_order` on them against the closed form's sampler.
    `engine` names the server in an error (default: this env's vLLM build)."""
    max_raw = max_processed = 0.0
    ctxs = truth_contexts(spec, workload)
    with httpx.Client(base_url=url, timeout=60.0) as c:
        for prefix in ctxs:
            text = workload.prompt + prefix
            body = {
                "model": model,
                "prompt": spec.tokenize(text),
                "max_tokens": 1,
                "temperature": 1.0,
                "seed": 0,
                "logprobs": spec.n_vocab,
                "return_tokens_as_token_ids": True,
            }
            r = c.post("/v1/completions", json=body)
            if r.status_code != 200:
                label = f"{engine or family()} {method}"
                raise DistError(
                    f"{setting(label, workload.sampler)}: the truth check's request answered "
                    f"{r.status_code}: {one_line_text(r.text)}"
                    + (" (serve it with --max-logprobs -1)" if "logprobs" in r.text else "")
                )
            top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
            got = np.zeros(spec.n_vocab)
            for tok, lp in top.items():
                i = int(tok.removeprefix("token_id:"))
                if 0 <= i < spec.n_vocab:
                    got[i] = math.exp(lp)
            want = np.array(list(fixtures.raw_distribution(spec, text).values()))
            cond = fixtures.next_token_distribution(spec, text, workload.sampler)
            max_raw = max(max_raw, float(np.abs(got - want).max()))
            proc = vllm_order(got, workload.sampler)
            max_processed = max(
                max_processed, float(np.abs(proc - np.array(list(cond.values()))).max())
            )
    return TruthCheck(
        f"vLLM {method}", "next-token probabilities", "the closed form", len(ctxs), "contexts",
        max_raw, max_processed, "in vLLM's sampler order", TRUTH_TOLERANCE,
    )  # fmt: skip


FIDELITY_SEEDS = range(1, 17)  # the logprobs probe's requests (x the workload's tokens)
FIDELITY_N = 5  # candidates per token (a speculating vLLM 0.32 dies above the vocabulary)


def logprobs_fidelity(
    url: str,
    model: str,
    spec: fixtures.FixtureSpec,
    workload: Workload,
    label: str,
    mode: str | None,
) -> str:
    """The server's logprobs under the workload, classified against the closed form
    (`specaudit.vllm.fidelity`): a line for the notes. `mode` is the server's
    ``--logprobs-mode`` when dist started it; for a server at a URL (None) both readings are
    tried and the one the numbers agree with is named. "Correct" allows the truth check's
    tolerance: the one the server was admitted with."""
    from specaudit import fidelity as fid
    from specaudit.vllm import fidelity as fv

    ref = fid.FixtureReference(spec, workload.sampler)
    letters = {i for i, t in enumerate(spec.tokens) if t in set(spec.letters)}
    half = TRUTH_TOLERANCE / fid.SPREAD_FACTOR
    tol = fid.tolerance(fid.NoiseFloor(half, half, answers=2, prefixes=len(FIDELITY_SEEDS)))
    try:
        res = fv.probe(
            url, model, spec.tokenize(workload.prompt), ref, tol, workload.sampler,
            FIDELITY_SEEDS, tokens=workload.tokens, n=min(FIDELITY_N, spec.n_vocab),
            modes=(mode,) if mode else fv.MODES, answerable=letters.__contains__,
        )  # fmt: skip
    except fid.FidelityError as e:
        raise DistError(f"{setting(label, workload.sampler)}: logprobs: {e}") from None
    best = fv.best_mode(res)
    line = best.line(label)
    if mode is None and best.counts.total:
        line += " (the server's --logprobs-mode cannot be asked: the reading that agrees)"
    return line


def family() -> str:
    from specaudit.vllm.env import VERSION

    return f"vLLM {VERSION} (CPU)"


def row(result: EngineResult) -> tuple[str, str]:
    """The audit's engines table: (vLLM and its version, the method)."""
    return family(), result.kind.removeprefix("vllm-")


# ------------------------------------------------------------------------ registration


def check(req: DistRequest) -> None:
    """Called once by `make_request`: settings vLLM samples like the closed form, known
    methods, well-formed ``--vllm-url NAME=URL`` values named apart from the started methods."""
    check_sampler(req.workload.sampler)
    plan(req)


def check_methods(methods: Sequence[str]) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(methods))
    for m in out:
        if m not in METHODS:
            raise DistError(f"unknown vllm method {m!r} (one of {', '.join(METHODS)})")
    return out


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")


def parse_url(value: str) -> tuple[str, str]:
    """``NAME=URL`` of ``--vllm-url`` as (name, URL without a trailing slash)."""
    name, sep, url = value.partition("=")
    if not sep or not _NAME.fullmatch(name):
        raise DistError(
            f"--vllm-url {value!r}: expected NAME=URL, NAME a label such as ngram (letters, "
            "digits, '_', '.', '-')"
        )
    checks.url(url, "--vllm-url", DistError)
    return name, url.rstrip("/")


def logprobs_mode(req: DistRequest) -> str:
    """The --logprobs-mode of the servers dist starts (one; vLLM's default when not given)."""
    given = tuple(dict.fromkeys(req.option("vllm_logprobs_mode") or ()))
    if len(given) > 1:
        raise DistError(f"--vllm-logprobs-mode given {len(given)} ways: one mode per run")
    return given[0] if given else LOGPROBS_MODES[0]


def plan(req: DistRequest) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(methods to start, (name, URL) of running servers to sample). Without --vllm-url the
    default methods are started; with it only the --vllm-method ones."""
    urls = tuple(parse_url(v) for v in req.option("vllm_urls") or ())
    given = req.option("vllm_methods")
    methods = check_methods(given or (() if urls else DEFAULT_METHODS))
    if req.option("vllm_fixes") and not methods:
        raise DistError("--vllm-fix applies to the servers dist starts (--vllm-method)")
    if req.option("vllm_logprobs_mode") and not methods:
        raise DistError(
            "--vllm-logprobs-mode applies to the servers dist starts (--vllm-method); a server "
            "at --vllm-url is read both ways"
        )
    logprobs_mode(req)
    names = [*methods, *(n for n, _ in urls)]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DistError(
            f"--vllm-url names {', '.join(dup)} twice (or as a --vllm-method too): each engine's "
            "results are named by it"
        )
    return methods, urls


@contextlib.contextmanager
def exported(req: DistRequest) -> Iterator[Any]:
    """The request's fixture exported for vLLM (`fixtures.hf`), proven, removed afterwards."""
    from specaudit.fixtures import hf

    head = max(MIN_HEAD_SIZE, req.fixture.spec.config.head_dim)
    parent = req.work_dir
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="vllm-export-", dir=parent))
    try:
        yield hf.export_hf(req.fixture, root, head_size=head)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def head(method: str, ex: HfExport) -> Path | None:
    """The folder a `HEAD_METHODS` method loads beside the target
    (`fixtures.hf_heads.HEADS`), built into the export `ex`; None for the others."""
    if method not in HEAD_METHODS:
        return None
    from specaudit.fixtures import hf_heads

    return hf_heads.HEADS[method](ex)


def target(method: str, ex: HfExport) -> Path:
    """The folder the server of `method` serves: the exported llama, or for mtp the same
    target exported with an MTP layer (`fixtures.hf_heads.export_mtp_target`)."""
    if method != "mtp":
        return ex.target
    from specaudit.fixtures import hf_heads

    return hf_heads.HEADS["mtp"](ex)


def server_args(spec: fixtures.FixtureSpec) -> Mapping[str, Any]:
    """What every `VllmServer` of the engine is started with: logprobs of the whole
    vocabulary (the truth check), the fixture's context, no torch.compile warm-up."""
    return {
        "max_logprobs": max(20, spec.n_vocab),
        "max_model_len": min(spec.config.context_length, 1024),
        "eager": True,
        "startup_timeout": STARTUP_TIMEOUT,
    }


def build(req: DistRequest, ctx: RunContext) -> Generator[Unit, None, None]:
    methods, urls = plan(req)
    ctx.not_covered.extend(NOT_RUNNABLE)
    if methods:
        yield from _started(req, ctx, methods)
    for name, url in urls:
        yield _at_url(req, ctx, name, url)


def _started(
    req: DistRequest, ctx: RunContext, methods: Sequence[str]
) -> Generator[Unit, None, None]:
    """One server per method, started on the exported fixture, measured, always stopped."""
    from specaudit.vllm.env import ensure_env
    from specaudit.vllm.server import VllmServer

    spec, wl = req.fixture.spec, req.workload
    fixes = resolve_fixes(req.option("vllm_fixes") or ())
    fam = family() + "".join(f" + {f.name} fix" for f in fixes)
    lp_mode = logprobs_mode(req)
    env = ensure_env()
    with exported(req) as ex:
        logits = "bitwise equal to" if ex.bitwise else f"within {ex.logits_max_diff:.1e} of"
        ctx.notes.append(
            f"vLLM runs the fixture exported at head size {ex.head_size} (its own "
            f"{ex.source_head_size}): logits {logits} the GGUF's on {ex.prefixes} contexts, "
            f"probabilities within {ex.max_abs_diff:.1e} of the closed form (transformers)"
        )
        for method in methods:
            name = f"{method}-fixed" if fixes else method
            where = setting(f"{fam} {method}", wl.sampler)
            log = (req.work_dir / f"vllm-{name}.log") if req.work_dir else None
            served = target(method, ex)
            if served != ex.target:
                from specaudit.fixtures.hf import WIDEN_TOLERANCE

                same = "bitwise equal to" if ex.bitwise else f"within {WIDEN_TOLERANCE:g} of"
                ctx.notes.append(
                    f"vLLM {method} serves the target exported with an MTP layer ({served.name}/, "
                    f"fixtures.hf_heads.export_mtp_target): logits {same} the llama export's on "
                    f"{ex.prefixes} contexts (transformers)"
                )
            srv = VllmServer(
                env, served, speculative=speculative_config(method, ex.draft, head(method, ex)),
                log_path=log, fixes=fixes, logprobs_mode=lp_mode, **server_args(spec),
            )  # fmt: skip
            try:
                srv.start()
            except SpecauditError as e:
                srv.stop(keep_log=True)
                raise DistError(f"{where}: {one_line(e)}") from None
            try:
                model = str(served)
                truth = measure_truth(srv.url, model, spec, wl, name, engine=fam)
                ctx.notes.append(truth.require().line())
                ctx.notes.append(
                    logprobs_fidelity(srv.url, model, spec, wl, f"{fam} {name}", lp_mode)
                )
                eng = VllmEngine(
                    srv.url, model, spec, wl, name, family=fam, alive=srv.alive,
                    log=srv.log_path, timeout=req.timeout, speculative=method != "plain",
                )  # fmt: skip
                yield Unit(eng)
            except httpx.HTTPError as e:
                # e.g. the logprobs probe's first request killed the engine: name vLLM's own
                # exception from the log, which stays
                dead = "" if srv.alive() else "the server died: "
                cause = f" (log {srv.log_path}: {root_cause(srv.log_path)})" if srv.log_path else ""
                srv.stop(keep_log=True)
                raise DistError(
                    f"{where}: {dead}{type(e).__name__}: {one_line(e)}{cause}"
                ) from None
            except GeneratorExit:  # closed early: measuring failed, or the run stopped
                srv.stop(keep_log=True)  # a failure names the log: it stays
                raise
            finally:
                srv.stop(keep_log=not srv.alive())


def served(url: str, timeout: float = 30.0) -> tuple[str, str]:
    """(the model a running vLLM server serves, its vLLM version) from ``/v1/models`` and
    ``/version``; a one-line DistError when it is not a vLLM server serving one model."""
    try:
        with httpx.Client(base_url=url, timeout=timeout) as c:
            models = c.get("/v1/models")
            version = c.get("/version")
    except httpx.HTTPError as e:
        raise DistError(f"--vllm-url {url}: {type(e).__name__}: {one_line(e, 200)}") from None
    data = models.json().get("data") if models.status_code == 200 else None
    ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    if len(ids) != 1 or not isinstance(ids[0], str):
        raise DistError(
            f"--vllm-url {url}: /v1/models answered {models.status_code} with "
            f"{len(ids)} models (one expected: the fixture's target)"
        )
    v = version.json().get("version") if version.status_code == 200 else None
    if not isinstance(v, str):
        raise DistError(f"--vllm-url {url}: no /version: not a vLLM server")
    return ids[0], v


def _at_url(req: DistRequest, ctx: RunContext, name: str, url: str) -> Unit:
    """A vLLM server the user runs (``--vllm-url NAME=URL``: the fixture exported by
    ``specaudit fixtures export DIR --format hf`` served with ``--max-logprobs`` at least the
    fixture's vocabulary and ``--generation-config vllm``), proven to serve the closed form
    before it is sampled; whether it speculates is read from its /metrics."""
    spec, wl = req.fixture.spec, req.workload
    model, version = served(url)
    label = f"vLLM {version} at {url}"
    try:
        truth = measure_truth(url, model, spec, wl, name, engine=label)
    except httpx.HTTPError as e:
        where = setting(f"{label} {name}", wl.sampler)
        raise DistError(f"{where}: {type(e).__name__}: {one_line(e)}") from None
    ctx.notes.append(truth.require().line())
    try:
        ctx.notes.append(logprobs_fidelity(url, model, spec, wl, f"{label} {name}", None))
    except httpx.HTTPError as e:
        where = setting(f"{label} {name}", wl.sampler)
        raise DistError(f"{where}: logprobs: {type(e).__name__}: {one_line(e)}") from None
    eng = VllmEngine(
        url, model, spec, wl, name, family=label, speculative=speculates(url) is not False,
        timeout=req.timeout,
    )  # fmt: skip
    return Unit(eng)


def speculates(url: str, timeout: float = 30.0) -> bool | None:
    """Whether the vLLM server at `url` speculates, from its /metrics (`speculation`); None
    when /metrics cannot be read."""
    try:
        r = httpx.get(f"{url}/metrics", timeout=timeout)
    except httpx.HTTPError:
        return None
    return speculation.parse_metrics(r.text).speculates if r.status_code == 200 else None


VLLM = EngineEntry(
    "vllm",
    build,
    help="vLLM's OpenAI server (CPU build, its own env: python -m specaudit.vllm install) "
    "started on the fixture exported as Hugging Face folders (--vllm-method; needs "
    "specaudit[transformers] for the export)",
    extra="transformers",
    options=(
        EngineOption(
            "--vllm-url",
            "vllm_urls",
            (),
            "NAME=URL of a vLLM server you run, repeatable: sampled instead of starting servers "
            "(add --vllm-method to start some too). It must serve the fixture exported by "
            "`specaudit fixtures export DIR --format hf` (the target folder; any speculative "
            "config, any hardware) with --max-logprobs -1 and --generation-config vllm; its "
            "probabilities are checked against the closed form before sampling, its drafts "
            "read from /metrics. NAME labels its results (vllm-NAME).",
        ),
        EngineOption(
            "--vllm-fix",
            "vllm_fixes",
            ("cpu-sampler",),
            "Start the --vllm-method servers with specaudit's fix of a vLLM bug (loaded into "
            "every process of the server; the env is not changed), repeatable; results are "
            "named vllm-METHOD-fixed. cpu-sampler: the CPU rejection sampler's per-draft-token "
            "temperature, top-k and top-p read from uninitialised memory, and its top-k crash "
            "(docs/upstream/vllm-cpu-expand-kernel.md).",
        ),
        EngineOption(
            "--vllm-logprobs-mode",
            "vllm_logprobs_mode",
            LOGPROBS_MODES,
            "The --logprobs-mode of the --vllm-method servers [default: raw_logprobs, vLLM's]: "
            "raw_logprobs (before temperature, top-k, top-p) or processed_logprobs (after). "
            "Every vLLM engine's logprobs are classified against the closed form before "
            "sampling (real-correct, real-wrong, placeholder, missing), in the notes.",
        ),
        EngineOption(
            "--vllm-method",
            "vllm_methods",
            METHODS,
            "Speculative method(s) of --engine vllm, one server each, repeatable [default: "
            f"{' and '.join(DEFAULT_METHODS)}]: "
            + "; ".join(f"{m}: {h}" for m, h in METHOD_HELP.items())
            + ".",
        ),
    ),
    check=check,
    row=row,
)


def register_engines(register: Register) -> None:
    """The registry's hook (`dist.registry.BUILTIN`)."""
    register(VLLM)


__all__ = [
    "ACCEPTED",
    "DEFAULT_METHODS",
    "DRAFTED",
    "FIDELITY_N",
    "FIDELITY_SEEDS",
    "HEAD_METHODS",
    "LOGPROBS_MODES",
    "METHODS",
    "METHOD_HELP",
    "MIN_HEAD_SIZE",
    "NOT_RUNNABLE",
    "TRUTH_TOLERANCE",
    "VLLM",
    "VllmEngine",
    "check",
    "check_sampler",
    "counters",
    "differs",
    "logprobs_fidelity",
    "logprobs_mode",
    "measure_truth",
    "register_engines",
    "speculative_config",
    "vllm_order",
]
