"""An extract job's outputs: jsonl with each item's object, csv with the objects' fields as
columns, `vlmq export` writing <source>.json, and the dashboard showing the object escaped.

The results are written into a real Redis by the worker's own code (write_item and the job
lifecycle), as a worker that ran the model would leave them."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from markupsafe import escape
from redis import Redis

from tests.support.dashboard_data import result
from tests.support.helpers import make_images, pdf_bytes, worker_lifecycle
from tests.support.lua_calls import write_items
from vlmq.cli.main import main
from vlmq.producer import Client, JobOptions
from vlmq.producer.files import check_file
from vlmq.producer.inputs import Prepared
from vlmq.server.dashboard.app import Settings, create_app
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"vendor": {"type": "string"}, "total": {"type": "number"},
                   "lines": {"type": "array", "items": {"type": "object"}},
                   "note": {"type": "string"}},
    "required": ["vendor", "total"],
}
# Item 0: CJK, a nested array, a note with a newline and quotes. Item 1: hostile strings,
# a negative number, a field first seen here and one named like the fixed error column.
OBJECTS: list[dict[str, Any]] = [
    {"vendor": "東京商店 Ünïcode", "total": 42.5, "lines": [{"name": "bolt", "qty": 3}],
     "note": 'line one\nline two, "quoted"'},
    {"vendor": "<script>alert('x')</script>", "total": -3, "extra_flag": True,
     "note": "@SUM(A1)", "error": "+1"},
]
PAGE_OBJECT = {"vendor": "ACME", "total": 7}
CUT = "output cut at max_tokens before the JSON was complete: raise --max-tokens"
FORMULA_ID = "=HYPERLINK(\"http://evil\")"


@dataclass(frozen=True)
class Jobs:
    extract: str  # img0 and img1 with objects, img2 failed, doc.pdf page 1 ok, page 2 failed
    caption: str  # one caption, one failed item


def _extract_result(index: int, source: str, page: int | None, obj: Any,
                    custom_id: str | None = None) -> ItemResult:
    text = json.dumps(obj, ensure_ascii=False)
    return replace(result(index, source, page, text), json=obj, custom_id=custom_id)


@pytest.fixture
def jobs(redis_url: str, redis: Redis, tmp_path: Path) -> Iterator[Jobs]:
    client = Client(redis_url)
    keys = Keys()
    images = make_images(tmp_path / "in", 3)
    pdf = tmp_path / "in" / "doc.pdf"
    pdf.write_bytes(pdf_bytes(2))
    prepared = Prepared()
    for n, path in enumerate(images):
        prepared.add(check_file(path, source=path.name), [None],
                     custom_id=[FORMULA_ID, "r-2", None][n])
    prepared.add(check_file(pdf, source="doc.pdf"), [1, 2])
    opts = JobOptions(queue="ocr")
    with worker_lifecycle(redis, ["ocr"]) as life:
        job = client.submit("extract", prepared, opts.with_(schema=SCHEMA))
        running = life.take()
        assert running is not None and running.job_id == job.id
        for r in (_extract_result(0, "img0.png", None, OBJECTS[0], FORMULA_ID),
                  _extract_result(1, "img1.png", None, OBJECTS[1], "r-2"),
                  result(2, "img2.png", None, None, error=CUT),
                  _extract_result(3, "doc.pdf", 1, PAGE_OBJECT),
                  result(4, "doc.pdf", 2, None, error=CUT)):
            write_items(redis, keys, job.id, r)
        life.succeed(running, {"items": 5, "ok": 3, "failed": 2})

        cap = client.submit("caption", images[:2], opts)
        running = life.take()
        assert running is not None and running.job_id == cap.id
        write_items(redis, keys, cap.id, result(0, "img0.png", None, "-a red square"))
        write_items(redis, keys, cap.id, result(1, "img1.png", None, None,
                                               error="image: cannot decode"))
        life.succeed(running, {"items": 2, "ok": 1, "failed": 1})
        yield Jobs(extract=job.id, caption=cap.id)


def _cli(redis_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--redis-url", redis_url, *args],
                              catch_exceptions=False)


def _rows(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text, newline="")))


def test_jsonl_gives_every_item_its_object(redis_url: str, jobs: Jobs) -> None:
    res = _cli(redis_url, "result", jobs.extract)
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [line["json"] for line in lines] == [OBJECTS[0], OBJECTS[1], None, PAGE_OBJECT,
                                                None]
    assert json.loads(lines[0]["text"]) == OBJECTS[0]
    assert lines[2]["error"] == CUT and lines[0]["custom_id"] == FORMULA_ID
    # A caption job's lines have no json key: it is an extract item's field.
    caption = _cli(redis_url, "result", jobs.caption).stdout.splitlines()
    assert all("json" not in json.loads(line) for line in caption)


def test_csv_columns_are_the_objects_top_level_fields(redis_url: str, jobs: Jobs) -> None:
    res = _cli(redis_url, "result", jobs.extract, "--format", "csv")
    assert res.exit_code == 0, res.output
    text = res.stdout_bytes.decode("utf-8")  # Result.stdout would turn CRLF into \n
    header, *rows = _rows(text)
    assert header == ["source", "page", "custom_id", "vendor", "total", "lines", "note",
                      "extra_flag", "json.error", "error"]
    assert len(rows) == 5
    cols = [dict(zip(header, row, strict=True)) for row in rows]
    first, second, failed, page1, page2 = cols
    # A formula-looking custom_id is quoted for spreadsheets; CJK comes through as UTF-8.
    assert first["custom_id"] == "'" + FORMULA_ID
    assert first["vendor"] == "東京商店 Ünïcode" and first["total"] == "42.5"
    assert json.loads(first["lines"]) == OBJECTS[0]["lines"]
    assert first["lines"] == '[{"name":"bolt","qty":3}]'  # compact JSON
    assert first["note"] == OBJECTS[0]["note"]  # the newline kept inside the quoted cell
    assert '"line one\nline two, ""quoted"""' in text  # RFC 4180: quotes doubled
    assert first["extra_flag"] == "" and first["error"] == ""
    assert second["vendor"] == "<script>alert('x')</script>"
    assert second["total"] == "-3"  # a JSON number is never a formula
    assert (second["note"], second["json.error"]) == ("'@SUM(A1)", "'+1")
    assert second["extra_flag"] == "true"
    assert failed["error"] == CUT and failed["vendor"] == failed["total"] == ""
    assert (page1["source"], page1["page"], page1["vendor"]) == ("doc.pdf", "1", "ACME")
    assert page2["page"] == "2" and page2["error"] == CUT
    assert text.endswith("\r\n") and text.count("\r\n") == 6  # CRLF rows; the \n is a cell's


