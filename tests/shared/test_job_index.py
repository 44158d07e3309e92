"""The job indexes (shared/job_index.py) stay right on every path that starts, ends or
removes a job, and listings read them instead of scanning job hashes."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from redis import Redis

from tests.support.factories import OTHER_SHA, SHA, job_payload
from tests.support.helpers import (
    abandoned,
    lifecycle_with_ttl,
    raw_enqueue,
    wait_for,
    worker_lifecycle,
)
from tests.support.lua_calls import write_items
from vlmq.producer import job_admin
from vlmq.shared import job_index, lua
from vlmq.shared.enqueue import enqueue, enqueue_lua, fetch_job
from vlmq.shared.keys import Keys
from vlmq.shared.messages import Item, ItemResult, JobPayload
from vlmq.worker.jobs.rq_jobs import Running

KEYS = Keys()


def payload(n: int = 2, labels: dict[str, str] | None = None,
            task: str = "caption") -> JobPayload:
    return job_payload(n, task=task, **({"labels": labels} if labels else {}))


def result(index: int, text: str | None = None, error: str | None = None) -> ItemResult:
    return ItemResult(index=index, source=f"p{index}.png", page=None, text=text,
                      finish_reason=None if error else "stop", prompt_tokens=1,
                      completion_tokens=1, vision_cache_hit=False, error=error)


def wire(n: int = 2, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return payload(n, labels).to_dict()


@pytest.fixture(autouse=True)
def _blob(redis: Redis) -> None:
    redis.set(KEYS.blob(SHA), b"x")  # enqueue.lua checks that blobs exist


def zsets_of(redis: Redis, job_id: str) -> set[str]:
    """Every index zset that holds `job_id`."""
    out = set()
    for raw in redis.scan_iter(match=f"{KEYS.prefix}:jobs*", _type="zset"):
        if redis.zscore(raw, job_id) is not None:
            out.add(raw.decode())
    return out


def indexed_nowhere(redis: Redis, job_id: str) -> bool:
    return not zsets_of(redis, job_id) and not redis.hexists(KEYS.jobs_meta, job_id)


def ids(rows: list[job_admin.JobRow]) -> list[str]:
    return [r.id for r in rows]


def test_python_and_lua_enqueue_write_the_same_indexes(redis: Redis) -> None:
    labels = {"batch": "nov", "a=b": "c:d", "ключ": "значение"}
    py = enqueue(redis, payload(3, labels), queue="ocr")
    old_call = enqueue_lua(redis, wire(3, labels), queue="ocr")  # KEYS/ARGV as documented
    want = {KEYS.jobs_index, KEYS.jobs_queue_index("ocr"),
            *(KEYS.jobs_label_index(k, v) for k, v in labels.items())}
    assert zsets_of(redis, py) == want and zsets_of(redis, old_call) == want
    for job_id in (py, old_call):
        meta = job_index.Meta.from_json(redis.hget(KEYS.jobs_meta, job_id))
        created = fetch_job(redis, job_id).created_at
        assert meta == job_index.Meta(task="caption", items=3, queue="ocr", labels=labels,
                                      created=job_index.us_of(created))
        assert redis.zscore(KEYS.jobs_index, job_id) == meta.created  # exact, in µs
        assert redis.hget(Keys.rq_job(job_id), job_index.ITEMS_FIELD) == b"3"
    assert [r.id for r in job_admin.list_jobs(redis, KEYS)] == [old_call, py]


def test_label_index_keys_are_unambiguous() -> None:
    assert KEYS.jobs_label_index("a=b", "c") != KEYS.jobs_label_index("a", "b=c")
    assert KEYS.jobs_label_index("a:1", "x") != KEYS.jobs_label_index("a", "1:x")
    assert KEYS.jobs_label_index("é", "v") == "vlmq:jobs:label:2:é=v"  # UTF-8 bytes, as Lua


def test_filters_combine_and_come_newest_first(redis: Redis) -> None:
    a = enqueue(redis, payload(1, {"batch": "nov", "part": "1"}), queue="ocr")
    b = enqueue(redis, payload(2, {"batch": "nov", "part": "2"}), queue="caption")
    c = enqueue(redis, payload(3, {"batch": "nov", "part": "2"}), queue="ocr")
    d = enqueue(redis, payload(4, {"batch": "dec"}), queue="ocr")
    job_admin.cancel(redis, KEYS, c)
    assert ids(job_admin.list_jobs(redis, KEYS)) == [d, c, b, a]
    assert ids(job_admin.list_jobs(redis, KEYS, limit=2)) == [d, c]
    assert ids(job_admin.list_jobs(redis, KEYS, labels={"batch": "nov", "part": "2"})) == [c, b]
    assert ids(job_admin.list_jobs(redis, KEYS, queue="ocr", labels={"batch": "nov"})) == [c, a]
    assert ids(job_admin.list_jobs(redis, KEYS, queue="ocr", status="queued")) == [d, a]
    assert ids(job_admin.list_jobs(redis, KEYS, status="canceled")) == [c]
    assert ids(job_admin.list_jobs(redis, KEYS, status="stopped")) == []  # in no registry
    assert ids(job_admin.list_jobs(redis, KEYS, labels={"batch": "none"})) == []
    row = job_admin.list_jobs(redis, KEYS, labels={"batch": "dec"})[0]
    assert (row.task, row.total, row.queue, row.status, row.labels) == \
        ("caption", 4, "ocr", "queued", {"batch": "dec"})
    group = job_admin.group_status(redis, KEYS, {"batch": "nov"})
    assert group == {"labels": {"batch": "nov"}, "jobs": 3,
                     "by_status": {"canceled": 1, "queued": 2},
                     "items": {"done": 0, "failed": 0, "total": 6}}


def test_paging_through_an_index_misses_no_job_and_repeats_none(redis: Redis) -> None:
    pipe = redis.pipeline(transaction=True)
    made = [enqueue(redis, payload(1), queue="q", pipeline=pipe) for _ in range(25)]
    pipe.execute()
    # Equal scores across page boundaries (jobs enqueued in the same microsecond).
    for job_id in made[5:15]:
        redis.zadd(KEYS.jobs_index, {job_id: 1.0})
    walked = [j for page in job_index.newest_first(redis, KEYS.jobs_index, page=4)
              for j in page]
    assert sorted(walked) == sorted(made) and len(walked) == len(set(walked))


def test_counts_come_from_the_items_hash_and_the_failed_set(redis: Redis) -> None:
    job_id = enqueue(redis, payload(3), queue="q")
    write_items(redis, KEYS, job_id, result(0, "t"))
    write_items(redis, KEYS, job_id, result(1, error="bad"))
    (row,) = job_admin.list_jobs(redis, KEYS)
    assert (row.done, row.failed, row.total) == (2, 1, 3)
    write_items(redis, KEYS, job_id, result(1, "ok now"))
    (row,) = job_admin.list_jobs(redis, KEYS)
    assert (row.done, row.failed) == (2, 0)


def _written_by_worker(redis: Redis, running: Running, results: list[ItemResult]) -> int:
    """write_items.lua called as worker/results/writer.py calls it."""
    token = redis.get(KEYS.job_owner(running.job_id))
    args: list[Any] = [token, 600, 100]
    for r in results:
        args += [r.index, json.dumps(r.to_dict()), int(r.ok)]
    return int(lua.script(redis, lua.WRITE_ITEMS)(
        keys=[Keys.rq_job(running.job_id), KEYS.job_owner(running.job_id),
              KEYS.job_items(running.job_id), KEYS.job_events(running.job_id)], args=args))


def test_finish_and_fail_through_the_worker_lifecycle(redis: Redis) -> None:
    ok = enqueue(redis, payload(2, {"g": "1"}), queue="q")
    bad = enqueue(redis, payload(2, {"g": "1"}), queue="q")
    with worker_lifecycle(redis, ["q"]) as life:
        taken = {}
        while (r := life.take()) is not None:
            assert isinstance(r, Running)
            taken[r.job_id] = r
        assert ids(job_admin.list_jobs(redis, KEYS, status="started")) == [bad, ok]
        assert _written_by_worker(redis, taken[ok], [
            result(0, "a"),
            result(1, error="unreadable")]) == 1
        assert life.succeed(taken[ok], {"items": 2, "ok": 1, "failed": 1}) is None
        assert life.fail(taken[bad], "bad payload") is None
    assert ids(job_admin.list_jobs(redis, KEYS, status="finished")) == [ok]
    assert ids(job_admin.list_jobs(redis, KEYS, status="failed")) == [bad]
    row = job_admin.list_jobs(redis, KEYS, status="finished")[0]
    assert (row.done, row.failed, row.total) == (2, 1, 2)
    # The failed set lives as long as the items hash (end_job.lua gives both the TTL).
    assert redis.ttl(KEYS.job_failed(ok)) == redis.ttl(KEYS.job_items(ok)) > 0
    assert job_admin.group_status(redis, KEYS, {"g": "1"})["by_status"] == {"failed": 1,
                                                                            "finished": 1}


def test_a_killed_workers_job_is_requeued_and_listed_once(redis: Redis) -> None:
    job_id = enqueue(redis, payload(2, {"g": "k"}), queue="q")
    dead = lifecycle_with_ttl(redis, KEYS, 1)
    assert isinstance(dead.take(), Running)
    assert ids(job_admin.list_jobs(redis, KEYS, status="started")) == [job_id]
    wait_for(lambda: abandoned(redis, "q", job_id), 120, "its execution to expire unbeaten")
    rescuer = lifecycle_with_ttl(redis, KEYS, 60)
    rescuer.worker.last_cleaned_at = None  # maintenance due now
    rescuer.maintain()
    rescuer.register_death()
    rows = job_admin.list_jobs(redis, KEYS)
    assert ids(rows) == [job_id] and rows[0].status == "queued"
    assert ids(job_admin.list_jobs(redis, KEYS, status="queued", labels={"g": "k"})) == [job_id]
    assert ids(job_admin.list_jobs(redis, KEYS, status="started")) == []
    assert zsets_of(redis, job_id) == {KEYS.jobs_index, KEYS.jobs_queue_index("q"),
                                       KEYS.jobs_label_index("g", "k")}


def test_delete_and_cancel(redis: Redis) -> None:
    gone = enqueue(redis, payload(1, {"g": "d"}), queue="q")
    kept = enqueue(redis, payload(1, {"g": "d"}), queue="q")
    write_items(redis, KEYS, gone, result(0, error="x"))
    job_admin.delete(redis, KEYS, gone)
    assert indexed_nowhere(redis, gone) and not redis.exists(KEYS.job_failed(gone))
    job_admin.cancel(redis, KEYS, kept)
    assert ids(job_admin.list_jobs(redis, KEYS, labels={"g": "d"})) == [kept]
    assert job_admin.list_jobs(redis, KEYS)[0].status == "canceled"


def _expire_hash(redis: Redis, job_id: str) -> None:
    """What RQ's result_ttl does to an ended job: the hash goes, nobody is told."""
    redis.pexpire(Keys.rq_job(job_id), 1)
    while redis.exists(Keys.rq_job(job_id)):
        time.sleep(0.01)


