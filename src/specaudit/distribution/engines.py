"""Engines: what produces samples. A llama-server (or compatible) URL, and llama.cpp's
`llama-speculative` example run once per seed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from pathlib import Path
from typing import Any, Protocol

from specaudit import fixtures, speculation
from specaudit.client import AsyncClient, Client, ClientError
from specaudit.distribution import logflush
from specaudit.distribution.results import DistError, Sample, Workload
from specaudit.distribution.truth import encode_ids, encode_text
from specaudit.errors import SpecauditError

# The closed form models this chain (fixtures.SamplerSettings); sent explicitly so a server's
# own defaults (penalties, DRY, XTC, another order) cannot change what is sampled.
SAMPLER_CHAIN = ("top_k", "top_p", "min_p", "temperature")
# Requests in flight at most (--concurrency): also caps what a server's /slots may ask for.
MAX_CONCURRENCY = 1024


class Engine(Protocol):
    label: str
    kind: str
    concurrency: int

    async def sample(self, seed: int) -> Sample: ...

    async def aclose(self) -> None: ...


class ServerEngine:
    """A llama-server (or compatible) URL, sampled on native /completion, requests concurrent
    over its slots."""

    def __init__(
        self,
        url: str,
        spec: fixtures.FixtureSpec,
        workload: Workload,
        *,
        label: str | None = None,
        kind: str = "url",
        concurrency: int | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.spec = spec
        self.workload = workload
        self.label = label or f"url {self.url}"
        self.kind = kind
        self.concurrency = concurrency or min(
            2 * _slot_count(self.url, min(timeout, 10.0)), MAX_CONCURRENCY
        )
        self._client = AsyncClient(self.url, timeout=timeout, max_connections=self.concurrency)
        s = workload.sampler
        self._body: dict[str, Any] = {
            "prompt": workload.prompt,
            "n_predict": workload.tokens,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "min_p": s.min_p,
            "samplers": list(SAMPLER_CHAIN),
            "dynatemp_range": 0.0,
            "mirostat": 0,
            "n_probs": 0,
            # the generated ids: a special token (BOS/UNK render as nothing in `content`) or EOS
            # is then seen where it was sampled, not as a shorter text
            "return_tokens": True,
        }

    def body(self, seed: int) -> dict[str, Any]:
        """The native /completion request for one seed: every sampler knob explicit."""
        return {**self._body, "seed": seed}

    async def sample(self, seed: int) -> Sample:
        r = await self._client.post("/completion", self.body(seed))
        text = r.get("content")
        if not isinstance(text, str):
            raise DistError(f"{self.label}: /completion answered without a 'content' string")
        text = self.outcomes(text, r.get("tokens"))
        tm_raw = r.get("timings")
        tm: dict[str, Any] = tm_raw if isinstance(tm_raw, dict) else {}
        dn, da = tm.get("draft_n"), tm.get("draft_n_accepted")
        return Sample(
            seed,
            text,
            dn if isinstance(dn, int) else None,
            da if isinstance(da, int) else None,
        )

    def outcomes(self, content: str, ids: Any) -> str:
        """The sample's outcomes (`truth.encode_text`): from the generated token ids when the
        server returned them (`return_tokens`), else from `content`. A short or non-letter
        output is kept, as outcomes of probability 0: the analysis calls it BROKEN."""
        if (
            isinstance(ids, list)
            and ids
            and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            return encode_ids(ids, self.workload.tokens, self.spec)
        return encode_text(content, self.workload.tokens, self.spec)

    async def aclose(self) -> None:
        await self._client.aclose()


def _slot_count(url: str, timeout: float = 10.0) -> int:
    """Parallel slots of a server (from /slots, else /props), 1 if it does not say."""
    try:
        with Client(url, timeout=timeout) as c:
            return speculation.read(c).parallel
    except ClientError as e:
        raise DistError(str(e)) from None


class ExampleEngine:
    """llama.cpp's `llama-speculative` example, one process per seed, processes in parallel.

    The example prints its text and statistics through llama.cpp's asynchronous logger and
    never flushes it, so a process can exit before any of it is printed (most runs on a busy
    machine). Each run therefore has the logger drained at exit by `dist.logflush` (the
    example's code unchanged): its output is then complete, or the run is an error that says
    why. Nothing is repeated.
    """

    def __init__(
        self,
        binary: Path,
        target: Path,
        draft: Path,
        spec: fixtures.FixtureSpec,
        workload: Workload,
        *,
        jobs: int | None = None,
        label: str = "llama-speculative",
    ) -> None:
        self.label = label
        if not Path(binary).is_file():
            raise DistError(f"{label}: binary not found: {binary}")
        self.binary = Path(binary)
        self.target = Path(target)
        self.draft = Path(draft)
        self.spec = spec
        self.workload = workload
        self.kind = "speculative-example"
        self.concurrency = jobs or os.cpu_count() or 1
        try:
            self._env = logflush.environ()
        except SpecauditError as e:
            raise DistError(f"{label}: cannot read its output completely: {e}") from None

    def argv(self, seed: int) -> list[str]:
        s = self.workload.sampler
        return [
            str(self.binary),
            "-m", str(self.target),
            "-md", str(self.draft),
            "-p", self.workload.prompt,
            "-n", str(self.workload.tokens),
            "--samplers", ";".join(SAMPLER_CHAIN),
            "--top-k", str(s.top_k),
            "--top-p", repr(float(s.top_p)),
            "--min-p", repr(float(s.min_p)),
            "--temp", repr(float(s.temperature)),
            "--seed", str(seed),
            "-t", "1",  # one thread per process: the model is tiny and processes run in parallel
        ]  # fmt: skip

    async def sample(self, seed: int) -> Sample:
        proc = await asyncio.create_subprocess_exec(
            *self.argv(seed),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self._env,
        )
        try:
            out_b, err_b = await proc.communicate()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        out = out_b.decode("utf-8", "replace")
        err = err_b.decode("utf-8", "replace")
        if proc.returncode != 0:
            tail = [ln for ln in err.splitlines() if ln.strip() and logflush.PREFIX not in ln]
            raise DistError(
                f"{self.label} (seed {seed}) exited with code {proc.returncode}: "
                f"{tail[-1].strip() if tail else 'no output'}"
            )
        # complete: a shorter text or one with special tokens (printed as </s>, <s>, <unk>) is
        # what it generated
        try:
            text, drafted, accepted = read_example_output(out, err, self.workload.prompt)
        except DistError as e:
            raise DistError(f"{self.label} (seed {seed}): {e}") from None
        return Sample(seed, encode_text(text, self.workload.tokens, self.spec), drafted, accepted)

    async def aclose(self) -> None:
        return None


_STAT_RE = re.compile(r"\bn_(drafted|accept)\s*=\s*(\d+)")


def parse_example_output(stdout: str, stderr: str, prompt: str) -> tuple[str, int, int] | None:
    """(generated text, drafted, accepted) from one llama-speculative run; None if its output
    is not the example's complete output.

    stdout is ``\\n\\n`` + prompt + generated + ``\\n\\n`` + ``\\n\\n``, the statistics
    (``n_drafted``, ``n_accept``) are on stderr.
    """
    found = dict((k, int(v)) for k, v in _STAT_RE.findall(stderr))
    if "drafted" not in found or "accept" not in found:
        return None
    if len(stdout) - len(stdout.rstrip("\n")) < 4:
        return None
    body = stdout.strip("\n")
    if not body.startswith(prompt):
        return None
    return body[len(prompt) :], found["drafted"], found["accept"]


def read_example_output(stdout: str, stderr: str, prompt: str) -> tuple[str, int, int]:
    """(generated text, drafted, accepted) of a run whose logger was drained at exit
    (`logflush.MARKER` on stderr); a one-line `DistError` saying what is missing otherwise.

    With the logger drained everything the example logged was printed, so a missing piece is
    never a lost tail to retry: it is an example that printed something else.
    """
    why = logflush.problem(stderr)
    if why is not None:
        raise DistError(why)
    parsed = parse_example_output(stdout, stderr, prompt)
    if parsed is None:
        shown = " ".join(stdout.split())[:60]
        raise DistError(
            f"its complete output lacks the prompt {prompt!r} + generated text on stdout or the "
            f"n_drafted / n_accept statistics on stderr (stdout: {shown!r})"
        )
    return parsed


def engine_error(label: str, error: BaseException) -> DistError:
    """`error` as one line that names the engine: '<label>: <why>' (said once)."""
    msg = " ".join(str(error).split()) or type(error).__name__
    if msg.startswith(label):
        return DistError(msg)
    return DistError(f"{label}: {msg}")


__all__ = [
    "SAMPLER_CHAIN",
    "Engine",
    "ExampleEngine",
    "ServerEngine",
    "engine_error",
    "parse_example_output",
    "read_example_output",
]
