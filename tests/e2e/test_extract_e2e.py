"""Task extract end to end: the Python client, real Redis, a real worker and the tiny model.
Every value a worker returns validates against its job's schema; a value cut short fails."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from redis import Redis

from tests.support import helpers
from tests.support.schemas import INVOICE, PERSON, RECEIPT
from vlmq.producer.client import Client
from vlmq.producer.options import JobOptions
from vlmq.shared import constants as C
from vlmq.shared.messages import ItemResult


@pytest.fixture(scope="module")
def served(module_redis_url: str, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("extract")
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(helpers.start_worker(module_redis_url, tiny_model, tmp, "--max-batch", "6",
                                          name="wx"))
        yield module_redis_url, tmp
    finally:
        helpers.stop_all(procs)


def _inputs(tmp: Path) -> list[Path]:
    images = helpers.make_images(tmp / "receipts", 3)
    return [*images, helpers.make_pdf(tmp / "scan.pdf", 2)]


def _check(results: list[ItemResult], schema: dict[str, object]) -> None:
    for r in results:
        assert r.ok and r.finish_reason == "stop", r
        jsonschema.validate(r.json, schema)
        assert json.loads(r.text or "") == r.json


def test_each_item_gets_a_valid_object_and_mixed_jobs_share_the_worker(
        served: tuple[str, Path]) -> None:
    url, tmp = served
    paths = _inputs(tmp)
    opts = JobOptions(max_tokens=200, max_side=112)
    with Client(url) as client:
        jobs = [(client.extract(paths, schema=s, options=opts), s)
                for s in (RECEIPT, INVOICE, PERSON)]
        caption = client.caption(paths[:3], options=opts.with_(max_tokens=8))
        for job, schema in jobs:
            results = helpers.finished_results(client, job.id)
            assert [r.page for r in results] == [None, None, None, 1, 2]
            _check(results, schema)
            assert (job.summary() or {})["ok"] == 5
        plain = helpers.finished_results(client, caption.id)
        assert all(r.ok and r.json is None for r in plain)


def test_the_result_cache_keys_on_the_schema(served: tuple[str, Path]) -> None:
    url, tmp = served
    paths = _inputs(tmp)
    opts = JobOptions(max_tokens=200, max_side=112)
    with Client(url) as client:
        first = helpers.finished_results(client, client.extract(paths, RECEIPT, options=opts).id)
        again = helpers.finished_results(client, client.extract(paths, RECEIPT, options=opts).id)
        # Another schema's text (the first test ran INVOICE itself on these images).
        other = helpers.finished_results(client, client.extract(
            paths, {**INVOICE, "title": "invoice, v2"}, options=opts).id)
    assert all(r.result_cache_hit for r in again)
    assert [r.json for r in again] == [r.json for r in first]
    _check(again, RECEIPT)
    assert not any(r.result_cache_hit for r in other)
    _check(other, INVOICE)


def test_a_value_cut_at_max_tokens_fails_naming_the_fix(served: tuple[str, Path]) -> None:
    url, tmp = served
    with Client(url) as client:
        job = client.extract(_inputs(tmp)[:2], RECEIPT, max_tokens=5, max_side=112)
        results = helpers.finished_results(client, job.id)
    assert all(not r.ok and r.json is None and r.text is None for r in results)
    assert {r.error for r in results} == {
        "output cut at max_tokens before the JSON was complete: raise --max-tokens"}
    # The unfinished JSON stays beside the error (the OpenAI batch output's content),
    # never in `text` or `json`.
    for r in results:
        assert r.finish_reason == "length" and r.model_text
        with pytest.raises(json.JSONDecodeError):
            json.loads(r.model_text)


def test_a_schema_the_matcher_refuses_fails_the_job_from_any_producer(
        served: tuple[str, Path]) -> None:
    url, tmp = served
    conn = Redis.from_url(url)
    with Client(url) as client:
        blob = client.submit("caption", _inputs(tmp)[:1], JobOptions(max_tokens=2)).payload()
        item = blob.items[0].to_dict()
        job_id = helpers.raw_enqueue(conn, {
            "v": C.PROTOCOL_VERSION, "task": "extract", "items": [item],
            "schema": {"type": "string", "pattern": "(?<=a)b"}}, queue="extract")
        job = client.job(job_id)
        assert job.wait(timeout=120) == "failed"
        assert "look-around" in str(job.error()), job.error()
    conn.close()


def test_outputs_of_a_real_extract_job(served: tuple[str, Path], tmp_path: Path) -> None:
    import csv
    import io

    url, tmp = served
    with Client(url) as client:
        job = client.extract(_inputs(tmp), INVOICE, max_tokens=200, max_side=112)
        results = helpers.finished_results(client, job.id)
    res = helpers.invoke_cli(url, "result", job.id, "--format", "csv")
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO(res.output)))
    assert [r["source"] for r in rows] == [r.source for r in results]
    assert {"source", "page", "custom_id", "date", "number", "error"} <= set(rows[0])
    assert [r["date"] for r in rows] == [str((r.json or {})["date"]) for r in results]
    out = tmp_path / "export"
    res = helpers.invoke_cli(url, "export", job.id, "--dir", str(out))
    assert res.exit_code == 0, res.output
    pages = json.loads((out / "scan.pdf.json").read_text())
    assert [p["page"] for p in pages] == [1, 2] and pages[0]["json"] == results[3].json
    assert json.loads((out / "img0.png.json").read_text()) == results[0].json
