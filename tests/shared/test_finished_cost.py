"""A finished job's Redis cost follows its items, and its end can still be
followed: the events stream lives a minute after the end, the end itself as long as the
job hash (PROTOCOL.md sections 5 and 6). Bytes are counted with MEMORY USAGE, never timed."""

from __future__ import annotations

import json
import threading
from typing import Any

from redis import Redis
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from benchmarks.job_bytes import measure
from tests.support.factories import SHA, job_payload
from tests.support.helpers import following_events, wait_for, worker_lifecycle
from vlmq.producer.client import Client
from vlmq.shared import constants as C
from vlmq.shared import results
from vlmq.shared.enqueue import enqueue, fetch_job, payload_of
from vlmq.shared.keys import Keys
from vlmq.worker.jobs.rq_jobs import Running

SUMMARY = {"items": 1, "ok": 1, "failed": 0, "prompt_tokens": 3, "completion_tokens": 2,
           "wall_s": 0.5, "cache_hits": 0, "labels": {}, "result_cache_hits": 0,
           "text_sources": {"model": 1}}


def test_finished_jobs_cost_what_their_items_do(redis_url: str) -> None:
    """150 one-item jobs (past the 128 entries where Redis's zsets leave their small
    encoding, as at scale) and one 200-item job, through the real worker path."""
    got = measure(redis_url, jobs=150, items=200)
    assert got["item"] <= 400, got  # per finished item, less its text (was 711)
    # Per one-item job: 12.9 kB before (two one-entry streams of ~4.7 kB each), 3.0 kB
    # with the end in a hashtable job hash (~1.5 kB), 2.6 kB now (revision 3): the job
    # hash compact (~0.5 kB), its end and payload in the end hash (~0.7 kB), the item
    # ~0.6 kB, three index entries ~0.42 kB (none by state), tally and listing records
    # ~0.37 kB. The 1.5 kB is not reached.
    assert got["one_item_job"] <= 2700, got
    assert got["one_item rq:job:<id>"] <= 520, got  # listpack, not hashtable
    assert got["one_item_transient"] < 5000  # the events stream, gone a minute later
    for part in ("one_item", "item"):
        shapes = [k.split(" ", 1)[1] for k in got if k.startswith(part + " ")]
        assert not [s for s in shapes if s.endswith(":events") or s.startswith("rq:results")], \
            shapes  # no stream is left behind


def _finish_one(redis: Redis, keys: Keys, *, before_end: Any = None) -> str:
    """A one-item job taken, written and finished as a worker does; `before_end` runs
    between the item's write and the end."""
    from tests.support.lua_calls import write_items
    from vlmq.shared.messages import ItemResult

    job_id = enqueue(redis, job_payload(1), queue="ocr", keys=keys)
    with worker_lifecycle(redis, ["ocr"]) as life:
        running = life.take()
        assert isinstance(running, Running)
        write_items(redis, keys, job_id, ItemResult(
            index=0, source="p0.png", page=None, text="t", finish_reason="stop",
            prompt_tokens=3, completion_tokens=2, vision_cache_hit=False, error=None))
        if before_end is not None:
            before_end(job_id)
        assert life.succeed(running, SUMMARY) is None
    return job_id


def test_a_follower_blocked_at_the_end_sees_the_terminal_event(redis: Redis,
                                                               keys: Keys) -> None:
    """A follower of the first revision (XREAD from 0-0, nothing else) blocked on the
    stream when the job ends is woken with the `finished` event."""
    seen: list[dict[bytes, bytes]] = []
    follower = Redis.from_url(_url(redis))

    def follow(job_id: str) -> None:
        last = "0-0"
        while True:
            reply = follower.xread({keys.job_events(job_id): last}, block=60_000)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    seen.append(fields)
                    if fields[b"type"] in (b"finished", b"failed", b"canceled"):
                        return

    threads: list[threading.Thread] = []

    def start_following(job_id: str) -> None:
        t = threading.Thread(target=follow, args=(job_id,), daemon=True)
        t.start()
        threads.append(t)
        wait_for(lambda: len(seen) == 1 and following_events(redis), 30,
                 "the follower to read the item event and block again")

    job_id = _finish_one(redis, keys, before_end=start_following)
    threads[0].join(timeout=60)
    follower.close()
    assert [f[b"type"] for f in seen] == [b"item", b"finished"]
    assert json.loads(seen[-1][b"summary"]) == SUMMARY
    assert 0 < redis.ttl(keys.job_events(job_id)) <= C.ENDED_EVENTS_S