def test_csv_of_other_tasks_and_of_several_jobs(redis_url: str, jobs: Jobs) -> None:
    res = _cli(redis_url, "result", jobs.caption, "--format", "csv")
    assert _rows(res.stdout_bytes.decode()) == [["source", "page", "custom_id", "text", "error"],
                                 ["img0.png", "", "", "'-a red square", ""],
                                 ["img1.png", "", "", "", "image: cannot decode"]]
    # Several jobs: one table, one header, every job's columns.
    both = _cli(redis_url, "result", jobs.extract, jobs.caption, "--format", "csv")
    assert both.exit_code == 0, both.output
    header, *rows = _rows(both.stdout_bytes.decode())
    assert header[:4] == ["source", "page", "custom_id", "vendor"]
    assert header[-2:] == ["text", "error"] and header.count("source") == 1
    assert len(rows) == 7
    assert rows[-2][header.index("text")] == "'-a red square"
    assert rows[0][header.index("text")] == ""


def test_cli_and_dashboard_downloads_give_the_same_bytes(redis_url: str, jobs: Jobs,
                                                         tmp_path: Path) -> None:
    web = create_app(Settings(redis_url)).test_client()
    for fmt in ("csv", "jsonl", "json", "md", "txt"):
        resp = web.get(f"/jobs/{jobs.extract}/download.{fmt}")
        assert resp.status_code == 200, fmt
        res = _cli(redis_url, "result", jobs.extract, "--format", fmt)
        assert res.exit_code == 0, res.output
        assert res.stdout_bytes == resp.get_data(), fmt
        out = tmp_path / f"r.{fmt}"  # -o writes the same bytes (csv's CRLF untouched)
        assert _cli(redis_url, "result", jobs.extract, "--format", fmt, "-o",
                    str(out)).exit_code == 0
        assert out.read_bytes() == resp.get_data(), fmt
    assert web.get(f"/jobs/{jobs.extract}/download.csv").mimetype == "text/csv"


def test_export_writes_each_sources_objects_as_json(redis_url: str, jobs: Jobs,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = _cli(redis_url, "export", jobs.extract, "--dir", str(out))  # md by default
    assert res.exit_code == 1  # img2 failed
    assert f"img2.png: failed, not written: {CUT}" in res.stderr
    written = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert written == ["doc.pdf.json", "img0.png.json", "img1.png.json"]
    img0 = (out / "img0.png.json").read_text(encoding="utf-8")
    assert img0 == json.dumps(OBJECTS[0], indent=2, ensure_ascii=False) + "\n"
    assert "東京商店" in img0
    assert json.loads((out / "doc.pdf.json").read_text(encoding="utf-8")) == [
        {"page": 1, "json": PAGE_OBJECT}, {"page": 2, "error": CUT}]
    # A caption job beside it exports as before (<source>.txt).
    res = _cli(redis_url, "export", jobs.caption, "--dir", str(tmp_path / "cap"))
    assert (tmp_path / "cap" / "img0.png.txt").read_text() == "-a red square\n"


def test_dashboard_shows_the_object_pretty_printed_and_escaped(redis_url: str,
                                                               jobs: Jobs) -> None:
    web = create_app(Settings(redis_url)).test_client()
    page = web.get(f"/jobs/{jobs.extract}?item=1").get_data(as_text=True)
    pretty = json.dumps(OBJECTS[1], indent=2, ensure_ascii=False)
    assert f"<pre class=json>{escape(pretty)}</pre>" in page
    assert "<script>alert" not in page and "&lt;script&gt;alert(" in page
    # The items table's snippet is the compact JSON, escaped too.
    compact = json.dumps(OBJECTS[0], separators=(",", ":"), ensure_ascii=False)
    assert str(escape(compact)) in page
    failed = web.get(f"/jobs/{jobs.extract}?item=2").get_data(as_text=True)
    assert f"Error: {CUT}" in failed and "<pre class=json>" not in failed
