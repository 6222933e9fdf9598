"""`specaudit ab` against real llama-servers: fixture and Gemma 3 270M, plain vs speculating.

Servers come from the session fixtures (one per role); only the second plain fixture server
for the plain-vs-plain run is started here, module-scoped. Gemma runs are kept short (3 seeds
x 40 tokens); the audit section runs the CLI defaults.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from ab_schema import check_against, doc_schema
from specaudit import ab, audit
from specaudit.audit.sections import ab as ab_section
from specaudit.llama import presets
from specaudit.llama.build import LlamaBinaries

CliFn = Callable[..., tuple[int, str, str]]


def assert_png_readable(path: Path) -> None:
    """Written, a valid PNG, a sensible size, and not blank (pixels vary, many colours)."""
    assert path.is_file() and path.stat().st_size > 10_000
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG"
        w, h = im.size
        px = np.asarray(im.convert("RGB"), dtype=np.float64)
    assert w >= 800 and h >= 600
    assert px.std() > 20, "the image is (nearly) one colour"
    colours = np.unique(px.reshape(-1, 3), axis=0)
    assert len(colours) > 50


def assert_counts_add_up(r: ab.ABResult) -> None:
    for resp in r.responses:
        assert resp.real + resp.placeholder + resp.unchecked == resp.tokens
        assert resp.n_predicted == resp.tokens, resp  # the server's own count agrees
        assert len(resp.reported_logprobs) == len(resp.real_logprobs) == resp.tokens
        assert sum(v is None for v in resp.real_logprobs) == resp.placeholder
    for side in ab.SIDES:
        s = r.side(side)
        rs = [x for x in r.responses if x.side == side]
        assert s.responses == len(rs) == r.settings.seeds
        assert s.tokens == sum(x.tokens for x in rs)
        assert s.real == sum(x.real for x in rs)
        assert s.placeholder == sum(x.placeholder for x in rs)
        assert s.real + s.placeholder + s.unchecked == s.tokens


def assert_instrument_fault(r: ab.ABResult) -> None:
    assert r.plain.coverage == 1.0 and r.plain.placeholder == 0
    assert r.spec.coverage < 0.10, r.spec
    assert r.spec.naive_mean is not None and r.plain.naive_mean is not None
    assert r.spec.naive_mean > r.plain.naive_mean
    assert r.verdict.kind is ab.ABVerdict.INSTRUMENT_FAULT, r.verdict
    assert "tool, not the model" in r.verdict.message
    assert r.plain.speculative is False and r.spec.speculative is True  # /slots says so
    assert r.spec.draft_n is not None and r.spec.draft_n > 0
    assert r.plain.draft_n is None
    assert r.delta_naive.mean is not None and r.delta_naive.ci_low is not None
    assert r.delta_naive.ci_low > 0  # spec reads higher than plain, beyond noise
    assert r.exit_code == 1


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_fixture_draft_simple_vs_plain_is_instrument_fault(
    server: Callable[[str], Any], fixture_set: Any, endpoint: str, tmp_path: Path
) -> None:
    plain, spec = server("fixture-plain"), server("fixture-spec")
    settings = ab.Settings(seeds=5, tokens=64, prompt=fixture_set.spec.prompt, endpoint=endpoint)
    r = ab.run(plain.url, spec.url, settings, plot=tmp_path / "ab.png")
    assert_instrument_fault(r)
    assert_counts_add_up(r)
    assert r.plot == tmp_path / "ab.png"
    assert_png_readable(r.plot)


@pytest.fixture(scope="module")
def second_fixture_plain(llama_bins: LlamaBinaries, fixture_set: Any) -> Iterator[str]:
    """A second plain fixture server: plain against plain across two processes."""
    with presets.server(
        llama_bins, Path(fixture_set.target), kind="fixture", parallel=2, name="ab-plain-2"
    ) as srv:
        yield srv.url


def test_two_plain_servers_are_consistent(
    server: Callable[[str], Any], fixture_set: Any, second_fixture_plain: str
) -> None:
    settings = ab.Settings(seeds=5, tokens=48, prompt=fixture_set.spec.prompt)
    r = ab.run(server("fixture-plain").url, second_fixture_plain, settings)
    assert r.verdict.kind is ab.ABVerdict.CONSISTENT, r.verdict
    assert r.plain.coverage == r.spec.coverage == 1.0
    assert r.plain.speculative is False and r.spec.speculative is False
    assert r.exit_code == 0
    assert_counts_add_up(r)


def test_one_plain_server_against_itself_is_consistent(
    server: Callable[[str], Any], fixture_set: Any
) -> None:
    url = server("fixture-plain").url
    r = ab.run(url, url, ab.Settings(seeds=4, tokens=32, prompt=fixture_set.spec.prompt))
    assert r.verdict.kind is ab.ABVerdict.CONSISTENT, r.verdict
    assert r.plain.slots == r.spec.slots  # both sides share the one server's slots


# A prompt that makes Gemma copy a sentence: ngram-mod drafts once the text repeats, so one
# response mixes real values (before the repetition) and placeholders (after). Worded
# uniquely so the server's n-gram pool has not seen it from another test: measured, a second
# run of the same prompt on the same server drafts everything after the first token (the pool
# learned the text), so this prompt is used once per session. Temperature 0 makes the mixed
# first run deterministic.
NGRAM_PROMPT = (
    "Repeat this sentence ten times, one per line: "
    "The keeper of the ab lighthouse counts every token at dawn."
)


@pytest.mark.gemma
def test_gemma_ngram_mod_counts_are_mixed_and_add_up(server: Callable[[str], Any]) -> None:
    srv = server("gemma-ngram")
    plain = server("gemma-plain")
    settings = ab.Settings(seeds=2, tokens=64, prompt=NGRAM_PROMPT, temperature=0.0)
    r = ab.run(plain.url, srv.url, settings)
    assert_counts_add_up(r)
    spec = [x for x in r.responses if x.side == "spec"]
    assert any(x.mixed for x in spec), [(x.real, x.placeholder) for x in spec]
    mixed = next(x for x in spec if x.mixed)
    assert 1 < mixed.real < mixed.tokens and mixed.placeholder > 0
    assert r.spec.speculative is True and r.spec.draft_n is not None
    assert r.plain.coverage == 1.0
    # counts are per response: mixed responses mean per-response coverage differs from 0/1
    assert 0 < mixed.coverage < 1


@pytest.mark.gemma
def test_gemma_and_fixture_draft_simple_in_the_audit_section(
    audit_ctx: audit.AuditContext, tmp_path: Path
) -> None:
    """The audit section on the session's Gemma and fixture servers (short Gemma run)."""
    sec = ab_section.section(audit_ctx, seeds=3, tokens=40)
    assert sec.key == "ab" and sec.status == "finding"
    assert set(sec.data) == {"Gemma 3 270M", "fixture"}
    for label, data in sec.data.items():
        assert data["verdict"]["kind"] == "instrument fault", (label, data["verdict"])
        assert data["plain"]["coverage"] == 1.0
        assert data["spec"]["coverage"] < 0.10
        assert data["spec"]["naive_mean"] > data["plain"]["naive_mean"]
    assert "| Gemma 3 270M |" in sec.markdown and "| no speculation |" in sec.markdown
    assert len(sec.plots) == 2
    for p in sec.plots:
        assert p.parent == audit_ctx.out_dir
        assert_png_readable(p)


