"""The audit's vLLM section rendered from its rows (`audit.sections.vllm.render_section`): a
finding while stock vLLM is BROKEN or crashes, or a fixed or plain row is not PRESERVED; a
Gemma run refused before sampling is a crash row with vLLM's reason, never a verdict."""

from __future__ import annotations

from specaudit.audit.sections import vllm as av
from specaudit.outcome import Outcome

TOP_P, TOP_K = (label for label, _ in av.SAMPLERS)


def _rows(fixed_verdict: str) -> list[av.VllmRow]:
    return [
        av.VllmRow("fx", "plain (stock)", TOP_P, "PRESERVED", 1000),
        av.VllmRow("fx", "ngram (stock)", TOP_P, "BROKEN", 1000, 1617, 3, "impossible"),
        av.VllmRow("fx", "ngram (stock)", TOP_K, av.CRASH, why="RuntimeError: max()"),
        av.VllmRow("fx", "ngram + cpu-sampler fix", TOP_P, fixed_verdict, 1000, 1626, 343),
    ]


def test_a_crash_row_names_vllms_reason_and_leaves_counts_empty() -> None:
    row = _rows("PRESERVED")[2]
    assert row.cells() == ["fx", "ngram (stock)", TOP_K, "crash", 0, "-", "-",
                           "RuntimeError: max()"]  # fmt: skip


def test_a_gemma_run_refused_before_sampling_is_a_crash_not_a_verdict() -> None:
    run = av.GemmaRun("ngram (stock)", None, "the server died: RuntimeError: max()")
    assert run.verdict == av.CRASH
    assert av.GemmaRun("ngram (stock)", None).verdict == "no decision"
    section = av.render_section(av.VllmReport(rows=_rows("PRESERVED"), gemma=[run]))
    assert "| ngram (stock) | crash | 0 | 0 | - | - | the server died: RuntimeError" in (
        section.markdown
    )
    assert section.data["gemma"][0]["rescore"] is None


def test_the_section_is_a_finding_while_stock_breaks_and_names_every_row() -> None:
    section = av.render_section(av.VllmReport(rows=_rows("PRESERVED")))
    assert section.status is Outcome.FINDING and section.key == "vllm"
    assert f"fx ngram (stock) {TOP_K}: crash" in section.summary
    assert section.markdown.count("| fx |") == 4


def test_a_fixed_row_that_is_not_preserved_is_a_finding_too() -> None:
    rows = [r for r in _rows("INCONCLUSIVE") if "stock" not in r.server or "plain" in r.server]
    assert av.render_section(av.VllmReport(rows=rows)).status is Outcome.FINDING
    ok = [r for r in _rows("PRESERVED") if "ngram (stock)" not in r.server]
    assert av.render_section(av.VllmReport(rows=ok)).status is Outcome.OK
