"""What vlmq writes is safe to open: control characters and spreadsheet formulas that
a page's text layer or a model's answer carry into what vlmq writes.

- a PDF text layer holding `ESC]0;TITLE BEL ESC[2J ESC[31m` (within the text-layer
check's 2 % allowance), read with `--text-layer prefer` by a real worker: `vlmq result
--format txt` on a terminal wrote the raw sequences, and raw ESC reached txt, md and csv
from model output too. Now txt, md and csv lose them (jsonl and json keep every
character, escaped by JSON), and whatever reaches a terminal is shown escaped.
- CSV cells a spreadsheet runs as formulas although they do not start with = + - @
(leading space, zero-width or format characters, the full-width forms), and NUL.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fpdf
import pytest
from redis import Redis

from tests.support import helpers
from tests.support.dashboard_data import result
from tests.support.lua_calls import write_items
from vlmq.producer.client import Client
from vlmq.producer.ops.export import export_results
from vlmq.producer.ops.output_formats import csv_cell, extract_file
from vlmq.producer.options import JobOptions
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult

ESCAPES = "\x1b]0;TITLE\x07 \x1b[2J \x1b[31m"
LAYER_TEXT = "Plain words of a born digital page. " * 8 + ESCAPES + "end of page"
MODEL_TEXT = "A caption\x1b]0;PWNED\x07 with \x1b[2J\x1b[31mred\x9b31m and \x00nul\x7f."
MODEL_CLEAN = "A caption with red and nul."
# C0 but tab, LF and CR; DEL; C1.
CONTROLS = [chr(c) for c in [*range(0x20), *range(0x7f, 0xa0)] if chr(c) not in "\t\n\r"]


def _controls(text: str) -> list[str]:
    return sorted({c for c in text if c in CONTROLS})


def on_terminal(redis_url: str, *args: str) -> tuple[int, bytes]:
    """`vlmq ARGS` with stdout and stderr on a pseudo-terminal (isatty true): the bytes a
    user's terminal would be sent."""
    master, slave = os.openpty()
    proc = subprocess.Popen([helpers.VLMQ, "--redis-url", redis_url, *args], stdout=slave,
                            stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
    return proc.wait(timeout=120), out


def _result(redis_url: str, *args: str) -> str:
    res = helpers.invoke_cli(redis_url, "result", *args)
    return str(res.stdout)


# -- model output (results as a worker writes them) --------------------------------------


@pytest.fixture
def captions(redis_url: str, redis: Redis, tmp_path: Path) -> Iterator[str]:
    """A finished caption job of three images: one answer full of control sequences, one
    formula-like answer, one failed item whose source carries an escape sequence."""
    images = helpers.make_images(tmp_path / "imgs", 3)
    with helpers.worker_lifecycle(redis, ["caption"]) as life, Client(redis_url) as client:
        job = client.submit("caption", images, JobOptions())
        running = life.take()
        assert running is not None and getattr(running, "job_id", None) == job.id
        write_items(redis, Keys(), job.id, result(0, images[0].name, None, MODEL_TEXT))
        write_items(redis, Keys(), job.id, result(1, images[1].name, None,
                                                 " =cmd|' /C calc'!A0\x00"))
        write_items(redis, Keys(), job.id, result(2, "evil\x1b]0;owned\x07.png", None, None,
                                                 error="image: cannot decode"))
        life.succeed(running, {"items": 3, "ok": 2, "failed": 1})
        yield job.id


def test_txt_md_and_csv_lose_control_characters_jsonl_keeps_them(
        redis_url: str, captions: str) -> None:
    txt = _result(redis_url, captions, "--format", "txt")
    assert _controls(txt) == [] and MODEL_CLEAN in txt, repr(txt)
    md = _result(redis_url, captions, "--format", "md")
    assert _controls(md) == [] and MODEL_CLEAN in md, repr(md)
    cells = [c for row in csv.reader(io.StringIO(_result(redis_url, captions, "--format",
                                                         "csv"))) for c in row]
    assert all(_controls(c) == [] for c in cells), cells
    assert MODEL_CLEAN in cells and "' =cmd|' /C calc'!A0" in cells, cells
    lines = [json.loads(line) for line in _result(redis_url, captions).splitlines()]
    assert lines[0]["text"] == MODEL_TEXT  # JSON carries every character, escaped
    assert "\x1b" not in _result(redis_url, captions) and "\x9b" not in _result(
        redis_url, captions, "--format", "json")
    assert json.loads(_result(redis_url, captions, "--format", "json"))["items"][0][
        "text"] == MODEL_TEXT


def test_a_terminal_is_sent_no_escape_sequence(redis_url: str, captions: str) -> None:
    for fmt in ("txt", "md", "csv", "jsonl", "json"):
        _, out = on_terminal(redis_url, "result", captions, "--format", fmt)
        assert b"\x1b" not in out and b"\x07" not in out and b"\xc2\x9b" not in out, (
            fmt, out)
    _, out = on_terminal(redis_url, "result", captions, "--format", "txt")
    # The failed item's note on stderr names its source, the escape shown, not obeyed.
    assert b"evil\\x1b]0;owned\\x07.png" in out, out


def test_export_files_lose_them_and_extract_json_escapes_c1(tmp_path: Path) -> None:
    pages = [result(0, "doc.pdf", 1, MODEL_TEXT), result(1, "doc.pdf", 2, None,
                                                         error="page\x1b[2J failed"),
             result(2, "photo.jpg", None, MODEL_TEXT)]
    for fmt in ("md", "txt"):
        report = export_results(pages, tmp_path / fmt, fmt)
        for path in report.written:
            text = path.read_text()
            assert _controls(text) == [] and MODEL_CLEAN in text, (path, text)
    obj = ItemResult(index=0, source="a.png", page=None, text="{}", finish_reason="stop",
                     prompt_tokens=1, completion_tokens=1, vision_cache_hit=False, error=None,
                     json={"name": "x\x1b[2J\x9b31m\x7fy"})
    out = extract_file([obj])
    assert _controls(out) == [] and json.loads(out) == obj.json


# -- what spreadsheets run as formulas --------------------------------------------

CELLS: list[tuple[Any, str]] = [
    (" =1+2", "' =1+2"), ("  @SUM(A1)", "'  @SUM(A1)"), ("\u00a0-1+2", "'\u00a0-1+2"),
    ("\u200b=HYPERLINK(\"http://evil\")", "'\u200b=HYPERLINK(\"http://evil\")"),
    ("\u200e+1", "'\u200e+1"), ("\u2060@x", "'\u2060@x"), ("\ufeff=1", "'\ufeff=1"),
    ("\uff1d1+1", "'\uff1d1+1"), ("\uff0b1", "'\uff0b1"), ("\uff0d1", "'\uff0d1"),
    ("\uff20SUM(A1)", "'\uff20SUM(A1)"), (" \u200b \uff1dx", "' \u200b \uff1dx"),
    ("a\x00b", "ab"), ("\x00=1", "'=1"), ("\t=1", "'\t=1"), ("\r=1", "'\r=1"),
    ("=1", "'=1"), ("-3.5", "'-3.5"), (-3.5, "-3.5"), (-7, "-7"), (True, "true"),
    ("plain", "plain"), (" plain", " plain"), ("a = b", "a = b"),
    ({"k": "\x00=v"}, '{"k":"\\u0000=v"}'),
]


@pytest.mark.parametrize(("value", "cell"), CELLS, ids=[repr(v) for v, _ in CELLS])
def test_csv_guards_every_formula_start_and_drops_nul(value: Any, cell: str) -> None:
    assert csv_cell(value) == cell


# -- a real worker: a text layer carrying escape sequences -----------------


def escaping_pdf(path: Path) -> Path:
    pdf = fpdf.FPDF(unit="mm")
    pdf.add_page(format=(210, 297))
    pdf.set_font("helvetica", size=12)
    pdf.multi_cell(180, 6, LAYER_TEXT)
    pdf.output(str(path))
    return path


@pytest.fixture(scope="module")
def layer_job(module_redis_url: str, tiny_model: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("output-trust")
    procs: list[subprocess.Popen[str]] = []
    with Client(module_redis_url) as client:
        job = client.ocr([escaping_pdf(tmp / "escapes.pdf")], options=JobOptions(
            max_tokens=4, max_side=224, text_layer="prefer"))
        try:
            procs.append(helpers.start_worker(module_redis_url, tiny_model, tmp,
                                              name="wout"))
            (got,) = helpers.finished_results(client, job.id, timeout=240)
            assert got.text_source == "text_layer" and "\x1b]0;TITLE" in (got.text or ""), got
            yield job.id
        finally:
            helpers.stop_all(procs)


@pytest.mark.slow
def test_a_text_layers_escapes_never_reach_the_terminal(module_redis_url: str,
                                                        layer_job: str) -> None:
    code, out = on_terminal(module_redis_url, "result", layer_job, "--format", "txt")
    assert code == 0, out
    assert b"Plain words" in out and b"end of page" in out, out
    assert b"\x1b" not in out and b"\x07" not in out and b"TITLE" not in out, out
    for fmt in ("md", "csv"):
        assert _controls(_result(module_redis_url, layer_job, "--format", fmt)) == []
    (line,) = _result(module_redis_url, layer_job).splitlines()
    assert ESCAPES in json.loads(line)["text"]