def test_jobs_rq_expired_are_never_listed_and_pruned_when_met(redis: Redis) -> None:
    old = enqueue(redis, payload(1, {"g": "t"}), queue="q", result_ttl=1)
    with worker_lifecycle(redis, ["q"]) as life:
        running = life.take()
        assert isinstance(running, Running)
        assert life.succeed(running, {"items": 1, "ok": 1, "failed": 0}) is None
    new = enqueue(redis, payload(1, {"g": "t"}), queue="q")
    wait_for(lambda: not redis.exists(Keys.rq_job(old)), 300, "RQ's result_ttl expiry")
    assert redis.zscore(KEYS.jobs_index, old) is not None  # nobody told the index
    assert ids(job_admin.list_jobs(redis, KEYS, labels={"g": "t"})) == [new]
    assert indexed_nowhere(redis, old)  # pruned from every index, its summary too
    assert job_admin.group_status(redis, KEYS, {"g": "t"})["jobs"] == 1


def test_sweep_removes_expired_jobs_from_every_index_over_a_lap(redis: Redis) -> None:
    made = [enqueue(redis, payload(1, {"n": str(i % 2)}), queue=f"q{i % 3}")
            for i in range(9)]
    expired = made[1::2]
    for job_id in expired:
        _expire_hash(redis, job_id)
    removed = sum(job_index.sweep(redis, KEYS, limit=2) for _ in range(6))
    assert removed == len(expired)
    assert all(indexed_nowhere(redis, j) for j in expired)
    assert sorted(ids(job_admin.list_jobs(redis, KEYS))) == sorted(set(made) - set(expired))
    assert job_index.sweep(redis, KEYS, limit=100) == 0


