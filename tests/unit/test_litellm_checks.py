"""The LiteLLM callback's pure parts (no server): which requests ask for logprobs, and the
token check on LiteLLM's own response objects (pydantic) and on plain dicts. The routing and
the checks in front of real llama-servers: tests/integration/test_litellm_*.py."""

from __future__ import annotations

import pytest
from litellm.types.utils import (
    ChatCompletionTokenLogprob,
    ChoiceLogprobs,
    Delta,
    ModelResponseStream,
    StreamingChoices,
    TopLogprob,
)

from specaudit.integrations import litellm as sa


@pytest.mark.parametrize(
    ("request_", "n"),
    [
        ({"messages": [], "logprobs": True, "top_logprobs": 3}, 3),
        ({"messages": [], "logprobs": True}, 20),  # llama-server's default top_logprobs
        ({"messages": [], "logprobs": False}, 0),
        ({"messages": []}, 0),
        ({"prompt": "x", "logprobs": 2}, 2),
        ({"prompt": "x", "logprobs": 0}, 0),
        ({"prompt": "x", "n_probs": 4}, 4),
        # chat without logprobs: true: llama-server computes none, but it still asks
        ({"messages": [], "top_logprobs": 2}, 0),
    ],
)
def test_requested(request_: dict, n: int) -> None:
    assert sa.requested(request_) == n
    assert sa.wants(request_) == (n > 0 or "top_logprobs" in request_)


def _entry(k: int) -> ChatCompletionTokenLogprob:
    tops = [TopLogprob(token="a", bytes=[97], logprob=-0.5) for _ in range(k)]
    return ChatCompletionTokenLogprob(token="a", bytes=[97], logprob=0.0, top_logprobs=tops)


def test_check_entries_nulls_placeholders_only() -> None:
    entries = [_entry(3), _entry(0), _entry(3), _entry(0)]
    assert sa.check_entries(entries, 3) == (4, 2)
    assert [e.logprob for e in entries] == [0.0, None, 0.0, None]  # 0.0 with candidates is real


def test_check_response_dicts_and_legacy() -> None:
    body = {
        "choices": [
            {"logprobs": {"content": [{"logprob": 0.0, "top_logprobs": []}]}},
            {
                "logprobs": {
                    "tokens": ["a", "b"],
                    "token_logprobs": [0.0, -1.0],
                    "top_logprobs": [{}, {"b": -1.0}],
                }
            },
            {"logprobs": None},
        ]
    }
    assert sa.check_response(body, 1) == (3, 2)
    assert body["choices"][0]["logprobs"]["content"][0]["logprob"] is None
    assert body["choices"][1]["logprobs"]["token_logprobs"] == [None, -1.0]


def test_check_chunk_adds_the_missing_entry() -> None:
    chunk = ModelResponseStream(choices=[StreamingChoices(delta=Delta(content="c"))])
    assert sa.check_chunk(chunk, 3) == (1, 1)
    lp = chunk.choices[0].logprobs
    assert lp.content[0].token == "c" and lp.content[0].logprob is None
    assert lp.content[0].top_logprobs == []
    assert '"logprob":null' in chunk.model_dump_json().replace(" ", "")
    real = ModelResponseStream(
        choices=[
            StreamingChoices(delta=Delta(content="a"), logprobs=ChoiceLogprobs(content=[_entry(3)]))
        ]
    )
    assert sa.check_chunk(real, 3) == (1, 0)
    empty = ModelResponseStream(choices=[StreamingChoices(delta=Delta(content=None))])
    assert sa.check_chunk(empty, 3) == (0, 0)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="on_plain_down"):
        sa.SpecauditRouting(on_plain_down="ignore")
    with pytest.raises(ValueError, match="> 0"):
        sa.SpecauditRouting(check_interval=0)


def test_server_root() -> None:
    assert sa.server_root("http://h:1/v1/") == "http://h:1"
