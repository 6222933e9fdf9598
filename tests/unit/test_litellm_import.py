"""The LiteLLM callback shares the proxy's routing rule and placeholder walker, and nothing else
of the proxy: loading it into LiteLLM (its SDK or its proxy server) starts no forwarding core,
no aiohttp server path, no llhttp. Each check runs in a fresh interpreter, since this test
process has loaded the proxy already."""

from __future__ import annotations

import json
import subprocess
import sys

# what the callback may load of the proxy package: its (lazy) __init__ and the two aiohttp-free
# modules it shares
SHARED = {"specaudit.proxy", "specaudit.proxy.routing", "specaudit.proxy.placeholders"}


def loaded_after(statement: str) -> set[str]:
    """The modules in `sys.modules` after `statement`, in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_litellm_callback_loads_only_the_routing_rule_and_walker_of_the_proxy() -> None:
    mods = loaded_after("import specaudit.integrations.litellm")
    assert "specaudit.integrations.litellm" in mods  # the import itself happened
    proxy = {m for m in mods if m == "specaudit.proxy" or m.startswith("specaudit.proxy.")}
    assert proxy == SHARED, f"the callback loaded more of the proxy: {sorted(proxy - SHARED)}"
    assert "httptools" not in mods  # the forwarding core's parser


def test_the_routing_rule_and_walker_import_without_aiohttp() -> None:
    """LiteLLM itself loads aiohttp; the proxy's shared modules must not need it."""
    mods = loaded_after("import specaudit.proxy.routing, specaudit.proxy.placeholders")
    assert not {m for m in mods if m == "aiohttp" or m.startswith("aiohttp.")}
    assert {m for m in mods if m.startswith("specaudit.proxy")} == SHARED
