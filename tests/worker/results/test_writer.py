"""The result writer against real Redis and the real RQ lifecycle (no model): what it
stores for items and job ends, and that it never writes for a job it no longer owns."""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import Iterator

import pytest
from redis import Redis

from tests.support.factories import job_payload
from tests.support.helpers import abandoned, wait_for
from vlmq.shared import constants as C
from vlmq.shared import results
from vlmq.shared.enqueue import enqueue, fetch_job
from vlmq.shared.keys import Keys
from vlmq.worker.engine.batcher import Finished
from vlmq.worker.item_order import ItemOrder
from vlmq.worker.jobs.rq_jobs import INCOMPLETE, BatchWorker, JobLifecycle, Running
from vlmq.worker.results.writer import ResultWriter
from vlmq.worker.stats import WorkerStats


def events(redis: Redis, keys: Keys, job_id: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()}
            for _, fields in redis.xrange(keys.job_events(job_id))]


def done(job_id: str, idx: int, text: str = "t") -> Finished:
    return Finished(key=(job_id, idx), text=text, finish_reason="stop", prompt_tokens=3,
                    completion_tokens=2, vision_cache_hit=False, error=None, timings={})


class Rig:
    """One worker's lifecycle, order and writer, as WorkerLoop wires them."""

    def __init__(self, redis: Redis, keys: Keys, name: str) -> None:
        self.redis = redis
        self.keys = keys
        worker = BatchWorker(["ocr"], connection=redis, name=name)
        self.life = JobLifecycle(worker)
        self.life.register_birth()
        self.order: ItemOrder[Running] = ItemOrder()
        self.writer = ResultWriter(redis, keys, self.life, self.order,
                                   WorkerStats(name, 4, 8))

    def take(self) -> Running:
        running = self.life.take()
        assert isinstance(running, Running), running
        running.pending.extend(range(running.total))
        self.order.add(running)
        return running

    def run_items(self, state: Running, n: int) -> list[int]:
        """Schedule n items and record them as finished; returns their indexes."""
        out = []
        for _ in range(n):
            nxt = self.order.next_item()
            assert nxt is not None and nxt[0] is state
            self.writer.record_finished(state.job_id, nxt[1], done(state.job_id, nxt[1]), 0.1)
            out.append(nxt[1])
        return out


@pytest.fixture
def rig(redis: Redis, keys: Keys) -> Iterator[Rig]:
    r = Rig(redis, keys, f"w-{uuid.uuid4().hex[:6]}")
    yield r
    r.life.register_death()


def job(redis: Redis, n: int, labels: dict[str, str] | None = None) -> str:
    return enqueue(redis, job_payload(n, name="{}.png", **({"labels": labels} if labels else {})),
                   queue="ocr")


def test_items_are_written_once_with_one_event_each(redis, keys, rig):
    job_id = job(redis, 3)
    state = rig.take()
    rig.run_items(state, 2)
    # The same item coming back twice (e.g. from an execution this worker lost and took
    # back) is recorded once.
    assert not rig.writer.record_finished(job_id, 0, done(job_id, 0, "again"), 0.0)
    assert rig.writer.holding == 2
    rig.writer.flush()
    assert rig.writer.holding == 0 and state.finished_here == 2
    stored = results.read_items(redis, keys, job_id)
    assert [(r.index, r.text) for r in stored] == [(0, "t"), (1, "t")]
    assert [(e["type"], e["index"]) for e in events(redis, keys, job_id)] == [
        ("item", "0"), ("item", "1")]


def test_finish_stores_the_summary_and_a_json_terminal_event(redis, keys, rig):
    job_id = job(redis, 2, labels={"batch": "nov", "who": "o'neil"})
    state = rig.take()
    rig.run_items(state, 2)
    rig.writer.flush()
    rig.writer.finish_complete()
    assert job_id not in rig.order.jobs
    assert fetch_job(redis, job_id).get_status() == "finished"
    last = events(redis, keys, job_id)[-1]
    assert last["type"] == "finished"
    assert json.loads(last["labels"]) == {"batch": "nov", "who": "o'neil"}
    assert json.loads(last["summary"])["ok"] == 2


