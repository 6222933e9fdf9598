"""`specaudit check URL URL ...` / `--litellm-config FILE`: which deployments of a fleet return
placeholder logprobs?

Why: people who serve many llama-server instances already run a router (most often LiteLLM)
and need to know, per deployment, whether it speculates and whether its logprobs are real.
Each deployment gets the full single-server `specaudit.check.run`, concurrently (bounded: the
deployments may share cores), and the results fold into one `FleetResult`: FINDING when any
deployment returned placeholders, else NO_DECISION when any could not be decided, else OK.

A LiteLLM config lists deployments under ``model_list``; each one's
``litellm_params.api_base`` (and ``api_key``, both possibly ``os.environ/NAME``) is what is
checked. A deployment without ``api_base`` (a hosted provider) cannot be probed: it is listed
as ``skipped`` with the reason, never counted as checked; one whose values name an unset
environment variable is that deployment's "no decision" (exit 2), not the whole file's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specaudit import validate
from specaudit.check import probes
from specaudit.client import ClientError
from specaudit.errors import SpecauditError
from specaudit.outcome import Outcome

DEFAULT_CONCURRENCY = 4
MAX_CONCURRENCY = 64
ENV_PREFIX = "os.environ/"  # LiteLLM's way of naming a secret in config.yaml


@dataclass(frozen=True)
class Deployment:
    """One server to check: a name for people, its base URL, and how to reach it."""

    name: str
    url: str | None  # server root (an ``api_base`` without its ``/v1``); None: cannot probe
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None  # the "model" field to send (LiteLLM's model without provider/)
    skip_reason: str | None = None  # not a server specaudit can probe (hosted): not counted
    error: str | None = None  # a self-hosted one that cannot be reached as configured


@dataclass
class DeploymentCheck:
    """One row of the fleet table."""

    name: str
    url: str | None
    status: str  # "checked", "no decision", "skipped"
    speculates: str  # "yes", "no", "unknown"
    speculation: str  # one line: /slots vs /props
    slots: str | None  # "4/4" speculative slots, or None
    props_types: str | None
    hidden: bool
    placeholders: int | None
    real: int | None
    outcome: Outcome | None  # None when skipped
    exit_code: int | None
    reason: str
    placeholders_by_endpoint: dict[str, int] = field(default_factory=dict)


@dataclass
class FleetResult:
    deployments: list[DeploymentCheck]
    outcome: Outcome
    reason: str
    exit_code: int = field(init=False)

    def __post_init__(self) -> None:
        self.exit_code = self.outcome.exit_code


# ---------------------------------------------------------------------------------------------
# LiteLLM config


def _resolve(value: Any, what: str) -> str | None:
    """A config value, with LiteLLM's ``os.environ/NAME`` read from the environment."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise probes.CheckError(f"{what} must be a string, got {type(value).__name__}")
    if value.startswith(ENV_PREFIX):
        name = value[len(ENV_PREFIX) :]
        resolved = os.environ.get(name)
        if resolved is None:
            raise probes.CheckError(f"{what} names the environment variable {name}, which is unset")
        return resolved
    return value


