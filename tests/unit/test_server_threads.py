"""Servers specaudit starts beside others share the cores: each gets its share as -t, never
llama-server's default (every core), at which two servers on 2 cores spun against each other."""

from __future__ import annotations

from pathlib import Path

import pytest

from specaudit.llama import LlamaBinaries, presets
from specaudit.reference import reference_server
from specaudit.rescore import request
from specaudit.rescore.runner import servers_at_work


def test_the_cores_are_split_among_the_servers_at_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(presets, "cores", lambda: 2)
    assert [presets.shared_threads(n) for n in (0, 1, 2, 3)] == [2, 2, 1, 1]
    monkeypatch.setattr(presets, "cores", lambda: 8)
    assert [presets.shared_threads(n) for n in (1, 2, 3)] == [8, 4, 2]


def test_a_reference_server_gets_its_threads_on_the_command_line(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    bins = LlamaBinaries(tmp_path / "bin", None, "external")
    argv = reference_server(model, threads=1, binaries=bins).argv()
    assert argv[argv.index("-t") + 1] == "1"
    assert "-t" not in reference_server(model, binaries=bins).argv()


def test_a_local_engine_counts_among_the_servers_at_work(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    local = request.make_request("http://127.0.0.1:8080", reference_model=model)
    assert servers_at_work(local) == 2  # the engine and the reference rescore starts
    both = request.make_request("http://localhost:1", reference_model=model, draft_model=model)
    assert servers_at_work(both) == 3
    remote = request.make_request("http://10.1.2.3:8080", reference_url="http://127.0.0.1:9")
    assert servers_at_work(remote) == 0