def test_prune_leaves_a_job_re_enqueued_under_the_same_id(redis: Redis) -> None:
    job_id = enqueue(redis, payload(1), queue="q", job_id="reused")
    job_admin.cancel(redis, KEYS, job_id)
    _expire_hash(redis, job_id)
    redis.delete(KEYS.job_items(job_id), KEYS.job_events(job_id))
    enqueue(redis, payload(2), queue="q2", job_id="reused")
    assert job_index.prune(redis, KEYS, [job_id]) == 0  # its hash is back: not stale
    assert ids(job_admin.list_jobs(redis, KEYS)) == ["reused"]
    assert job_admin.list_jobs(redis, KEYS)[0].total == 2


def test_ensure_and_reindex_index_hand_written_jobs(redis: Redis) -> None:
    by_hand = raw_enqueue(redis, wire(2, {"from": "go"}), queue="q")
    assert job_admin.list_jobs(redis, KEYS) == []  # not indexed: not listed (no scan)
    created = job_index.us_of(fetch_job(redis, by_hand).created_at)
    job_index.ensure(redis, KEYS, by_hand, payload(2, {"from": "go"}), "q", created)
    before = redis.hget(KEYS.jobs_meta, by_hand)
    job_index.ensure(redis, KEYS, by_hand, payload(5, {"from": "go"}), "q", created + 1)
    assert redis.hget(KEYS.jobs_meta, by_hand) == before  # NX: what is there stays
    assert zsets_of(redis, by_hand) == {KEYS.jobs_index, KEYS.jobs_queue_index("q"),
                                        KEYS.jobs_label_index("from", "go")}
    assert redis.zscore(KEYS.jobs_index, by_hand) == created

    second = raw_enqueue(redis, wire(3, {"from": "go"}), queue="q")
    assert job_index.reindex(redis, KEYS) == 2
    rows = job_admin.list_jobs(redis, KEYS, labels={"from": "go"})
    assert [(r.id, r.total) for r in rows] == [(second, 3), (by_hand, 2)]


