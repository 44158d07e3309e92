"""Many small jobs: taken, started and ended several per round trip, every guarantee kept;
an idle worker waits in a blocking pop; PDF render processes are up when it says ready."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest
from redis import Redis
from rq import Queue
from rq.job import Job
from rq.registry import FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from tests.support.helpers import (
    Spawn,
    finish,
    make_images,
    make_pdf,
    pdf_bytes,
    wait_for,
    worker_lifecycle,
)
from vlmq.producer.client import Client
from vlmq.shared import results
from vlmq.shared.keys import Keys
from vlmq.worker.jobs.rq_jobs import Refused, Running
from vlmq.worker.prep.render_pool import RenderPool

pytestmark = pytest.mark.slow


def events(redis: Redis, keys: Keys, job_id: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in body.items()}
            for _, body in redis.xrange(keys.job_events(job_id))]


def terminal(redis: Redis, keys: Keys, job_id: str) -> list[str]:
    """The terminal events of the job's stream; once the stream has expired (a minute after
    the end, on a loaded machine before the test reads it) the one its hash keeps."""
    if not redis.exists(keys.job_events(job_id)):
        end = results.read_end(redis, keys, job_id)
        return [] if end is None else [end["type"]]
    return [e["type"] for e in events(redis, keys, job_id) if e["type"] != "item"]


def stats(redis: Redis, keys: Keys, name: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in redis.hgetall(keys.worker_stats(name)).items()}


def blocked_in_blmove(redis: Redis) -> bool:
    """Some client of this test's db waits in BLMOVE (other dbs may have their own)."""
    db = str(redis.connection_pool.connection_kwargs.get("db", 0))
    return any(c.get("cmd") == "blmove" and str(c.get("db")) == db
               for c in redis.client_list())


def test_many_one_item_jobs_end_right_among_poison_deleted_and_canceled(
        redis_url: str, redis: Redis, keys: Keys, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    client = Client(redis_url)
    images = make_images(tmp_path / "imgs", 6)
    good = [client.caption([images[i % 6]], queue="small", max_side=64, max_tokens=4)
            for i in range(24)]
    deleted = client.caption([images[0]], queue="small", max_side=64, max_tokens=4)
    redis.delete(Keys.rq_job(deleted.id))  # its entry stays: the hash is gone
    canceled = client.caption([images[1]], queue="small", max_side=64, max_tokens=4)
    canceled.cancel()
    redis.rpush("rq:queue:small", canceled.id)  # a stale entry of a canceled job
    redis.rpush("rq:queue:small", b"\xff\xfe not text", "not:a:valid:id")
    redis.rpush("rq:queue:small", good[3].id)  # pushed twice: must run once

    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", "--queues",
                                  "small", "--max-batch", "8", name="small1"))
    assert rc == 0, out
    for job in good:
        assert job.status() == "finished", (job.id, out)
        assert terminal(redis, keys, job.id) == ["finished"]
        summary = job.summary() or {}
        assert (summary["items"], summary["ok"], summary["failed"]) == (1, 1, 0)
        assert [r.index for r in job.results()] == [0]
    # Six distinct images: the repeats are answered from the result cache, and the
    # summaries and the finish lines count them.
    hits = sum(int((j.summary() or {})["result_cache_hits"]) for j in good)
    assert hits > 0
    assert out.count("1 result-cache hits") == hits
    # The duplicate entry did not run it again: one item event (RQ keeps no Result for a
    # finished vlmq job since PROTOCOL.md revision 2, so RQ cannot count its runs).
    runs = [e["type"] for e in events(redis, keys, good[3].id)]
    assert runs.count("item") <= 1 and runs.count("finished") <= 1, runs

    assert canceled.status() == "canceled"
    assert terminal(redis, keys, canceled.id) == ["canceled"]
    dead = [json.loads(r) for r in redis.lrange(keys.dead, 0, -1)]
    reasons = " | ".join(d["reason"] for d in dead)
    assert len(dead) == 3, dead  # the missing hash and the two poison entries
    assert "hash is gone" in reasons and "not UTF-8" in reasons and "valid job id" in reasons

    queue = Queue("small", connection=redis, serializer=JSONSerializer)
    assert redis.llen(queue.key) == 0
    assert redis.llen(queue.intermediate_queue_key) == 0
    assert StartedJobRegistry(queue=queue).count == 0
    assert FinishedJobRegistry(queue=queue).count == len(good)
    assert redis.hget(Keys.rq_worker("small1"), "state") in (None, b"idle")

    # The same photos again: every item a result-cache hit, written and ended in batches.
    again = [client.caption([images[i % 6]], queue="small", max_side=64, max_tokens=4)
             for i in range(12)]
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", "--queues",
                                  "small", name="small2"))
    assert rc == 0, out
    for job in again:
        assert job.status() == "finished"
        assert (job.summary() or {})["result_cache_hits"] == 1
        assert terminal(redis, keys, job.id) == ["finished"]
    assert "0 vision-cache hits, 1 result-cache hits" in out
    assert int(stats(redis, keys, "small2")["result_cache_hits"]) == 12