def test_cli_json_matches_the_documented_schema(
    server: Callable[[str], Any], fixture_set: Any, tmp_path: Path, cli: CliFn
) -> None:
    png = tmp_path / "cli.png"
    code, out, err = cli(
        "ab", "--plain", server("fixture-plain").url, "--spec", server("fixture-spec").url,
        "--prompt", fixture_set.spec.prompt, "--seeds", "3", "--tokens", "48",
        "--plot", str(png), "--json",
    )  # fmt: skip
    assert code == 1, err  # instrument fault
    data = json.loads(out)
    check_against(doc_schema(), [data], require_all=False)
    assert data["local"] is None
    assert data["verdict"]["kind"] == "instrument fault" and data["plot"] == str(png)
    assert_png_readable(png)


def test_cli_starts_its_own_servers(fixture_set: Any, tmp_path: Path, cli: CliFn) -> None:
    """No URLs: ab starts plain + draft-simple servers from --model/--draft, then stops them."""
    code, out, err = cli(
        "ab", "--model", str(fixture_set.target), "--draft", str(fixture_set.draft),
        "--prompt", fixture_set.spec.prompt, "--seeds", "3", "--tokens", "48",
        "--log-dir", str(tmp_path / "logs"), "--json",
    )  # fmt: skip
    assert code == 1, err
    data = json.loads(out)
    check_against(doc_schema(), [data], require_all=False)
    assert data["local"]["spec_type"] == "draft-simple"
    assert data["local"]["draft"] == str(fixture_set.draft)
    assert data["spec"]["speculative"] is True and data["plain"]["speculative"] is False
    assert data["verdict"]["kind"] == "instrument fault"
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["ab-plain.log", "ab-spec.log"]
    # the servers were stopped: nothing answers on their ports any more
    for side in ("plain", "spec"):
        with pytest.raises(httpx.HTTPError):
            httpx.get(data[side]["url"] + "/health", timeout=2)