def test_a_job_without_a_summary_is_read_from_its_payload(redis: Redis) -> None:
    job_id = enqueue(redis, payload(3, {"g": "m"}), queue="q")
    redis.hdel(KEYS.jobs_meta, job_id)  # as an index entry some older writer made
    (row,) = job_admin.list_jobs(redis, KEYS)
    assert (row.id, row.task, row.total, row.labels) == (job_id, "caption", 3, {"g": "m"})


def test_queued_items_are_a_running_count(redis: Redis) -> None:
    for n in (3, 4, 5):
        enqueue(redis, payload(n), queue="bulk")  # counted queued at enqueue
    enqueue_lua(redis, wire(6), queue="bulk")  # by enqueue.lua alike
    summarized = raw_enqueue(redis, wire(7), queue="bulk")  # by hand: counted once ensured
    job_index.ensure(redis, KEYS, summarized, wire(7), "bulk", 1)
    raw_enqueue(redis, wire(1), queue="bulk")  # never ensured: not counted yet
    assert job_index.queued_items(redis, KEYS, "bulk") == 25
    assert job_index.queued_items(redis, KEYS, "empty") == 0


def test_purge_keeps_blobs_a_live_job_holds(redis: Redis) -> None:
    other = OTHER_SHA
    redis.set(KEYS.blob(other), b"y")
    holder = enqueue(redis, payload(1), queue="q")
    job_id = enqueue(redis, JobPayload(task="caption", items=(
        Item(kind="image", blob=SHA, source="a.png"),
        Item(kind="image", blob=other, source="b.png"))), queue="q")
    assert job_admin.delete(redis, KEYS, job_id) == {SHA, other}
    assert job_admin.purge_blobs(redis, KEYS, {SHA, other}) == 1  # `holder` still holds SHA
    assert redis.exists(KEYS.blob(SHA)) and not redis.exists(KEYS.blob(other))
    job_admin.delete(redis, KEYS, holder)
    assert job_admin.purge_blobs(redis, KEYS, {SHA}) == 1