def test_take_many_keeps_queue_priority_and_starts_each_job_once(
        redis: Redis, keys: Keys, tmp_path: Path, redis_url: str) -> None:
    client = Client(redis_url)
    images = make_images(tmp_path / "imgs", 2)
    low = [client.caption(images, queue="low").id for _ in range(2)]
    high = [client.caption(images, queue="high").id for _ in range(2)]
    redis.rpush("rq:queue:high", high[0])  # the same id twice in one batch
    with worker_lifecycle(redis, ["high", "low"]) as life:
        taken, empty = life.take_many(3)
        assert not empty
        assert [t.job_id for t in taken] == [*high, low[0]]
        assert all(isinstance(t, Running) for t in taken)
        assert Job.fetch(high[0], connection=redis,
                         serializer=JSONSerializer).get_status() == "started"
        rest, empty = life.take_many(8, block_s=0.5)  # several queues: never blocks
        assert [t.job_id for t in rest] == [low[1]] and empty
        assert redis.llen("rq:queue:high:intermediate") == 0
        whys = life.succeed_many([(t, {"items": 2}) for t in [*taken, *rest]
                                  if isinstance(t, Running)])
        assert whys == [None] * 4
    for jid in [*high, *low]:
        assert Job.fetch(jid, connection=redis, serializer=JSONSerializer).get_status() \
            == "finished"
        assert terminal(redis, keys, jid) == ["finished"]


def test_succeed_many_ends_only_the_jobs_still_ours(redis: Redis, keys: Keys,
                                                    tmp_path: Path, redis_url: str) -> None:
    client = Client(redis_url)
    images = make_images(tmp_path / "imgs", 1)
    ids = [client.caption(images, queue="q").id for _ in range(3)]
    with worker_lifecycle(redis, ["q"]) as life:
        taken, _ = life.take_many(3)
        running = [t for t in taken if isinstance(t, Running)]
        assert len(running) == 3
        client.cancel(ids[1])  # canceled while it runs
        redis.delete(keys.job_items(ids[2]))
        whys = life.succeed_many([(r, {"items": 1}) for r in running], require_items=True)
        assert whys[1] == "canceled"
        assert whys[0] == whys[2] == "item results missing"  # no item stored yet
        assert [Job.fetch(i, connection=redis, serializer=JSONSerializer).get_status()
                for i in ids] == ["started", "canceled", "started"]
        whys = life.succeed_many([(running[0], {"items": 1}), (running[2], {"items": 1})])
        assert whys == [None, None]
    assert terminal(redis, keys, ids[0]) == ["finished"]
    assert terminal(redis, keys, ids[1]) == ["canceled"]


def test_a_single_queue_is_waited_on_with_a_blocking_pop(redis: Redis, tmp_path: Path,
                                                         redis_url: str) -> None:
    client = Client(redis_url)
    images = make_images(tmp_path / "imgs", 1)
    pushed: list[str] = []

    def push_once_blocked() -> None:
        wait_for(lambda: blocked_in_blmove(redis), 300, "the worker's blocking pop")
        pushed.append(client.caption(images, queue="one").id)

    with worker_lifecycle(redis, ["one"]) as life:
        pusher = threading.Thread(target=push_once_blocked)
        pusher.start()
        taken: list[Running | Refused] = []
        for _ in range(600):  # each wait is at most 0.5 s; the push comes within seconds
            taken, empty = life.take_many(4, block_s=0.5)
            if taken:
                break
        pusher.join()
        assert [t.job_id for t in taken] == pushed and not empty
        assert redis.llen("rq:queue:one:intermediate") == 0  # started: out of the list


def test_idle_worker_blocks_takes_a_pushed_job_and_stops_promptly(
        redis_url: str, redis: Redis, keys: Keys, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    proc = start_worker(redis_url, tiny_model, tmp_path, "--queues", "idle", name="idle1")
    wait_for(lambda: bool(stats(redis, keys, "idle1")), 120, "the worker to be ready")
    wait_for(lambda: blocked_in_blmove(redis), 300, "the idle worker's blocking pop")
    client = Client(redis_url)
    job = client.caption(make_images(tmp_path / "imgs", 1), queue="idle", max_side=64,
                         max_tokens=4)
    wait_for(lambda: job.status() == "finished", 300, "the pushed job to finish")
    wait_for(lambda: blocked_in_blmove(redis), 300, "the worker to block again")
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc, timeout=300)
    assert rc == 0, out
    assert "worker idle1 stopped" in out


def test_render_processes_are_up_when_the_worker_says_ready(
        redis_url: str, redis: Redis, keys: Keys, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    proc = start_worker(redis_url, tiny_model, tmp_path, "--queues", "warm",
                        "--render-procs", "2", name="warm1")
    wait_for(lambda: bool(stats(redis, keys, "warm1")), 120, "the worker to be ready")
    first = stats(redis, keys, "warm1")
    assert int(first["render_procs"]) == 2 and int(first["pdf_renders"]) == 0
    job = Client(redis_url).ocr([make_pdf(tmp_path / "doc.pdf", 2)], queue="warm",
                                max_side=64, max_tokens=4)
    wait_for(lambda: job.status() == "finished", 300, "the PDF job")
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc, timeout=300)
    assert rc == 0, out


def test_render_pool_warm_starts_every_child_and_renders_reuse_them() -> None:
    pool = RenderPool(2)
    try:
        assert pool.pids == []
        pool.warm()
        pids = sorted(pool.pids)
        assert len(pids) == 2
        img = pool.render(pdf_bytes(2), 1, 64, doc_key="doc")
        assert max(img.size) <= 64
        assert sorted(pool.pids) == pids  # no child started for the first page
        pool.warm()  # idempotent: running children are kept
        assert sorted(pool.pids) == pids
    finally:
        pool.close()
