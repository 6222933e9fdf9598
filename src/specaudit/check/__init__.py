"""`specaudit check`: are a running server's logprobs real, and does it speculate?

By concern: `probes` (every endpoint probed, tokens classified, /slots vs /props, the
per-request switch probe, `run`: the command's API, re-exported here), `rows` (the table rows
the terminal and the audit report share), `fleet` (many deployments at once), `fidelity_probe`
(asking a server for its logprobs and classifying them by `specaudit.fidelity`'s rules, which
`dist` shares for vLLM), `with_reference` (`check --reference`).

Light on purpose: importing the package loads `probes` only (no numpy), so `check --help` stays
fast; the fidelity modules load when a reference is given.
"""

from specaudit.check.probes import (
    DEFAULT_PROMPT,
    ENDPOINT_GROUPS,
    PROBE_KINDS,
    PROBE_LABELS,
    CheckError,
    CheckResult,
    CheckSettings,
    EndpointResult,
    Speculation,
    SwitchProbe,
    probe,
    read_speculation,
    request_body,
    run,
    switch_probe,
)

__all__ = [
    "DEFAULT_PROMPT",
    "ENDPOINT_GROUPS",
    "PROBE_KINDS",
    "PROBE_LABELS",
    "CheckError",
    "CheckResult",
    "CheckSettings",
    "EndpointResult",
    "Speculation",
    "SwitchProbe",
    "probe",
    "read_speculation",
    "request_body",
    "run",
    "switch_probe",
]