def test_a_page_reads_only_what_it_shows(own_redis: Redis) -> None:
    """`--limit 20` reads one index page and the rows it shows, however many jobs there
    are: counted in Redis commands (INFO commandstats), not in seconds."""
    own_redis.set(KEYS.blob(SHA), b"x")
    pipe = own_redis.pipeline(transaction=False)
    for i in range(600):
        enqueue(own_redis, payload(1, {"g": str(i % 10)}), queue=f"q{i % 4}", pipeline=pipe)
    pipe.execute()
    own_redis.config_resetstat()
    rows = job_admin.list_jobs(own_redis, KEYS, queue="q1", labels={"g": "5"}, limit=20)
    assert len(rows) == 20 and all(r.labels == {"g": "5"} and r.queue == "q1" for r in rows)
    stats = own_redis.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}
    # The label's index (60 jobs, the smallest) is walked: one page of it, no more.
    assert calls["zrevrangebyscore"] == 1
    assert calls["hmget"] <= 60 + 1  # each job's hash of that page, and their summaries
    assert calls["hlen"] == calls["scard"] == 20  # counts for the rows shown only
    assert not {"hvals", "scan", "hgetall", "hget", "keys"} & set(calls)


def test_a_state_filter_reads_rqs_registry_only_when_that_is_cheaper(own_redis: Redis) -> None:
    own_redis.set(KEYS.blob(SHA), b"x")
    pipe = own_redis.pipeline(transaction=False)
    made = [enqueue(own_redis, payload(1), queue="q", pipeline=pipe) for _ in range(600)]
    pipe.execute()
    for job_id in made[:3]:
        job_admin.cancel(own_redis, KEYS, job_id)

    def calls(**filters: Any) -> tuple[list[str], dict[str, int]]:
        own_redis.config_resetstat()
        rows = job_admin.list_jobs(own_redis, KEYS, limit=20, **filters)
        stats = own_redis.info("commandstats")
        return ids(rows), {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}

    rare, used = calls(status="canceled")  # 3 of 600: RQ's registry, not the index
    assert rare == made[2::-1] and "zrevrangebyscore" not in used and used["zrange"] == 1
    common, used = calls(status="queued")  # 597 of 600: the index's first page has 20
    assert common == made[:2:-1][:20]
    assert used["zrevrangebyscore"] == 1 and "lrange" not in used