def _url(redis: Redis) -> str:
    kw = redis.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw['db']}"


def test_a_follower_after_the_stream_expired_reads_the_end_from_the_hash(
        redis: Redis, keys: Keys) -> None:
    job_id = _finish_one(redis, keys)
    redis.delete(keys.job_events(job_id))  # as its expiry a minute after the end does
    # Revision 3: a finished job's end is in its end hash, not the job hash.
    assert not redis.hexists(Keys.rq_job(job_id), results.END_FIELD)
    end = results.ended_event(redis.hget(keys.job_end(job_id), results.END_EVENT))
    assert end is not None and end["type"] == "finished" and end["summary"] == SUMMARY
    assert results.read_end(redis, keys, job_id) == end
    assert not redis.exists(Keys.rq_results(job_id))
    with Client(_url(redis), prefix=keys.prefix) as client:
        job = client.job(job_id)
        assert job.wait(timeout=30) == "finished"  # what `vlmq wait` calls
        assert job.summary() == SUMMARY and job.error() is None


def test_a_failed_job_keeps_its_message_in_the_hash_and_rq_s_entry(redis: Redis,
                                                                   keys: Keys) -> None:
    job_id = enqueue(redis, job_payload(1), queue="ocr", keys=keys)
    with worker_lifecycle(redis, ["ocr"]) as life:
        running = life.take()
        assert isinstance(running, Running)
        assert life.fail(running, "bad input") is None
    end = results.ended_event(redis.hget(Keys.rq_job(job_id), results.END_FIELD))
    assert end is not None and (end["type"], end["error"]) == ("failed", "bad input")
    assert redis.exists(Keys.rq_results(job_id))  # rq-dashboard shows RQ's exc_info
    with Client(_url(redis), prefix=keys.prefix) as client:
        assert client.job(job_id).error() == "bad input"


def test_a_finished_job_hash_is_compact_and_still_rq_s(redis: Redis, keys: Keys) -> None:
    """Revision 3: every value of a finished job's hash is <= 64 B (Redis's listpack), its
    end and payload in its end hash; RQ still loads the job, vlmq still reads its payload
    and retries it."""
    long_name = "a-rather-long-scan-file-name-from-some-archive-folder-{}.png"
    redis.set(keys.blob(SHA), b"x")  # the input a retry checks is still there
    job_id = enqueue(redis, job_payload(1, name=long_name), queue="ocr", keys=keys)
    with worker_lifecycle(redis, ["ocr"]) as life:
        running = life.take()
        assert isinstance(running, Running)
        from tests.support.lua_calls import write_items
        from vlmq.shared.messages import ItemResult
        write_items(redis, keys, job_id, ItemResult(
            index=0, source=long_name.format(0), page=None, text="t", finish_reason="stop",
            prompt_tokens=3, completion_tokens=2, vision_cache_hit=False, error=None))
        assert life.succeed(running, SUMMARY) is None
    key = Keys.rq_job(job_id)
    assert redis.object("encoding", key) == b"listpack"
    assert max(len(v) for v in redis.hvals(key)) <= 64
    assert redis.hget(key, "data") == C.MOVED_DATA.encode()
    assert len(redis.hget(key, "description")) <= 64
    assert redis.ttl(key) > 0 and abs(redis.ttl(key) - redis.ttl(keys.job_end(job_id))) <= 1
    rq_job = RQJob.fetch(job_id, connection=redis, serializer=JSONSerializer)
    assert rq_job.get_status() == "finished" and rq_job.func_name == C.TASK_FUNC
    assert payload_of(fetch_job(redis, job_id, keys)).items == job_payload(1, name=long_name).items
    with Client(_url(redis), prefix=keys.prefix) as client:
        job = client.job(job_id)
        assert job.items == 1 and job.summary() == SUMMARY
        again = job.retry()  # a new job over the moved payload
        assert again.payload().items == job_payload(1, name=long_name).items
        client.delete([job_id])
    assert not redis.exists(key, keys.job_end(job_id))
