"""Execution fencing and completeness, end to end: real Redis, real worker processes, the
real tiny model. A worker that stalled past its heartbeat and lost its job to another
writes nothing more for it; a job whose stored results vanished mid-run finishes only
once every item has a result again."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest
from redis import Redis

from tests.support.helpers import Output, Spawn, finish, make_pdf, wait_for
from vlmq.producer.client import Client
from vlmq.shared.keys import Keys

pytestmark = pytest.mark.slow
TERMINAL = {b"finished", b"failed", b"canceled"}


def item_events(redis: Redis, job_id: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return list(redis.xrange(Keys().job_events(job_id)))


def owner(redis: Redis, job_id: str) -> str:
    raw = redis.get(Keys().job_owner(job_id))
    return raw.decode().split(" ", 1)[1] if raw else ""


def test_a_stalled_worker_writes_nothing_into_a_job_another_worker_took(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    pages = 16
    job = Client(redis_url).ocr([make_pdf(tmp_path / "doc.pdf", pages)], max_side=112,
                                max_tokens=24)
    first = start_worker(redis_url, tiny_model, tmp_path / "a", "--max-batch", "2",
                         "--heartbeat-ttl", "3", name="first")
    first_out = Output(first)
    wait_for(lambda: job.progress()[0] >= 2, 300, "the first worker's first items")
    os.kill(first.pid, signal.SIGSTOP)  # stalled mid-job, items in flight
    stalled_at = job.progress()[0]
    second = start_worker(redis_url, tiny_model, tmp_path / "b", "--max-batch", "2",
                          "--heartbeat-ttl", "3", name="second")
    # RQ's cleanup (run by the second worker) requeues the job once the first worker's
    # heartbeat TTL has passed, and the second worker takes it.
    wait_for(lambda: owner(redis, job.id) == "second", 300, "the second worker to take over")
    wait_for(lambda: job.progress()[0] >= stalled_at + 2, 300, "the second worker's items")
    os.kill(first.pid, signal.SIGCONT)  # wakes up with results of a job that is not its own
    wait_for(lambda: job.status() == "finished", 300, "the job to finish")
    # Stopped only once the first worker has met the job it lost and dropped it: whatever
    # late write it would make, it has tried.
    first_out.wait_for(f"job {job.id} dropped (")
    os.kill(second.pid, signal.SIGTERM)
    os.kill(first.pid, signal.SIGTERM)
    rc_first, out_first = first_out.finish()
    rc_second, out_second = finish(second)
    assert rc_first == 0 and rc_second == 0, out_first + out_second

    assert redis.hlen(Keys().job_items(job.id)) == pages
    events = item_events(redis, job.id)
    types = [f[b"type"] for _, f in events]
    assert [t for t in types if t in TERMINAL] == [b"finished"]
    assert types[-1] == b"finished", "something was written after the terminal event"
    per_item = Counter(int(f[b"index"]) for _, f in events if f[b"type"] == b"item")
    assert per_item == Counter(range(pages)), per_item  # one item event per item
    assert job.summary()["ok"] == pages
    assert f"job {job.id} dropped (taken over by worker second)" in out_first \
        or f"job {job.id} dropped (finished)" in out_first, out_first
    assert f"job {job.id} finished" in out_second and f"job {job.id} finished" not in out_first


def test_items_whose_results_vanished_are_computed_again_before_the_job_finishes(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    pages = 10
    job = Client(redis_url).ocr([make_pdf(tmp_path / "doc.pdf", pages)], max_side=112,
                                max_tokens=16)
    proc = start_worker(redis_url, tiny_model, tmp_path, "--burst", "--max-batch", "2")
    wait_for(lambda: job.progress()[0] >= 3, 120, "three items done")
    redis.delete(Keys().job_items(job.id))  # the stand-in for eviction or a failover
    rc, out = finish(proc, timeout=180)
    assert rc == 0, out
    assert "vanished from Redis" in out
    assert job.status() == "finished"
    assert [r.index for r in job.results()] == list(range(pages))
    assert job.summary()["ok"] == pages and job.summary()["failed"] == 0
