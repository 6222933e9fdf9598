"""The copy of llama.cpp's own server tests that `specaudit.llama.upstream` runs: upstream's
files from the sdist plus the test file each bundled patch carries, and the command line's
checks before any work (no server here)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from specaudit.llama import upstream, upstream_plugin
from specaudit.llama.patches import DEFAULT_BUILD, resolve, resolve_all
from specaudit.llama.upstream import PATCH_TESTS, TESTS_DIR, Selection

CliFn = Callable[..., tuple[int, str, str]]


def test_each_bundled_patch_carries_an_upstream_style_test_file() -> None:
    for name, sel in PATCH_TESTS.items():
        diff = upstream.patch_test_sections(resolve(name)).decode()
        assert f"+++ b/{TESTS_DIR}/{sel.path}\n" in diff, name
        # only the tests directory's sections: the source hunks are the build's business
        heads = [ln for ln in diff.splitlines() if ln.startswith("diff --git ")]
        assert heads and all(f" b/{TESTS_DIR}/" in h for h in heads), name
        assert "from utils import *" in diff, name  # upstream's style: its utils, its presets


def test_the_copy_holds_upstreams_tests_and_each_patchs_test(tmp_path: Path) -> None:
    # the sdist is in the cache once the build exists (./run test builds before pytest)
    tests = upstream.prepare_tests(DEFAULT_BUILD, resolve_all(tuple(PATCH_TESTS)), tmp_path)
    for rel in ("utils.py", "conftest.py", "unit/test_speculative.py", "unit/test_completion.py"):
        assert (tests / rel).is_file(), rel
    for sel in PATCH_TESTS.values():
        assert (tests / sel.path).is_file(), sel.path


@pytest.mark.parametrize("text", ["../x.py", "/abs/test_x.py", "unit/test_x.txt", "::n_probs"])
def test_a_selection_outside_upstreams_tests_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Selection.parse(text)


def test_a_selection_names_a_file_and_a_keyword() -> None:
    sel = Selection.parse("unit/test_completion.py::n_probs")
    assert sel == Selection("unit/test_completion.py", "n_probs")
    assert Selection.parse("unit/test_speculative.py").keyword is None


def test_the_command_refuses_a_bad_selection_in_one_line(cli: CliFn) -> None:
    code, out, err = cli("llama", "upstream-tests", "--select", "../../etc/passwd.py")
    assert code == 2
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


def _server(**kw: object) -> SimpleNamespace:
    base: dict[str, object] = {
        "model_hf_repo": "ggml-org/models",
        "model_hf_file": "tinyllamas/stories260K.gguf",
        "model_url": None,
        "model_file": None,
        "model_draft": None,
        "spec_type": None,
        "offline": False,
        "server_host": "127.0.0.1",
        "server_port": 8080,
    }
    return SimpleNamespace(**{**base, **kw})


def test_forcing_gives_a_plain_server_its_local_model_as_draft() -> None:
    srv = _server()
    upstream_plugin._localise(srv, "/m.gguf", "/m.gguf")
    assert (srv.model_file, srv.model_hf_repo, srv.model_hf_file) == ("/m.gguf", None, None)
    assert (srv.model_draft, srv.spec_type, srv.offline) == ("/m.gguf", "draft-simple", True)
    assert srv.server_port != 8080


def test_without_forcing_a_plain_server_stays_plain() -> None:
    srv = _server()
    upstream_plugin._localise(srv, "/m.gguf", None)
    assert srv.model_file == "/m.gguf" and srv.model_draft is None and srv.spec_type is None


def test_a_server_a_test_made_speculate_keeps_its_settings() -> None:
    srv = _server(spec_type="ngram-mod")
    upstream_plugin._localise(srv, "/m.gguf", "/m.gguf")
    assert srv.spec_type == "ngram-mod" and srv.model_draft is None


def test_a_server_without_a_model_is_not_given_one() -> None:
    srv = _server(model_hf_repo=None, model_hf_file=None)  # upstream's router preset
    upstream_plugin._localise(srv, "/m.gguf", "/m.gguf")
    assert srv.model_file is None and srv.model_draft is None
