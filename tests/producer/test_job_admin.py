"""Job management on a real worker: jobs, group status, cancel, retry, delete, through
the CLI and the Python client (same names)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.helpers import finish, make_images, make_pdf, wait_for
from vlmq.producer import Client, JobOptions
from vlmq.shared.blobs import sha256_hex
from vlmq.shared.keys import Keys

pytestmark = pytest.mark.slow
FAST = JobOptions(max_side=112, max_tokens=4)


@pytest.fixture
def run(run_cli):
    """Every command here is expected to succeed unless the call says `code=`."""
    return functools.partial(run_cli, code=0)


def corrupt(redis: Redis, path: Path) -> str:
    """Swap a blob's bytes: the worker then fails that item (hash mismatch), only it."""
    sha = sha256_hex(path.read_bytes())
    redis.set(Keys().blob(sha), b"not the bytes that were hashed")
    return sha


def test_jobs_group_status_retry_and_delete(redis_url: str, redis: Redis, tiny_model: Path,
                                           tmp_path: Path, run, procs) -> None:
    client = Client(redis_url)
    images = make_images(tmp_path / "imgs", 3)
    pdf = make_pdf(tmp_path / "doc.pdf", 2)
    nov = FAST.with_(labels={"batch": "nov"})
    a = client.caption(images, options=nov)
    b = client.submit("ocr", [pdf], nov.with_(labels={"batch": "nov", "part": "2"}))
    other = client.caption(images[:1], options=FAST.with_(labels={"batch": "dec"}))
    sha = corrupt(redis, images[1])  # a's item 1 fails

    listed = json.loads(run("jobs", "--json").stdout)
    assert [r["id"] for r in listed] == [other.id, b.id, a.id]  # newest first
    assert listed[1] | {"age_s": 0} == {
        "id": b.id, "queue": "ocr", "task": "ocr", "status": "queued",
        "created_at": listed[1]["created_at"], "done": 0, "failed": 0, "total": 2,
        "labels": {"batch": "nov", "part": "2"}, "age_s": 0}
    assert [r.id for r in client.jobs(labels={"batch": "nov"}, limit=1)] == [b.id]
    assert "no jobs" in run("jobs", "--queue", "nowhere").stdout

    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst",
                                      "--max-batch", "4"))
    rc, out = finish(procs[-1])
    assert rc == 0, out

    group = json.loads(run("status", "--label", "batch=nov", "--json").stdout)
    assert group == {"labels": {"batch": "nov"}, "jobs": 2, "by_status": {"finished": 2},
                     "items": {"done": 5, "failed": 1, "total": 5}}
    assert client.group_status({"batch": "nov"}) == group
    text = run("status", "--label", "batch=nov").stdout
    assert "2 job(s)" in text and "items: 5/5 done, 1 failed" in text
    table = run("jobs", "--status", "finished", "--label", "batch=nov").stdout
    assert a.id in table and b.id in table and other.id not in table
    assert "3/1/3" in table  # a: done/failed/total

    # retry --failed-only: a new job with only the failed item, same settings, retry_of.
    redis.set(Keys().blob(sha), images[1].read_bytes())  # the input is good again
    new_id = run("retry", a.id, "--failed-only").stdout.strip()
    retry = client.job(new_id)
    assert retry.items == 1 and retry.labels == {"batch": "nov", "retry_of": a.id}
    assert json.loads(run("retry", a.id, "--failed-only", "--json").stdout)["blobs"] == 1
    client.job(next(r.id for r in client.jobs(limit=1))).delete()  # that second copy
    assert retry.payload().items[0].source == images[1].name
    assert retry.payload().get("max_tokens") == 4 and retry.payload().get("max_side") == 112
    full = a.retry()  # the client's name for it: every item
    assert full.items == 3 and full.labels["retry_of"] == a.id
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst",
                                      name="w2"))
    rc, out = finish(procs[-1])
    assert rc == 0, out
    assert retry.status() == "finished" and [r.ok for r in retry.results()] == [True]

    # delete: job, items and events go; --purge-blobs keeps the blobs a job still holds
    # (queued, running or failed: shared/blobs.py). A finished job let go of its inputs
    # when it ended (they expire after keep_inputs), so they are purged with a and b.
    keeper = client.caption(images[:2], options=FAST, queue="later")
    res = json.loads(run("delete", a.id, b.id, "--purge-blobs", "--json").stdout)
    assert res == {"deleted": [a.id, b.id], "blobs_purged": 2}  # the PDF and image 2
    for job_id in (a.id, b.id):
        assert not redis.exists(Keys.rq_job(job_id), Keys().job_items(job_id),
                                Keys().job_events(job_id), f"rq:results:{job_id}")
    assert not redis.exists(Keys().blob(sha256_hex(pdf.read_bytes())))
    assert not redis.exists(Keys().blob(sha256_hex(images[2].read_bytes())))
    assert all(redis.exists(Keys().blob(sha256_hex(p.read_bytes()))) for p in images[:2])
    assert "not found" in run("delete", "nope", a.id, code=1).stderr
    assert full.delete(purge_blobs=True) == 0  # image 2 is gone; keeper holds 0 and 1
    assert {r.id for r in client.jobs()} == {keeper.id, other.id, retry.id}
    keeper.delete(purge_blobs=True)
    assert not any(redis.exists(Keys().blob(sha256_hex(p.read_bytes()))) for p in images)


def test_cancel_queued_and_running_jobs(redis_url: str, redis: Redis, tiny_model: Path,
                                        tmp_path: Path, run, procs) -> None:
    client = Client(redis_url)
    images = make_images(tmp_path / "imgs", 12)
    queued = client.caption(images[:1], options=FAST, queue="later")
    run("cancel", queued.id)
    assert queued.status() == "canceled"
    assert redis.llen("rq:queue:later") == 0
    events = redis.xrange(Keys().job_events(queued.id))
    assert [e[1][b"type"] for e in events] == [b"canceled"]
    res = run("cancel", queued.id, code=1)
    assert "already canceled" in res.stdout

    slow = client.caption(images, options=JobOptions(max_side=112, max_tokens=64))
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--max-batch", "2"))
    wait_for(lambda: slow.progress()[0] >= 1, 180, "the first item")
    stats = Keys().worker_stats("w1")

    def report() -> dict[str, float]:  # the worker's last published stats
        return {k.decode(): float(v) for k, v in redis.hgetall(stats).items()
                if k in (b"uptime_s", b"jobs_in_flight")}

    before = report().get("uptime_s", -1.0)
    slow.cancel()
    assert slow.status() == "canceled"
    # The worker drops it at its next ownership check: a report made after the cancel says
    # it holds no job, and by its next report the count has not grown.
    wait_for(lambda: report().get("uptime_s", -1.0) > before
             and report().get("jobs_in_flight") == 0, 300,
             "the worker to drop the canceled job")
    dropped_at = report()["uptime_s"]
    done = slow.progress()[0]
    wait_for(lambda: report().get("uptime_s", -1.0) > dropped_at, 300,
             "the worker's next report")
    assert slow.progress()[0] == done < 12
    assert all(r.ok for r in slow.results())  # what was done stays readable
    types = [e[1][b"type"] for e in redis.xrange(Keys().job_events(slow.id))]
    assert types.count(b"canceled") == 1
    assert slow.status() == "canceled"
    assert "already canceled" in json.loads(run("cancel", slow.id, "--json",
                                                code=1).stdout)[slow.id]
