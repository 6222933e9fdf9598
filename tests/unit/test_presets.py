"""One place for llama-server presets: the arguments each role starts with."""

from __future__ import annotations

from pathlib import Path

from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries
from specaudit.llama.server import LlamaServer


def _bins(tmp_path: Path) -> LlamaBinaries:
    return LlamaBinaries(build=11434, variant="stock", bin_dir=tmp_path)


def _args(srv: LlamaServer) -> list[str]:
    argv = srv.argv()
    return argv[1:]


def test_every_role_is_sized_by_its_model_policy(tmp_path: Path) -> None:
    m, d = tmp_path / "m.gguf", tmp_path / "d.gguf"
    for name, p in presets.PRESETS.items():
        srv = presets.for_preset(p, _bins(tmp_path), m, d)
        a = _args(srv)
        pol = presets.POLICIES[p.model]
        slots = 1 if p.spec_type == "draft-eagle3" else pol.parallel  # EAGLE3: one slot
        assert a[a.index("-np") + 1] == str(slots), name
        assert a[a.index("-c") + 1] == str(slots * pol.ctx_per_slot), name
        assert ("-t" in a) is (pol.threads is not None), name
        has_draft = p.speculative and p.spec_type.startswith("draft") and p.spec_type != "draft-mtp"
        assert ("-md" in a) is has_draft, name
        assert ("--spec-type" in a) is p.speculative, name
        assert srv.name == name


def test_audit_sizes_are_unchanged(tmp_path: Path) -> None:
    """The sizes the audit uses: fixture 4 slots x 256, Gemma 2 x 2048, each on one thread."""
    fx = _args(presets.for_preset(presets.PRESETS["fixture-spec"], _bins(tmp_path),
                                  tmp_path / "t", tmp_path / "d"))  # fmt: skip
    assert fx[fx.index("-np") + 1] == "4" and fx[fx.index("-c") + 1] == "1024"
    assert fx[fx.index("-t") + 1] == "1"
    assert fx[fx.index("--spec-type") + 1] == "draft-simple"
    g = _args(presets.for_preset(presets.PRESETS["gemma-ngram"], _bins(tmp_path),
                                 tmp_path / "g", tmp_path / "g"))  # fmt: skip
    assert g[g.index("-c") + 1] == "4096" and "-md" not in g and g[g.index("-t") + 1] == "1"


def test_overrides_and_draft_types(tmp_path: Path) -> None:
    srv = presets.server(_bins(tmp_path), tmp_path / "m", kind="fixture", draft=tmp_path / "d",
                         spec_type="draft-simple", parallel=8)  # fmt: skip
    a = _args(srv)
    assert a[a.index("-np") + 1] == "8" and a[a.index("-c") + 1] == str(8 * 256)
    assert presets.uses_draft("draft-simple") and presets.uses_draft("ngram-mod,draft-eagle3")
    assert not presets.uses_draft("draft-mtp") and not presets.uses_draft(None)
    assert presets.PRESETS["fixture-spec-patched"].patches == (presets.PATCH,)
    assert presets.PRESETS["fixture-spec"].patches == ()


def test_each_ngram_type_has_a_patched_role_with_its_flags(tmp_path: Path) -> None:
    """`check` and the patch-equality tests run each n-gram type on the patched build."""
    for t, flags in presets.NGRAM_TYPE_ARGS.items():
        p = presets.PRESETS[f"fixture-{t}-patched"]
        assert p.patches == (presets.PATCH,) and presets.path_of(p) == t
        a = _args(presets.for_preset(p, _bins(tmp_path), tmp_path / "m", None))
        assert a[a.index("--spec-type") + 1] == t and "-md" not in a
        assert a[len(a) - len(flags) :] == list(flags)


def test_extra_args_are_appended_after_the_policy(tmp_path: Path) -> None:
    srv = presets.server(_bins(tmp_path), tmp_path / "m", kind="fixture",
                         extra_args=["--spec-synth-len", "3"])  # fmt: skip
    assert _args(srv)[-4:] == ["-t", "1", "--spec-synth-len", "3"]
    g = presets.server(_bins(tmp_path), tmp_path / "g", kind="gemma", extra_args=["-fa", "on"])
    assert _args(g)[-4:] == ["-t", "1", "-fa", "on"]
