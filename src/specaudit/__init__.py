"""specaudit: trust what a speculating LLM server returns.

Detect placeholder logprobs, measure their effect on aggregates, prove whether speculation
preserves the sampling distribution, route around the fault and fix it.
"""

__version__ = "0.1.0"
