"""PDF text layers (`text_layer: off | fallback | prefer`): the quality check, extraction in
the render processes, and a real worker on born-digital PDFs made with fpdf2, mixed with
scanned pages (an image and no text)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fpdf
import pytest
from PIL import Image, ImageDraw
from redis import Redis
from redis.exceptions import ResponseError

from tests.support import helpers
from vlmq.producer.client import Client, Job
from vlmq.producer.options import JobOptions
from vlmq.shared.enqueue import enqueue_lua
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult, parse_payload
from vlmq.worker.prep import decode, text_layer
from vlmq.worker.prep.render_pool import RenderPool

LOREM = ("Quarterly report {n}. Revenue rose to {r} EUR while costs fell; the board "
         "approved the budget for the next period and thanked the staff.")


def page_text(n: int) -> str:
    return LOREM.format(n=n, r=1000 + 37 * n)


def scan_image(n: int) -> Image.Image:
    img = Image.new("L", (420, 594), 255)
    ImageDraw.Draw(img).text((30, 40 + 9 * n), f"scanned page {n}", fill=0)
    return img


def mixed_pdf(path: Path, kinds: str) -> Path:
    """One page per letter: d = born digital (a real text layer), s = a scan (one image
    over the page, no text), o = a scan with an OCR text layer over it, w = born digital
    on a 2000 x 5 mm strip (no vision processor takes that aspect ratio: the model fails
    the page, its layer is fine)."""
    pdf = fpdf.FPDF(unit="mm")
    pdf.set_auto_page_break(False)
    for n, kind in enumerate(kinds, start=1):
        if kind in "so":
            pdf.add_page(format=(210, 297))
            pdf.image(scan_image(n), x=0, y=0, w=210, h=297)
            if kind == "o":  # a searchable scan: an OCR layer over the image
                pdf.set_font("helvetica", size=12)
                pdf.set_xy(15, 15)
                pdf.multi_cell(180, 6, page_text(n))
        elif kind == "w":
            pdf.add_page(format=(5, 2000), orientation="L")
            pdf.set_font("helvetica", size=8)
            pdf.set_xy(2, 1)
            pdf.cell(1990, 3, page_text(n))
        else:
            pdf.add_page(format=(210, 297))
            pdf.set_font("helvetica", size=12)
            pdf.multi_cell(180, 6, page_text(n))
    pdf.output(str(path))
    return path


# --- the check -----------------------------------------------------------------------


def test_the_check_takes_real_text_and_refuses_what_is_not() -> None:
    good = text_layer.assess(page_text(1), 0.0)
    assert good.problem is None and good.usable("prefer") and good.usable("fallback")
    assert not good.usable("off")
    assert "no text layer" in str(text_layer.assess("", 0.0).problem)
    assert "only 1 character" in str(text_layer.assess("3", 0.0).problem)
    broken = text_layer.assess("Revenue \ufffd\ufffd\ufffd " + "x\x01y\x02" * 10, 0.0)
    assert broken.problem is not None and "unreadable" in broken.problem
    symbols = text_layer.assess("✓ ✗ ■ □ ● ○ ◆ ◇ ★ ☆ → ← ↑ ↓ ♠ ♣ ♥ ♦ § ¶ † ‡ ab", 0.0)
    assert symbols.problem is not None and "mostly symbols" in symbols.problem
    report = "季度报告显示收入增长了百分之十二、成本下降、董事会批准了下一期的预算。"
    cjk = text_layer.assess(report, 0.0)
    assert cjk.problem is None, cjk.problem
    huge = text_layer.assess("word " * (text_layer.MAX_CHARS // 4), 0.0)
    assert huge.problem is not None and "over" in huge.problem


def test_a_scan_with_an_ocr_layer_is_for_fallback_only() -> None:
    layer = text_layer.assess(page_text(2), 0.97)
    assert layer.problem is None
    assert layer.usable("fallback") and not layer.usable("prefer")
    assert "a scan" in layer.why_not("prefer")


def test_normalise_keeps_lines_and_drops_blank_runs() -> None:
    assert text_layer.normalise("a  \r\n\r\n\r\nb\rc\n\n") == "a\n\nb\nc"


def test_extraction_reads_each_page_as_written(tmp_path: Path) -> None:
    data = mixed_pdf(tmp_path / "m.pdf", "dsd").read_bytes()
    first, scan, third = (decode.pdf_text_layer(data, n) for n in (1, 2, 3))
    assert " ".join(first.text.split()) == page_text(1)
    assert first.image_cover == 0.0 and first.usable("prefer")
    assert scan.problem == "no text layer" and scan.image_cover > 0.99
    assert " ".join(third.text.split()) == page_text(3)
    with pytest.raises(decode.PreprocessError, match="out of range: the PDF has 3"):
        decode.pdf_text_layer(data, 4)


def test_render_processes_read_layers_and_keep_the_document_open(tmp_path: Path) -> None:
    data = mixed_pdf(tmp_path / "m.pdf", "dsd").read_bytes()
    pool = RenderPool(1)
    fetched: list[int] = []

    def fetch() -> bytes:
        fetched.append(1)
        return data

    try:
        layers = [pool.text_layer(fetch, n, doc_key="doc") for n in (1, 2, 3)]
        img = pool.render(fetch, 2, 300, doc_key="doc")
    finally:
        pool.close()
    assert [x.usable("prefer") for x in layers] == [True, False, True]
    assert " ".join(layers[2].text.split()) == page_text(3)
    assert img.size[1] == 300
    assert fetched == [1], "the child keeps the document: its bytes are sent once"


def test_a_corrupt_pdf_is_a_page_error_not_a_crash() -> None:
    pool = RenderPool(1)
    try:
        with pytest.raises(decode.PreprocessError, match="not a readable PDF"):
            pool.text_layer(lambda: b"%PDF-1.4 garbage", 1, doc_key="bad")
    finally:
        pool.close()


# --- the setting ---------------------------------------------------------------------


def test_the_setting_is_checked_everywhere_it_is_given(redis: Redis, run_cli: object,
                                                       tmp_path: Path) -> None:
    item = {"kind": "pdf", "blob": "a" * 64, "source": "x.pdf", "page": 1}
    base = {"v": 1, "task": "ocr", "items": [item]}
    assert parse_payload(base).get("text_layer") == "fallback"
    assert parse_payload({**base, "text_layer": "prefer"}).to_dict()["text_layer"] == "prefer"
    with pytest.raises(PayloadError, match="text_layer"):
        parse_payload({**base, "text_layer": "always"})
    with pytest.raises(PayloadError, match="text_layer"):
        JobOptions(text_layer="yes")
    redis.set(Keys().blob("a" * 64), b"x")
    with pytest.raises(ResponseError, match="text_layer"):
        enqueue_lua(redis, {**base, "text_layer": True}, queue="ocr")
    pdf = mixed_pdf(tmp_path / "a.pdf", "d")
    res = helpers.invoke_cli(_url(redis), "enqueue", "ocr", str(pdf), "--text-layer", "maybe")
    assert res.exit_code == 2 and "maybe" in res.output, res.output
    assert not redis.exists("rq:queue:ocr")


def _url(redis: Redis) -> str:
    kw = redis.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw['db']}"


# --- a real worker -------------------------------------------------------------------


@dataclass
class Run:
    prefer: Job
    off: Job
    cut_off: Job
    cut_fallback: Job
    wide_fallback: Job
    wide_off: Job
    searchable_cut: Job
    searchable_plain: Job
    summary_prefer: Job
    mixed: Path
    stats: dict[str, str]


def _run_worker(redis_url: str, tiny_model: Path, tmp: Path, name: str,
                procs: list[subprocess.Popen[str]]) -> dict[str, str]:
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp, "--burst", name=name))
    rc, out = helpers.finish(procs[-1], timeout=240)
    assert rc == 0, out
    raw = Redis.from_url(redis_url).hgetall(Keys().worker_stats(name))
    return {k.decode(): v.decode() for k, v in raw.items()}


@pytest.fixture(scope="module")
def run(module_redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("text-layer")
    mixed = mixed_pdf(tmp / "mixed.pdf", "dsds")
    wide = mixed_pdf(tmp / "wide.pdf", "ws")
    searchable = mixed_pdf(tmp / "searchable.pdf", "oo")
    client = Client(module_redis_url)
    opts = JobOptions(max_tokens=8, max_side=224)
    procs: list[subprocess.Popen[str]] = []
    try:
        jobs = Run(
            prefer=client.ocr([mixed], options=opts.with_(text_layer="prefer")),
            off=client.ocr([mixed], options=opts.with_(text_layer="off")),
            cut_off=client.ocr([mixed], options=opts.with_(text_layer="off", max_tokens=2)),
            cut_fallback=client.ocr([mixed], options=opts.with_(max_tokens=2)),
            wide_fallback=client.ocr([wide], options=opts),
            wide_off=client.ocr([wide], options=opts.with_(text_layer="off")),
            searchable_cut=client.ocr([searchable], options=opts.with_(
                text_layer="prefer", max_tokens=2)),
            searchable_plain=client.ocr([searchable], options=opts.with_(
                text_layer="off", max_tokens=2)),
            summary_prefer=client.submit("generate", [mixed], opts.with_(
                prompt="Summarise this page.", text_layer="prefer")),
            mixed=mixed, stats=_run_worker(module_redis_url, tiny_model, tmp, "tl1", procs))
        yield jobs
    finally:
        helpers.stop_all(procs)


def _same_words(a: str | None, b: str) -> bool:
    return a is not None and " ".join(a.split()) == b


def test_prefer_reads_born_digital_pages_and_sends_scans_to_the_model(run: Run) -> None:
    results = list(run.prefer.results())
    assert [r.page for r in results] == [1, 2, 3, 4]
    digital, scans = results[0::2], results[1::2]
    for r in digital:
        assert r.ok and r.text_source == "text_layer", r
        assert _same_words(r.text, page_text(r.page or 0)), r.text
        assert (r.prompt_tokens, r.completion_tokens) == (0, 0)
        assert r.model_error is None and r.model_text is None
    for r in scans:
        assert r.ok and r.text_source == "model" and r.completion_tokens > 0, r
    summary = run.prefer.summary() or {}
    assert summary["text_sources"] == {"text_layer": 2, "model": 2}, summary
    assert summary["completion_tokens"] == sum(r.completion_tokens for r in scans)


def test_only_ocr_jobs_use_the_layer(run: Run) -> None:
    results = list(run.summary_prefer.results())
    assert len(results) == 4 and all(r.ok for r in results)
    assert all(r.text_source == "model" and r.completion_tokens > 0 for r in results)


def test_off_runs_the_model_on_every_page_and_shares_no_cache_with_prefer(run: Run) -> None:
    results = list(run.off.results())
    assert all(r.ok and r.text_source == "model" and r.completion_tokens > 0 for r in results)
    assert all(not _same_words(r.text, page_text(r.page or 0)) for r in results)
    prefer = list(run.prefer.results())
    # The scans went to the model either way: the same text, token for token.
    assert [r.text for r in results[1::2]] == [r.text for r in prefer[1::2]]
    assert (run.off.summary() or {})["text_sources"] == {"model": 4}


def test_fallback_puts_the_layer_beside_a_page_cut_at_max_tokens(run: Run) -> None:
    plain = list(run.cut_off.results())
    fell = list(run.cut_fallback.results())
    cut = [r for r in plain if r.finish_reason == "length"]
    assert cut, "max_tokens 2 must cut some page of the tiny model"
    for model, r in zip(plain, fell, strict=True):
        digital = (model.page or 0) % 2 == 1
        assert r.ok and r.finish_reason == model.finish_reason
        if model.finish_reason == "length" and digital:
            assert r.text_source == "text_layer" and _same_words(r.text, page_text(r.page or 0))
            assert r.model_text == model.text, "the model's cut text stays visible"
        else:  # the model ended normally, or the scan has no layer: the model's text
            assert r.text_source == "model" and r.text == model.text and r.model_text is None


def test_fallback_answers_a_page_the_model_failed_and_keeps_the_error(run: Run) -> None:
    strip, normal = run.wide_fallback.results()
    assert strip.ok and strip.text_source == "text_layer", strip
    assert _same_words(strip.text, page_text(1))
    assert strip.model_error and "aspect ratio" in strip.model_error, strip.model_error
    assert strip.finish_reason == "error"
    assert normal.text_source == "model"
    failed, _ = run.wide_off.results()
    assert not failed.ok and failed.text is None and "aspect ratio" in str(failed.error)
    summary = run.wide_fallback.summary() or {}
    assert summary["ok"] == 2 and summary["text_sources"] == {"text_layer": 1, "model": 1}


def test_prefer_sends_a_searchable_scan_to_the_model_and_falls_back_on_its_layer(
        run: Run) -> None:
    plain = list(run.searchable_plain.results())
    fell = list(run.searchable_cut.results())
    assert all(r.ok and r.completion_tokens > 0 for r in fell), "scans go to the model"
    assert any(r.finish_reason == "length" for r in plain)
    for model, r in zip(plain, fell, strict=True):
        if model.finish_reason == "length":
            assert r.text_source == "text_layer" and r.model_text == model.text
            assert _same_words(r.text, page_text(r.page or 0))
        else:
            assert r.text_source == "model" and r.text == model.text


def test_results_keep_their_source_through_the_result_cache(
        run: Run, module_redis_url: str, tiny_model: Path, tmp_path: Path,
        procs: list[subprocess.Popen[str]]) -> None:
    client = Client(module_redis_url)
    again = client.ocr([run.mixed], options=JobOptions(max_tokens=8, max_side=224,
                                                       text_layer="prefer"))
    stats = _run_worker(module_redis_url, tiny_model, tmp_path, "tl2", procs)
    results = list(again.results())
    assert all(r.result_cache_hit for r in results), results
    assert [r.text_source for r in results] == ["text_layer", "model"] * 2
    assert [r.text for r in results] == [r.text for r in run.prefer.results()]
    assert stats["tokens"] == "0" and stats["pdf_renders"] == "0", stats


def test_stored_json_leaves_the_defaults_out() -> None:
    plain = ItemResult(index=0, source="a.pdf", page=1, text="t", finish_reason="stop",
                       prompt_tokens=1, completion_tokens=1, vision_cache_hit=False,
                       error=None)
    stored = json.loads(plain.to_json())
    assert not {"text_source", "model_error", "model_text"} & set(stored)
    back = ItemResult.from_dict(stored)
    assert back.text_source == "model" and back == plain


def test_outputs_say_which_pages_came_from_the_layer(run: Run, module_redis_url: str) -> None:
    from vlmq.server.dashboard.app import Settings, create_app

    md = helpers.invoke_cli(module_redis_url, "result", run.wide_fallback.id, "--format", "md")
    assert md.exit_code == 0, md.output
    assert "from the PDF's text layer; the model failed:" in md.output
    assert " ".join(page_text(1).split()) in " ".join(md.output.split())
    jsonl = helpers.invoke_cli(module_redis_url, "result", run.prefer.id, "--format", "jsonl")
    rows = [json.loads(line) for line in jsonl.output.splitlines()]
    assert [r.get("text_source", "model") for r in rows] == ["text_layer", "model"] * 2
    web = create_app(Settings(module_redis_url)).test_client()
    page = web.get(f"/jobs/{run.wide_fallback.id}").get_data(as_text=True)
    assert "own text layer, not the model" in page and "the model failed" in page, page[-3000:]
    assert '<span class="badge">text layer</span>' in page
