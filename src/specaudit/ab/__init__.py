"""`specaudit ab`: what placeholder logprobs do to aggregates, speculative vs plain, over seeds.

Why: the field report's most damaging number was an aggregate. With a draft model, the mean
logprob of a 64-token sample at temperature 1 read -0.0011 against -0.48 without one, and it
looked like a finding about the model. It was the instrument: every token after the first
came back as a placeholder (logprob 0.0, no candidates). This package runs the report's habit
as a measurement: sample the same prompt and seeds from a plain and a speculating server, and
compute for each response

- the **naive** mean logprob (what a client that trusts the numbers computes: placeholders
  count as 0.0, `logprobs.Missing.NAIVE`),
- the mean over **real** tokens only (`Missing.SKIP`),
- coverage (real tokens / tokens) and the placeholder count, and
- the server's own ``timings.draft_n`` / ``draft_n_accepted``.

Then it compares the sides over seeds with paired t statistics (scipy.stats) and words a
verdict (`ABVerdict`; the rules are in `specaudit.ab.analysis` and docs/ab.md).

Modules: `analysis` (settings, records, statistics, verdict: pure), `sampling` (`run` against
two URLs, `run_local` starting both servers), `render` (tables, lines, Markdown, the plot).
The audit's section lives in `specaudit.audit.sections.ab`.
"""

from specaudit.ab.analysis import (
    AB_ENDPOINTS,
    AGREE_TOLERANCE,
    ALPHA,
    CONFIDENCE,
    DEFAULT_PROMPT,
    DEFAULT_SEEDS,
    DEFAULT_TOKENS,
    DEFAULT_TOP_LOGPROBS,
    FAULT_MAX_COVERAGE,
    FAULT_MAX_RATIO,
    MAX_SEEDS,
    SCHEMA_VERSION,
    SIDES,
    ABError,
    ABResult,
    ABVerdict,
    Delta,
    Response,
    Settings,
    SideSummary,
    VerdictInfo,
    analyse,
    decide,
    fmt,
    paired,
    parse_response,
    summarize,
    t_interval,
)
from specaudit.ab.render import (
    DETAIL_HEADERS,
    delta_line,
    detail_rows,
    draw,
    markdown,
    report_shape_headers,
    report_shape_rows,
    side_line,
)
from specaudit.ab.sampling import (
    DEFAULT_SPEC_TYPE,
    PROBE_TIMEOUT,
    ProgressFn,
    run,
    run_local,
    uses_draft,
)

__all__ = [
    "AB_ENDPOINTS",
    "AGREE_TOLERANCE",
    "ALPHA",
    "CONFIDENCE",
    "DEFAULT_PROMPT",
    "DEFAULT_SEEDS",
    "DEFAULT_SPEC_TYPE",
    "DEFAULT_TOKENS",
    "DEFAULT_TOP_LOGPROBS",
    "DETAIL_HEADERS",
    "FAULT_MAX_COVERAGE",
    "FAULT_MAX_RATIO",
    "MAX_SEEDS",
    "PROBE_TIMEOUT",
    "SCHEMA_VERSION",
    "SIDES",
    "ABError",
    "ABResult",
    "ABVerdict",
    "Delta",
    "ProgressFn",
    "Response",
    "Settings",
    "SideSummary",
    "VerdictInfo",
    "analyse",
    "decide",
    "delta_line",
    "detail_rows",
    "draw",
    "fmt",
    "markdown",
    "paired",
    "parse_response",
    "report_shape_headers",
    "report_shape_rows",
    "run",
    "run_local",
    "side_line",
    "summarize",
    "t_interval",
    "uses_draft",
]
