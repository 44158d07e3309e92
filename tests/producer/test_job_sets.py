"""Sets of any size: batches of jobs, one batch id for every job command, one batch end."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from redis import Redis

from tests.support.helpers import finish, make_images
from tests.support.pdf_craft import build_pdf
from vlmq.producer.client import Client, Job
from vlmq.producer.inputs import prepare
from vlmq.producer.job_admin import CannotCancel
from vlmq.producer.job_sets import JOB_ITEMS, Batch, split_items
from vlmq.producer.ops.schedules import Schedule, ScheduleStore
from vlmq.shared import constants as C
from vlmq.shared import lua
from vlmq.shared.enqueue import fail_job, fetch_job
from vlmq.shared.errors import InputError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import Item, ItemResult
from vlmq.shared.results import end_job_event

Run = Callable[..., Result]


def blank_pdf(path: Path, pages: int, side: int = 200) -> Path:
    """A PDF of `pages` empty pages: thousands of pages in a few hundred KB, checked fast."""
    kids = b" ".join(b"%d 0 R" % (i + 3) for i in range(pages))
    page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %d %d] >>" % (side, side)
    path.write_bytes(build_pdf([b"<< /Type /Catalog /Pages 2 0 R >>",
                                b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % pages,
                                *([page] * pages)]))
    return path


def _json(res: Result) -> Any:
    return json.loads(res.stdout)


def _write_results(redis: Redis, keys: Keys, job: Job, *, fail_index: int | None = None
                   ) -> None:
    """Item results as a worker writes them, without a worker (the set is 12,000 pages):
    the job taken (started, owned) and its results written by write_items.lua, so the
    running counts move as they do under a worker."""
    token = f"test-{job.id}"
    redis.hset(Keys.rq_job(job.id), "status", "started")
    redis.set(keys.job_owner(job.id), token)
    args: list[str | int] = [token, C.RESULT_TTL_S, C.EVENTS_MAXLEN]
    for i, item in enumerate(job.payload().items):
        bad = i == fail_index
        res = ItemResult(
            index=i, source=item.source, page=item.page, text=None if bad else
            f"{item.source} p{item.page}", finish_reason="error" if bad else "stop",
            error="unreadable" if bad else None, prompt_tokens=1, completion_tokens=1,
            vision_cache_hit=False)
        args += [res.index, res.to_json(), int(res.ok)]
    written = lua.script(redis, lua.WRITE_ITEMS)(
        keys=[Keys.rq_job(job.id), keys.job_owner(job.id), keys.job_items(job.id),
              keys.job_events(job.id)], args=args)
    assert written == 1


def _events(redis: Redis, keys: Keys, batch_id: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()}
            for _, fields in redis.xrange(keys.batch_events(batch_id))]


def test_split_keeps_a_files_pages_together() -> None:
    items = [Item(kind="pdf", blob="a" * 64, source=name, page=p)
             for name, n in (("a", 3), ("b", 4), ("c", 2), ("d", 7)) for p in range(1, n + 1)]
    jobs = split_items(items, 5)
    assert [(j[0].source, j[0].page) for j in jobs] == [
        ("a", 1), ("b", 1), ("c", 1), ("d", 1), ("d", 6)]
    assert [len(j) for j in jobs] == [3, 4, 2, 5, 2]
    assert [i for j in jobs for i in j] == items  # nothing lost, order kept


def test_split_keeps_each_jobs_uploads_under_the_byte_bound() -> None:
    shas = {name: name * 64 for name in "abcd"}
    items = [Item(kind="pdf", blob=shas[name], source=name, page=p)
             for name, n in (("a", 2), ("b", 1), ("c", 3), ("d", 1)) for p in range(1, n + 1)]
    sizes = {shas["a"]: 40, shas["b"]: 40, shas["c"]: 90, shas["d"]: 10}
    jobs = split_items(items, 500, max_bytes=100, blob_sizes=sizes)
    assert [[i.source for i in j] for j in jobs] == [["a", "a", "b"], ["c", "c", "c", "d"]]
    assert split_items(items, 500) == [items]  # no bound: one job
    big = split_items(items, 500, max_bytes=5, blob_sizes=sizes)  # each file alone
    assert [j[0].source for j in big] == ["a", "b", "c", "d"]


def test_a_12000_page_folder_enqueues_as_a_batch_and_every_command_takes_its_id(
        run_cli: Run, redis_url: str, redis: Redis, keys: Keys, tmp_path: Path) -> None:
    folder = tmp_path / "scans"
    folder.mkdir()
    for n, name in enumerate("abc"):
        blank_pdf(folder / f"{name}.pdf", 4000, side=200 + n)
    out = _json(run_cli("enqueue", "ocr", str(folder), "--json", "--label", "run=big",
                        code=0))
    batch_id = out["batch"]
    assert batch_id.startswith("b-") and out["id"] == batch_id and out["items"] == 12000
    assert len(out["jobs"]) == 12000 // JOB_ITEMS
    assert all(j["items"] == JOB_ITEMS and j["queue"] == "ocr" for j in out["jobs"])
    assert out["blobs"] == 3 and out["uploaded"] == 3
    job_ids = [j["id"] for j in out["jobs"]]
    assert [j.decode() for j in redis.lrange(keys.batch_jobs(batch_id), 0, -1)] == job_ids
    record = redis.hgetall(keys.batch(batch_id))
    assert record[b"items"] == b"12000" and record[b"task"] == b"ocr"
    assert json.loads(record[b"labels"]) == {"run": "big"}

    client = Client(redis_url)
    batch = client.batch(batch_id)
    jobs = batch.jobs()
    for job in jobs:  # a job's items are pages of one PDF, in order
        payload = job.payload()
        assert payload.settings["batch"] == batch_id
        assert len({i.source for i in payload.items}) == 1
    status = _json(run_cli("status", batch_id, "--json", code=0))
    assert status["by_status"] == {"queued": 24} and status["items"]["total"] == 12000
    assert status["status"] == "queued" and status["missing"] == 0  # no worker yet
    run_cli("wait", batch_id, "--timeout", "0.2", code=124)

    for n, job in enumerate(jobs):
        _write_results(redis, keys, job, fail_index=7 if n == 3 else None)
    status = _json(run_cli("status", batch_id, "--json", code=0))
    assert status["items"] == {"done": 12000, "failed": 1, "total": 12000}
    lines = [json.loads(line) for line in
             run_cli("result", batch_id, "--format", "jsonl").stdout.splitlines()]
    assert [(r["source"], r["page"]) for r in lines] == [
        (f"{name}.pdf", p) for name in "abc" for p in range(1, 4001)]
    run_cli("export", batch_id, "--dir", str(tmp_path / "out"))
    doc = (tmp_path / "out" / "b.pdf.md").read_text()
    assert doc.count("<!-- page ") == 4000 and "b.pdf p4000" in doc  # one file, 8 jobs

    assert "canceled" in run_cli("cancel", batch_id, code=0).stdout
    run_cli("wait", batch_id, code=1)
    events = _events(redis, keys, batch_id)
    assert len(events) == 1 and events[0]["type"] == "canceled"
    assert events[0]["canceled"] == "24" and events[0]["jobs"] == "24"

    again = _json(run_cli("retry", batch_id, "--failed-only", "--json", code=0))
    assert again["batch"] is None and again["items"] == 1  # one job: a job id
    assert client.job(again["id"]).labels["retry_of"] == batch_id

    run_cli("delete", batch_id, code=0)
    assert not redis.exists(keys.batch(batch_id), keys.batch_jobs(batch_id),
                            *(Keys.rq_job(j) for j in job_ids))
    run_cli("status", batch_id, code=1)


def test_a_batch_ends_once_whoever_ends_its_last_job(redis_url: str, redis: Redis,
                                                     keys: Keys, tmp_path: Path) -> None:
    make_images(tmp_path / "in", 5)
    client = Client(redis_url)
    batch = client.submit_set("caption", [tmp_path / "in"], job_size=2)
    assert isinstance(batch, Batch)
    first, second, third = batch.jobs()
    assert [j.items for j in (first, second, third)] == [2, 2, 1]
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.done_channel)

    first.cancel()
    with pytest.raises(CannotCancel):
        first.cancel()
    second.delete()  # a queued job deleted counts as canceled
    first.delete()  # ended and counted already: not again
    # Not ended: the job left waits, and no worker has started any (the others are gone).
    assert batch.ended() is None and batch.status()["status"] == "queued"
    third.cancel()
    rq_job = fetch_job(redis, third.id)  # a second writer of the same end writes nothing
    end_job_event(redis, keys, third.id, "canceled", queue=rq_job.origin, ttl_s=60)
    events = _events(redis, keys, batch.id)
    assert len(events) == 1
    assert {k: events[0][k] for k in ("type", "jobs", "finished", "failed", "canceled")} == {
        "type": "canceled", "jobs": "3", "finished": "0", "failed": "0", "canceled": "3"}
    published = []
    deadline = time.monotonic() + 5
    while len(published) < 4 and time.monotonic() < deadline:  # 3 jobs, then the batch
        msg = pubsub.get_message(timeout=0.5)
        if msg is not None:
            published.append(json.loads(msg["data"]))
    pubsub.close()
    assert published[-1] == {"id": batch.id, "status": "canceled", "batch": True}
    assert [m.get("batch") for m in published] == [None, None, None, True]
    assert batch.wait(timeout=5) == "canceled"


def test_a_failed_job_makes_the_batch_failed(redis_url: str, redis: Redis, keys: Keys,
                                             tmp_path: Path) -> None:
    make_images(tmp_path / "in", 2)
    batch = Client(redis_url).submit_set("caption", [tmp_path / "in"], job_size=1)
    assert isinstance(batch, Batch)
    one, two = batch.jobs()
    pipe = redis.pipeline(transaction=True)
    fail_job(pipe, keys, fetch_job(redis, one.id), "caption", "model exploded")
    pipe.execute()
    assert batch.ended() is None
    two.cancel()
    end = batch.ended()
    assert end is not None and end["type"] == "failed" and end["failed"] == "1"


def test_a_job_id_names_one_job_and_the_manifest_makes_one_batch(
        run_cli: Run, tmp_path: Path) -> None:
    make_images(tmp_path / "in", 3)
    run_cli("enqueue", "caption", str(tmp_path / "in"), "--job-size", "2", "--job-id",
            "mine", code=2)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(
        json.dumps({"custom_id": f"r{i}", "task": "caption", "file": f"in/img{i}.png"}) + "\n"
        for i in range(3)))
    out = _json(run_cli("enqueue", "--manifest", str(manifest), "--job-size", "2", "--json",
                        code=0))
    assert out["batch"].startswith("b-") and [j["items"] for j in out["jobs"]] == [2, 1]
    text = run_cli("enqueue", "--manifest", str(manifest), "--job-size", "2", code=0)
    assert text.stdout.strip().startswith("b-")


def test_a_schedule_run_enqueues_everything_due_as_one_batch(
        redis_url: str, redis: Redis, keys: Keys, tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    blank_pdf(tmp_path / "docs" / "long.pdf", 1200)
    client = Client(redis_url)
    store = ScheduleStore(client)
    store.add(Schedule(name="night", task="ocr", paths=(str(tmp_path / "docs"),),
                       every=3600))
    run = store.run("night")
    assert run["status"] == "enqueued" and run["items"] == 1200 and "deferred" not in run
    batch = client.batch(run["batch"])
    assert run["job_id"] == batch.id and run["jobs"] == [j.id for j in batch.jobs()]
    first = batch.jobs()[0]
    _write_results(redis, keys, first)
    batch.cancel()
    store.finish_pending("night")
    done = next(r for r in store.history("night") if r["id"] == run["id"])
    assert done["status"] == "canceled" and done["ok"] == JOB_ITEMS, done
    again = store.run("night")  # only the pages with no result are due again
    assert again["items"] == 1200 - JOB_ITEMS and again["skipped"] == JOB_ITEMS


def test_a_worker_runs_a_small_batch_to_its_end(
        run_cli: Run, redis_url: str, redis: Redis, keys: Keys, tiny_model: Path,
        tmp_path: Path, start_worker: Callable[..., Any]) -> None:
    make_images(tmp_path / "in", 3)
    batch_id = run_cli("enqueue", "caption", str(tmp_path / "in"), "--job-size", "1",
                       "--max-tokens", "4", code=0).stdout.strip()
    assert batch_id.startswith("b-")
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst",
                                  "--queues", "caption"))
    assert rc == 0, out
    assert "finished" in run_cli("wait", batch_id, code=0).stdout
    events = _events(redis, keys, batch_id)
    assert len(events) == 1 and events[0]["type"] == "finished"
    assert events[0]["finished"] == "3"
    lines = run_cli("result", batch_id, "--format", "jsonl", code=0).stdout.splitlines()
    assert [json.loads(line)["source"] for line in lines] == ["img0.png", "img1.png",
                                                              "img2.png"]


def test_jobs_a_failed_enqueue_never_made_are_counted_out(
        redis_url: str, redis: Redis, keys: Keys, tmp_path: Path) -> None:
    paths = make_images(tmp_path / "in", 3)
    client = Client(redis_url)
    prepared = prepare([tmp_path / "in"], limit=None)
    paths[1].write_bytes(paths[0].read_bytes())  # changed since it was checked
    with pytest.raises(InputError, match="changed since it was validated"):
        client.submit_set("caption", prepared, job_size=1)
    (batch_id,) = (k.decode().split(":")[2] for k in redis.scan_iter("vlmq:batch:*:jobs"))
    batch = client.batch(batch_id)
    assert [j.items for j in batch.jobs()] == [1] and batch.missing() == []
    batch.jobs()[0].cancel()
    end = batch.ended()
    assert end is not None and end["type"] == "canceled" and end["canceled"] == "3"