def server_root(api_base: str) -> str:
    """llama-server's root from an OpenAI ``api_base`` (``http://h:8080/v1`` -> ``http://h:8080``)."""
    base = api_base.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def read_litellm_config(path: Path) -> list[Deployment]:
    """Every deployment of a LiteLLM ``config.yaml`` (``model_list``), in file order."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise probes.CheckError(f"cannot read the LiteLLM config {path}: {e}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise probes.CheckError(f"{path} is not YAML: {first}") from None
    models = doc.get("model_list") if isinstance(doc, dict) else None
    if not isinstance(models, list) or not models:
        raise probes.CheckError(f"{path} has no model_list: not a LiteLLM proxy config")
    return [_deployment(entry, f"{path}: model_list[{i}]") for i, entry in enumerate(models)]


def _deployment(entry: object, where: str) -> Deployment:
    """One ``model_list`` entry. A malformed entry stops the whole read (`CheckError`); one
    that only cannot be reached from here becomes a skipped or failed deployment."""
    if not isinstance(entry, dict):
        raise probes.CheckError(f"{where} is not a mapping")
    name = entry.get("model_name")
    params = entry.get("litellm_params")
    if not isinstance(name, str) or not isinstance(params, dict):
        raise probes.CheckError(f"{where} needs model_name and litellm_params")
    if params.get("api_base") is None:
        return Deployment(name, None, skip_reason="no api_base: not a self-hosted server")
    try:
        model = _resolve(params.get("model"), f"{where}.litellm_params.model")
        api_base = _resolve(params.get("api_base"), f"{where}.litellm_params.api_base")
        api_key = _resolve(params.get("api_key"), f"{where}.litellm_params.api_key")
    except probes.CheckError as e:  # e.g. an os.environ/NAME that is unset here
        return Deployment(name, None, error=str(e))
    short = model.split("/", 1)[1] if model and "/" in model else model
    if not api_base:
        return Deployment(name, None, error=f"{where}.litellm_params.api_base is empty")
    url = validate.url(server_root(api_base), f"{where}.litellm_params.api_base", probes.CheckError)
    if api_key is not None:
        validate.token(api_key, f"{where}.litellm_params.api_key", probes.CheckError)
    return Deployment(name, url, api_key, short)


# ---------------------------------------------------------------------------------------------
# checks


CheckFn = Callable[..., probes.CheckResult]


def _one(dep: Deployment, kwargs: dict[str, Any], check_fn: CheckFn) -> DeploymentCheck:
    if dep.url is None and dep.error is not None:
        return DeploymentCheck(
            dep.name, None, "no decision", "unknown", "", None, None, False, None, None,
            Outcome.NO_DECISION, Outcome.NO_DECISION.exit_code, dep.error,
        )  # fmt: skip
    if dep.url is None:
        return DeploymentCheck(
            dep.name, None, "skipped", "unknown", dep.skip_reason or "", None, None, False,
            None, None, None, None, dep.skip_reason or "not checked",
        )  # fmt: skip
    try:
        r = check_fn(dep.url, api_key=dep.api_key, model=kwargs.get("model") or dep.model,
                     **{k: v for k, v in kwargs.items() if k != "model"})  # fmt: skip
    except (SpecauditError, ClientError) as e:
        return DeploymentCheck(
            dep.name, dep.url, "no decision", "unknown", "", None, None, False, None, None,
            Outcome.NO_DECISION, Outcome.NO_DECISION.exit_code, str(e).splitlines()[0],
        )  # fmt: skip
    sp = r.speculation
    slots = f"{sp.slots_speculative}/{sp.slots_total}" if sp.slots_total is not None else None
    return DeploymentCheck(
        dep.name, dep.url, "checked", sp.state, sp.summary, slots, sp.props_types, sp.hidden,
        r.placeholders, r.real, r.outcome, r.exit_code, r.reason, r.placeholders_by_endpoint(),
    )  # fmt: skip


def _dedupe(deployments: Sequence[Deployment]) -> list[Deployment]:
    """One check per server: names that share a URL (and key) are joined."""
    merged: dict[tuple[str | None, str | None, str | None], Deployment] = {}
    for i, d in enumerate(deployments):
        key = (d.url, d.api_key, d.model) if d.url else (None, None, str(i))
        if key in merged:
            old = merged[key]
            merged[key] = Deployment(f"{old.name}, {d.name}", old.url, old.api_key, old.model)
        else:
            merged[key] = d
    return list(merged.values())


def run(
    deployments: Sequence[Deployment | str],
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    check_fn: CheckFn = probes.run,
    **check_kwargs: Any,
) -> FleetResult:
    """Check every deployment (URLs or `Deployment`s) with `specaudit.check.run`, at most
    `concurrency` at a time. `check_kwargs` go to each check (top_k, tokens, endpoint, prompt,
    seed, temperature, stream, model, timeout, probe_switch)."""
    validate.integer(
        concurrency, "--concurrency", min=1, max=MAX_CONCURRENCY, error=probes.CheckError
    )
    deps = _dedupe([Deployment(d, d) if isinstance(d, str) else d for d in deployments])
    if not deps:
        raise probes.CheckError("no deployment to check")
    for d in deps:
        if d.url is not None:
            validate.url(d.url, d.name, probes.CheckError)
    with ThreadPoolExecutor(max_workers=min(concurrency, len(deps))) as pool:
        rows = list(pool.map(lambda d: _one(d, check_kwargs, check_fn), deps))
    checked = [r for r in rows if r.outcome is not None]
    if not checked:
        raise probes.CheckError("no deployment could be checked: " + rows[0].reason)
    findings = [r for r in checked if r.outcome is Outcome.FINDING]
    undecided = [r for r in checked if r.outcome is Outcome.NO_DECISION]
    skipped = [r for r in rows if r.outcome is None]
    if findings:
        outcome = Outcome.FINDING
        reason = f"{len(findings)} of {len(rows)} deployments return placeholders: " + ", ".join(
            f"{r.name} ({r.placeholders})" for r in findings
        )
    elif undecided:
        outcome = Outcome.NO_DECISION
        reason = f"{len(undecided)} of {len(rows)} deployments gave no decision: " + ", ".join(
            r.name for r in undecided
        )
    else:
        outcome = Outcome.OK
        reason = f"every logprob is real on all {len(checked)} checked deployments"
    if findings and undecided:
        reason += "; no decision on: " + ", ".join(r.name for r in undecided)
    if skipped:
        reason += "; skipped: " + ", ".join(r.name for r in skipped)
    return FleetResult(rows, outcome, reason)


__all__ = [
    "DEFAULT_CONCURRENCY",
    "Deployment",
    "DeploymentCheck",
    "FleetResult",
    "read_litellm_config",
    "run",
    "server_root",
]