def test_fail_ends_the_job_with_the_plain_message_in_its_event(redis, keys, rig):
    job_id = job(redis, 2)
    state = rig.take()
    rig.run_items(state, 1)
    rig.writer.fail(state, "job timeout of 5 s exceeded")
    assert rig.writer.holding == 0 and job_id not in rig.order.jobs
    assert fetch_job(redis, job_id).get_status() == "failed"
    assert events(redis, keys, job_id)[-1] == {"type": "failed",
                                               "error": "job timeout of 5 s exceeded"}


def reclaim(redis: Redis) -> None:
    """What RQ's registry cleanup does once a stalled worker's heartbeat TTL has passed:
    the job is requeued (it has retries left)."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    Queue("ocr", connection=redis, serializer=JSONSerializer).started_job_registry.cleanup(
        timestamp=time.time() + 3600)


def test_a_worker_that_lost_its_job_writes_nothing_more(redis, keys, rig):
    job_id = job(redis, 3)
    stale = rig.take()
    rig.run_items(stale, 1)
    rig.writer.flush()  # item 0 written while the job was still ours
    reclaim(redis)  # this worker stalled past its heartbeat: RQ requeued the job ...
    other = Rig(redis, keys, f"w-{uuid.uuid4().hex[:6]}")
    fresh = other.take()  # ... and another worker took it
    assert fresh.pending == deque([0, 1, 2])  # (the rig resumes nothing; the worker does)

    rig.run_items(stale, 2)  # the stalled worker wakes up with items 1 and 2 done
    rig.writer.flush()
    assert job_id not in rig.order.jobs and rig.writer.holding == 0
    # Its heartbeat neither extends the job nor puts its stale wip entry back.
    assert rig.life.heartbeat([stale])[0][1].startswith("taken over by worker w-")
    assert rig.life.fail(stale, "late failure") is not None  # refused: not ours
    assert rig.life.requeue(stale) is not None
    assert [e["index"] for e in events(redis, keys, job_id)] == ["0"]

    fresh.pending = deque([1, 2])  # as the worker resumes: item 0 has a result
    other.run_items(fresh, 2)
    other.writer.flush()
    other.writer.finish_complete()
    evs = events(redis, keys, job_id)
    assert [e.get("index", e["type"]) for e in evs] == ["0", "1", "2", "finished"]
    assert fetch_job(redis, job_id).get_status() == "finished"
    assert redis.zcard("rq:wip:ocr") == 0  # no stale entry for the next cleanup to act on
    other.life.register_death()


def test_a_job_finishes_only_once_every_item_has_a_stored_result(redis, keys, rig):
    job_id = job(redis, 4)
    state = rig.take()
    rig.run_items(state, 2)
    rig.writer.flush()
    redis.delete(keys.job_items(job_id))  # evicted, or lost in a failover
    rig.run_items(state, 2)
    rig.writer.flush()
    rig.writer.finish_complete()
    assert fetch_job(redis, job_id).get_status() == "started"  # not finished: 0 and 1 missing
    assert list(state.pending) == [0, 1]
    rig.run_items(state, 2)
    rig.writer.flush()
    rig.writer.finish_complete()
    assert fetch_job(redis, job_id).get_status() == "finished"
    assert [r.index for r in results.read_items(redis, keys, job_id)] == [0, 1, 2, 3]
    assert json.loads(events(redis, keys, job_id)[-1]["summary"])["ok"] == 4


def test_every_end_publishes_once_and_only_the_kept_end_lives_with_the_job(redis, keys, rig):
    ok_id, bad_id = job(redis, 1), job(redis, 1)
    pubsub = redis.pubsub()
    pubsub.subscribe(keys.done_channel, keys.done_queue_channel("ocr"))
    ok, bad = rig.take(), rig.take()
    rig.run_items(ok, 1)
    rig.writer.flush()
    rig.writer.finish_complete()
    rig.writer.fail(bad, "no")
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 4 and time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=1)
        if msg and msg["type"] == "message":
            got.append((msg["channel"].decode(), json.loads(msg["data"])))
    pubsub.close()
    assert sorted(got, key=str) == sorted([
        (keys.done_channel, {"id": ok_id, "status": "finished"}),
        (keys.done_queue_channel("ocr"), {"id": ok_id, "status": "finished"}),
        (keys.done_channel, {"id": bad_id, "status": "failed"}),
        (keys.done_queue_channel("ocr"), {"id": bad_id, "status": "failed"})], key=str)
    for job_id in (ok_id, bad_id):
        job_ttl = redis.ttl(keys.rq_job(job_id))
        assert job_ttl > 0
        if job_id == ok_id:  # the failed one wrote no item
            assert abs(redis.ttl(keys.job_items(job_id)) - job_ttl) <= 2
        # the stream outlives the end by ENDED_EVENTS_S only; the end stays in the hash
        assert 0 < redis.ttl(keys.job_events(job_id)) <= C.ENDED_EVENTS_S
        end = results.read_end(redis, keys, job_id)
        assert end is not None and end["type"] == ("finished" if job_id == ok_id else "failed")
    assert not redis.exists(keys.rq_results(ok_id))  # the summary is in the hash alone


def test_a_job_canceled_through_rq_gets_one_canceled_event(redis, keys, rig):
    job_id = job(redis, 2)
    state = rig.take()
    rig.run_items(state, 1)
    fetch_job(redis, job_id).cancel()  # RQ's own API writes no vlmq event
    rig.writer.flush()  # finds the job is not ours: drops it, writes its canceled event
    assert job_id not in rig.order.jobs
    results.end_job_event(redis, keys, job_id, "canceled", queue="ocr", ttl_s=60)  # a 2nd canceler
    assert [e["type"] for e in events(redis, keys, job_id)] == ["canceled"]
    assert results.read_items(redis, keys, job_id) == []


def test_finishing_rechecks_completeness_in_the_same_transaction(redis, keys, rig):
    job_id = job(redis, 2)
    state = rig.take()
    rig.run_items(state, 2)
    rig.writer.flush()
    redis.hdel(keys.job_items(job_id), "1")  # vanishes after the writer read the items
    assert rig.life.succeed(state, {"items": 2}, require_items=True) == INCOMPLETE
    assert fetch_job(redis, job_id).get_status() == "started"
    assert [e["type"] for e in events(redis, keys, job_id)] == ["item", "item"]


def test_a_cancel_that_wrote_its_own_event_is_not_doubled(redis, keys, rig):
    """A canceler that added its `canceled` event without end_job.lua: the worker that
    drops the job finds the stream already ends with a terminal event."""
    job_id = job(redis, 2)
    rig.take()
    pipe = redis.pipeline(transaction=True)
    fetch_job(redis, job_id).cancel(pipeline=pipe)
    pipe.xadd(keys.job_events(job_id), {"type": "canceled"})
    pipe.execute()
    rig.writer.flush()
    rig.writer.drop(rig.order.jobs[job_id], "canceled")
    assert [e["type"] for e in events(redis, keys, job_id)] == ["canceled"]


def test_a_job_abandoned_with_no_retries_left_gets_its_failed_event(redis, keys):
    job_id = job(redis, 1)
    dead = Rig(redis, keys, f"dead-{uuid.uuid4().hex[:6]}")
    dead.life.worker.heartbeat_ttl = 1
    dead.take()
    redis.hset(keys.rq_job(job_id), "retries_left", 0)
    wait_for(lambda: abandoned(redis, "ocr", job_id), 120, "its execution to expire: the "
             "worker \"died\"")
    other = Rig(redis, keys, f"w-{uuid.uuid4().hex[:6]}")
    other.life.maintain()  # RQ's cleanup fails it; vlmq writes the terminal event
    other.life.worker.last_cleaned_at = None
    results.end_job_event(redis, keys, job_id, "failed", queue="ocr", ttl_s=60,
                          fields={"error": "again"})  # a second maintainer writes nothing more
    assert fetch_job(redis, job_id).get_status() == "failed"
    evs = events(redis, keys, job_id)
    assert [e["type"] for e in evs] == ["failed"] and "AbandonedJobError" in evs[0]["error"]
    other.life.register_death()


def test_a_job_whose_owner_key_expired_is_left_for_rq_to_requeue(redis, keys, rig):
    job_id = job(redis, 2)
    state = rig.take()
    rig.run_items(state, 1)
    redis.delete(keys.job_owner(job_id))  # expired while this worker stalled for long
    rig.writer.flush()
    assert job_id not in rig.order.jobs and results.read_items(redis, keys, job_id) == []
    # Its wip entry stays, so RQ's cleanup requeues the job and another worker resumes it.
    reclaim(redis)
    assert fetch_job(redis, job_id).get_status() == "queued"
