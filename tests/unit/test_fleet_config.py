"""LiteLLM config parsing for `specaudit check --litellm-config` (no server): what a config
yields, and every bad file as one `error:` line with exit 2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from specaudit.check import CheckError, CheckResult, fleet

GOOD = """\
model_list:
  - model_name: fast
    litellm_params:
      model: openai/gemma
      api_base: http://127.0.0.1:8082/v1/
      api_key: os.environ/FLEET_KEY
  - model_name: fast
    litellm_params: {model: openai/gemma, api_base: "http://127.0.0.1:8080"}
  - model_name: hosted
    litellm_params: {model: gpt-4o-mini}
router_settings: {routing_strategy: simple-shuffle}
"""

CliFn = Callable[..., tuple[int, str, str]]


def test_reads_every_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_KEY", "sk-1")
    (tmp_path / "c.yaml").write_text(GOOD)
    deps = fleet.read_litellm_config(tmp_path / "c.yaml")
    assert [(d.name, d.url, d.model) for d in deps] == [
        ("fast", "http://127.0.0.1:8082", "gemma"),
        ("fast", "http://127.0.0.1:8080", "gemma"),
        ("hosted", None, None),
    ]
    assert deps[0].api_key == "sk-1" and "sk-1" not in repr(deps[0])
    assert deps[2].skip_reason and "api_base" in deps[2].skip_reason


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("model_list: [\n", "is not YAML"),
        ("general_settings: {}\n", "has no model_list"),
        ("model_list: [3]\n", "is not a mapping"),
        ("model_list: [{model_name: x}]\n", "needs model_name and litellm_params"),
        ("model_list: [{model_name: x, litellm_params: {api_base: 'ftp://h'}}]\n", "http(s) URL"),
    ],
)
def test_bad_configs_are_one_line_exit_2(
    tmp_path: Path, cli: CliFn, text: str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEET_KEY", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(CheckError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        fleet.read_litellm_config(cfg)
    code, out, err = cli("check", "--litellm-config", str(cfg))
    assert code == 2 and out == "" and err.startswith("error: ") and len(err.splitlines()) == 1
    assert needle in err


def test_unset_key_is_that_deployments_no_decision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEET_KEY", raising=False)
    (tmp_path / "c.yaml").write_text(GOOD)
    deps = fleet.read_litellm_config(tmp_path / "c.yaml")
    assert deps[0].url is None and deps[0].error and "FLEET_KEY, which is unset" in deps[0].error
    assert deps[1].url == "http://127.0.0.1:8080" and deps[2].skip_reason

    def never(*a: object, **k: object) -> CheckResult:
        raise AssertionError("a deployment without a URL is not checked")

    row = fleet._one(deps[0], {}, never)
    assert row.status == "no decision" and row.exit_code == 2 and "unset" in row.reason


def test_missing_file_and_no_url(tmp_path: Path, cli: CliFn) -> None:
    code, _, err = cli("check", "--litellm-config", str(tmp_path / "nope.yaml"))
    assert code == 2 and "does not exist" in err
    code, _, err = cli("check")
    assert code == 2 and "Missing argument 'URL'" in err


def test_server_root() -> None:
    assert fleet.server_root("http://h:1/v1/") == "http://h:1"
    assert fleet.server_root("http://h:1/llama") == "http://h:1/llama"
