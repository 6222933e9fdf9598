"""`specaudit dist`: does an engine that speculates still sample from the target distribution?

Speculative decoding is meant to be invisible: the tokens must follow the target model's
distribution exactly. This package samples many seeds from an engine running a fixture model
(see `specaudit.fixtures`) and compares what came out with the distribution the fixture's
*definition* implies -- computed in closed form, never taken from the engine under test.

What is tested, for each engine:
- every tested position t, conditionally on the tokens generated before it (contexts with the
  same true next-token distribution are pooled; they are interchangeable under the null);
- the joint distribution of the first few positions;
- a score test in the direction of the draft's distribution (the usual leak), each pool's
  full history (is the token independent of which pooled prefix came before?), and
  independence across consecutive seeds;
- one verdict at a stated alpha: BROKEN if a Holm-corrected test rejects (or a token with true
  probability zero shows up), PRESERVED if nothing rejects and the data rule out a next-token
  TV distance above the tolerance at every position, INCONCLUSIVE otherwise.
- `sequential=True` instead stops as soon as the evidence is decisive, using an anytime-valid
  e-process (BROKEN) and alpha-spending TV bounds (PRESERVED), and reports the samples used.

Engines: llama-servers we spawn, one per verification path (`server`: no draft, greedy draft,
probabilistic draft / rejection sampling, ngram-mod and the other n-gram types, MTP (the
target's MTP layer drafts, on the MTP fixture), EAGLE3 (the fixture's EAGLE3 head drafts) and
replay (a draft on a Mamba target: the checkpoint replay path, on the replay fixture);
`coverage`), any llama-server-compatible URL (`url`), any OpenAI-compatible /v1/completions
server (`openai`, `dist.openai`; several URLs make a fleet), Hugging Face transformers'
`generate()` with each candidate generator (`transformers`, `dist.hf`), OpenVINO GenAI's
speculative pipeline on CPU (`openvino`, `dist.openvino`), and llama.cpp's `llama-speculative`
example program run once per seed (`speculative-example`). See docs/dist.md and
docs/engines.md.

Modules: `results` (workload, samples, result records, defaults, `DistError`), `truth` (the
closed-form ground truth), the fixed-sample analysis by concern: `counting` (samples counted
as `OutcomeCounts`, the tables the tests read), `bounds` (certified TV bounds), `direction`
(the score test toward the draft), `dependence` (full history, independence across seeds),
`wording` (the verdict in words) and `analysis` (the tests run in order, Holm, the verdict);
`sequential` (early stopping), `engines` (what produces samples), `logflush`
(llama-speculative's output read with llama.cpp's logger drained at exit), `driver` (sampling
an engine, `measure`), `request` (`DistRequest`: every input checked once, by
`make_request`), `registry` (engine name -> what it needs, its own options, how it is built
from a request; built-in engines and plug-ins register through one hook), `llamacpp`
(llama.cpp's engines: server, speculative-example, url; `spawn_server`), `openai`, `hf`,
`openvino` (those engines), `inprocess` (the life cycle of an engine run in-process: truth
check, then sampling), `runner` (`run`: each engine built and measured), `coverage` (the
verification paths run and not covered), `render` (tables, Markdown, the plot). The audit's
section is `specaudit.audit.sections.dist`.
"""

from specaudit.distribution import hf, llamacpp, registry
from specaudit.distribution.analysis import analyse
from specaudit.distribution.counting import OutcomeCounts
from specaudit.distribution.coverage import (
    NOT_COVERED,
    PATH_ENGINES,
    PATH_HEADERS,
    PATH_HELP,
    check_paths,
    not_covered_lines,
    path_rows,
    paths_markdown,
    rejected,
)
from specaudit.distribution.driver import collect, measure, measure_async
from specaudit.distribution.engines import (
    SAMPLER_CHAIN,
    Engine,
    ExampleEngine,
    ServerEngine,
    engine_error,
    parse_example_output,
    read_example_output,
)
from specaudit.distribution.openai import FleetEngine, OpenAIEngine, fixture_model
from specaudit.distribution.render import (
    CONTEXT_HEADERS,
    SUMMARY_HEADERS,
    TEST_HEADERS,
    context_rows,
    detail_lines,
    draft_cell,
    evidence_cell,
    plot_results,
    summary_rows,
    test_rows,
    to_markdown,
    tokens_cell,
)
from specaudit.distribution.results import (
    DEFAULT_ALPHA,
    DEFAULT_TOKENS,
    DEFAULT_TOLERANCE,
    ContextResult,
    DistError,
    DistResult,
    EngineResult,
    ProgressFn,
    Sample,
    SequentialResult,
    TestResult,
    TokenRow,
    Workload,
)
from specaudit.distribution.runner import (
    DEFAULT_TIMEOUT,
    MAX_CONCURRENCY,
    MAX_JOBS,
    MAX_JOINT,
    MAX_PARALLEL,
    MIN_TOKENS,
    PATHS,
    DistRequest,
    load_fixture,
    make_request,
    make_workload,
    run,
    spawn_server,
)
from specaudit.distribution.sequential import SEQUENTIAL_FIRST_LOOK, Sequential, replay_sequential
from specaudit.distribution.truth import Truth

__all__ = [
    "CONTEXT_HEADERS",
    "DEFAULT_ALPHA",
    "DEFAULT_TIMEOUT",
    "DEFAULT_TOKENS",
    "DEFAULT_TOLERANCE",
    "MAX_CONCURRENCY",
    "MAX_JOBS",
    "MAX_JOINT",
    "MAX_PARALLEL",
    "MIN_TOKENS",
    "NOT_COVERED",
    "PATHS",
    "PATH_ENGINES",
    "PATH_HEADERS",
    "PATH_HELP",
    "SAMPLER_CHAIN",
    "SEQUENTIAL_FIRST_LOOK",
    "SUMMARY_HEADERS",
    "TEST_HEADERS",
    "ContextResult",
    "DistError",
    "DistResult",
    "DistRequest",
    "Engine",
    "EngineResult",
    "ExampleEngine",
    "FleetEngine",
    "OpenAIEngine",
    "OutcomeCounts",
    "ProgressFn",
    "Sample",
    "Sequential",
    "SequentialResult",
    "ServerEngine",
    "TestResult",
    "TokenRow",
    "Truth",
    "Workload",
    "analyse",
    "check_paths",
    "collect",
    "context_rows",
    "detail_lines",
    "draft_cell",
    "engine_error",
    "evidence_cell",
    "fixture_model",
    "hf",
    "llamacpp",
    "load_fixture",
    "make_request",
    "make_workload",
    "measure",
    "measure_async",
    "not_covered_lines",
    "parse_example_output",
    "path_rows",
    "paths_markdown",
    "plot_results",
    "read_example_output",
    "registry",
    "rejected",
    "replay_sequential",
    "run",
    "spawn_server",
    "summary_rows",
    "test_rows",
    "to_markdown",
    "tokens_cell",
]
