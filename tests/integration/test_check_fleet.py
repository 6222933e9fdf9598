"""`specaudit check URL URL ...` and `--litellm-config FILE` against real llama-servers: the
session's plain and speculating fixture servers, a port nobody listens on, and a LiteLLM
config.yaml of the kind LiteLLM's proxy loads (tests/integration/test_litellm_proxy.py starts
LiteLLM on the same file)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specaudit.llama.server import free_port

CliFn = Callable[..., tuple[int, str, str]]
FAST = ("--prompt", "bcdbc", "--tokens", "8", "--endpoint", "completion")


def litellm_config(path: Path, deployments: list[tuple[str, str | None]]) -> Path:
    """A LiteLLM proxy config: each (model_name, api_base) an openai/ deployment; the key is
    read from the environment the way LiteLLM users write it."""
    lines = ["model_list:"]
    for name, base in deployments:
        lines += [f"  - model_name: {name}", "    litellm_params:"]
        if base is None:
            lines += ["      model: gpt-4o-mini"]
        else:
            lines += [
                "      model: openai/fixture",
                f"      api_base: {base}/v1",
                "      api_key: os.environ/SPECAUDIT_TEST_FLEET_KEY",
            ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_two_urls_one_table(server: Callable[..., Any], cli: CliFn) -> None:
    plain, spec = server("fixture-plain").url, server("fixture-spec").url
    code, out, err = cli("check", plain, spec, *FAST, "--json")
    assert code == 1, err[-2000:]
    body = json.loads(out)
    rows = {d["url"]: d for d in body["deployments"]}
    assert set(rows) == {plain, spec}
    p, s = rows[plain], rows[spec]
    assert p["speculates"] == "no" and p["slots"] == "0/4" and p["placeholders"] == 0
    assert p["exit_code"] == 0 and p["real"] > 0
    assert s["speculates"] == "yes" and s["hidden"] and s["slots"] == "4/4"
    assert s["props_types"] == "none" and s["placeholders"] > 0 and s["exit_code"] == 1
    assert body["outcome"] == "finding" and body["exit_code"] == 1


def test_plain_fleet_is_ok(server: Callable[..., Any], cli: CliFn) -> None:
    plain = server("fixture-plain").url
    code, out, err = cli("check", plain, plain + "/", *FAST, "--stream")
    assert code == 0, err[-2000:]
    assert "check: 1 deployments" in out  # the same server listed twice is checked once
    assert "verdict: ok" in out


def test_litellm_config(
    server: Callable[..., Any], cli: CliFn, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv("SPECAUDIT_TEST_FLEET_KEY", "sk-fleet-test")
    plain, spec = server("fixture-plain").url, server("fixture-spec").url
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = litellm_config(
        tmp_path / "config.yaml",
        [("fx", plain), ("fx", spec), ("fx", dead), ("hosted", None)],
    )
    code, out, err = cli("check", "--litellm-config", str(cfg), *FAST, "--concurrency", "2")
    assert code == 1, err[-2000:]
    assert err == ""
    assert "check: 4 deployments" in out and "skipped" in out and "no decision" in out
    assert "sk-fleet-test" not in out
    code, out, _ = cli("check", "--litellm-config", str(cfg), *FAST, "--json")
    body = json.loads(out)
    by_url = {d["url"]: d for d in body["deployments"]}
    assert by_url[plain]["exit_code"] == 0 and by_url[spec]["exit_code"] == 1
    assert by_url[dead]["status"] == "no decision" and by_url[dead]["exit_code"] == 2
    assert by_url[None]["status"] == "skipped" and by_url[None]["name"] == "hosted"
    assert "sk-fleet-test" not in out
    # without the speculating one: the dead server leaves no decision (exit 2)
    cfg2 = litellm_config(tmp_path / "c2.yaml", [("fx", plain), ("fx", dead)])
    code, out, _ = cli("check", "--litellm-config", str(cfg2), *FAST)
    assert code == 2 and "gave no decision" in out
