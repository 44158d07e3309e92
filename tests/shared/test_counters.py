"""The running counts (PROTOCOL.md 8b) agree with a full recount of every job after each
way a job changes: enqueue (Python and enqueue.lua), start, item writes, finish, fail,
cancel, requeue, delete, RQ's TTL expiry and a worker that died mid-job; and the commands
that read them stay O(1): no SORT during `vlmq status`, the same commands for `status
BATCH` and `wait BATCH` whatever the batch's size."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from redis import Redis

from tests.support.factories import SHA, job_payload
from tests.support.helpers import (
    abandoned,
    invoke_cli,
    lifecycle_with_ttl,
    make_images,
    wait_for,
    worker_lifecycle,
)
from vlmq.producer import job_admin
from vlmq.producer.client import Client
from vlmq.producer.job_sets import Batch
from vlmq.shared import job_index, lua
from vlmq.shared.enqueue import enqueue, enqueue_lua
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult
from vlmq.shared.redis_text import as_str
from vlmq.shared.results import stored_data
from vlmq.worker.jobs.rq_jobs import Running

KEYS = Keys()


def _result(index: int, ok: bool) -> ItemResult:
    return ItemResult(index=index, source=f"p{index}.png", page=None,
                      text="t" if ok else None, finish_reason="stop" if ok else None,
                      prompt_tokens=1, completion_tokens=1, vision_cache_hit=False,
                      error=None if ok else "bad")


def _write(redis: Redis, running: Running, results: list[ItemResult]) -> None:
    """write_items.lua called as worker/results/writer.py calls it."""
    token = redis.get(KEYS.job_owner(running.job_id))
    args: list[Any] = [token, 600, 100]
    for r in results:
        args += [r.index, json.dumps(r.to_dict()), int(r.ok)]
    assert lua.script(redis, lua.WRITE_ITEMS)(
        keys=[Keys.rq_job(running.job_id), KEYS.job_owner(running.job_id),
              KEYS.job_items(running.job_id), KEYS.job_events(running.job_id)],
        args=args) == 1


def recount(redis: Redis) -> dict[str, dict[str, int]]:
    """The slow reference: every job hash read, its counts rebuilt from scratch."""
    out: dict[str, Counter[str]] = {}
    for raw in redis.scan_iter(match=Keys.rq_job_glob(), _type="HASH"):
        job_id = Keys.rq_job_id(as_str(raw))
        if job_id is None:
            continue
        status, origin, data = redis.hmget(raw, "status", "origin", "data")
        payload = job_index.loose_payload(stored_data(redis, KEYS, job_id, data))
        meta = job_index.meta_of(payload, as_str(origin), 0)
        state = job_index.TALLY_STATES[job_index.TALLY_STATES.index(as_str(status))]
        done = int(redis.hlen(KEYS.job_items(job_id)))
        failed = int(redis.scard(KEYS.job_failed(job_id)))
        for key in job_index.count_keys(KEYS, meta):
            c = out.setdefault(key, Counter())
            c.update({"jobs": 1, "items": meta.items, "items_done": done,
                      "items_failed": failed, state: 1, f"{state}_items": meta.items})
    return {k: {f: n for f, n in c.items() if n} for k, c in out.items()}


def counted(redis: Redis) -> dict[str, dict[str, int]]:
    """Every running-counts hash in the db, as it stands."""
    keys = [as_str(k) for pattern in (f"{KEYS.prefix}:counts:*",
                                      KEYS.batch_counts("*"))
            for k in redis.scan_iter(match=pattern)]
    out = {}
    for key in keys:
        fields = {as_str(f): int(v) for f, v in redis.hgetall(key).items() if int(v)}
        if fields:
            out[key] = fields
    return out


def agree(redis: Redis) -> None:
    assert counted(redis) == recount(redis)
    by_state = {s: {as_str(m) for m in redis.zrange(KEYS.jobs_state_index(s), 0, -1)}
                for s in job_index.TALLY_STATES}
    for raw in redis.scan_iter(match=Keys.rq_job_glob(), _type="HASH"):
        job_id = as_str(raw).rsplit(":", 1)[-1]
        status = as_str(redis.hget(raw, "status"))
        # Only the states RQ keeps no list or registry of have an index.
        want = [status] if status in job_index.STATE_INDEXED else []
        assert [s for s, ids in by_state.items() if job_id in ids] == want, job_id
    lib = (Path(lua.__file__).parent / "tally_lib.lua").read_text()
    indexed = ", ".join(f"{s} = true" for s in sorted(job_index.STATE_INDEXED, reverse=True))
    assert f"TALLY.INDEXED = {{{indexed}}}" in lib


def test_counts_agree_with_a_recount_through_every_change(redis: Redis) -> None:
    redis.set(KEYS.blob(SHA), b"x")
    made = [enqueue(redis, job_payload(n, labels={"run": "a", "part": str(n % 2)},
                                       batch="b-1"), queue="q") for n in (1, 2, 3, 4)]
    lua_id = enqueue_lua(redis, job_payload(5, labels={"run": "a"}).to_dict(), queue="q")
    short = enqueue(redis, job_payload(2, labels={"run": "a"}), queue="q", result_ttl=1)
    agree(redis)
    assert job_index.queued_items(redis, KEYS, "q") == 1 + 2 + 3 + 4 + 5 + 2

    with worker_lifecycle(redis, ["q"]) as life:
        taken: dict[str, Running] = {}
        while (r := life.take()) is not None:
            assert isinstance(r, Running)
            taken[r.job_id] = r
        agree(redis)  # every job started
        assert job_index.queued_items(redis, KEYS, "q") == 0
        _write(redis, taken[made[1]], [_result(0, True), _result(1, False)])
        _write(redis, taken[made[1]], [_result(1, True)])  # a failed item done again
        _write(redis, taken[made[2]], [_result(0, False)])
        agree(redis)
        assert life.succeed(taken[made[1]], {"items": 2, "ok": 2, "failed": 0}) is None
        assert life.fail(taken[made[2]], "bad payload") is None
        assert life.succeed(taken[short], {"items": 2, "ok": 2, "failed": 0}) is None
        assert life.requeue(taken[made[3]]) is None
        agree(redis)
        job_admin.cancel(redis, KEYS, made[3])  # queued again, then canceled
        job_admin.cancel(redis, KEYS, lua_id)  # running
        job_admin.delete(redis, KEYS, made[0])  # running
        job_admin.delete(redis, KEYS, made[1])  # finished
        agree(redis)

    # RQ's TTL deletes the finished `short` job's hash; the sweep notices and counts it out.
    wait_for(lambda: not redis.exists(Keys.rq_job(short)), 300, "RQ's result_ttl expiry")
    assert counted(redis) != recount(redis)  # nobody told the counts yet
    while job_index.sweep(redis, KEYS) == 0 and redis.hexists(KEYS.jobs_tally, short):
        pass
    agree(redis)
    group = job_admin.group_status(redis, KEYS, {"run": "a"})
    assert group["jobs"] == 3 and group["by_status"] == {"canceled": 2, "failed": 1}
    assert group == {"labels": {"run": "a"},
                     **job_admin.summarize(job_admin.list_jobs(redis, KEYS, labels={"run": "a"}))}


def test_a_killed_workers_job_is_counted_where_rq_puts_it(redis: Redis) -> None:
    redis.set(KEYS.blob(SHA), b"x")
    job_id = enqueue(redis, job_payload(3, labels={"g": "k"}), queue="q")
    dead = lifecycle_with_ttl(redis, KEYS, 1)
    running = dead.take()  # then the worker "dies": no heartbeat, no end
    assert isinstance(running, Running)
    _write(redis, running, [_result(0, True)])
    agree(redis)
    wait_for(lambda: abandoned(redis, "q", job_id), 120, "its execution to expire unbeaten")
    rescuer = lifecycle_with_ttl(redis, KEYS, 60)
    rescuer.worker.last_cleaned_at = None  # maintenance due now: RQ requeues the job
    rescuer.maintain()
    assert as_str(redis.hget(Keys.rq_job(job_id), "status")) == "queued"
    job_index.sweep(redis, KEYS)  # what each worker's upkeep runs
    agree(redis)
    assert job_index.queued_items(redis, KEYS, "q") == 3
    again = rescuer.take()  # the next run resumes; its start syncs the count at once
    assert isinstance(again, Running)
    agree(redis)
    assert rescuer.succeed(again, {"items": 3, "ok": 3, "failed": 0}) is None
    rescuer.register_death()
    agree(redis)
    assert job_admin.group_status(redis, KEYS, {"g": "k"})["by_status"] == {"finished": 1}


def test_vlmq_status_runs_no_command_over_the_queue(own_redis: Redis) -> None:
    """5k queued jobs: during `vlmq status` every command Redis runs is O(1) in them
    (SLOWLOG, logging every command): no SORT, no read of the queue's list."""
    url = f"redis://127.0.0.1:{own_redis.connection_pool.connection_kwargs['port']}/0"
    own_redis.set(KEYS.blob(SHA), b"x")
    for _ in range(10):
        pipe = own_redis.pipeline(transaction=True)
        for _ in range(500):
            enqueue(own_redis, job_payload(3), queue="bulk", pipeline=pipe, keys=KEYS)
        pipe.execute()
    own_redis.config_set("slowlog-log-slower-than", 0)
    own_redis.config_set("slowlog-max-len", 100_000)
    own_redis.slowlog_reset()
    out = invoke_cli(url, "status", "--json")
    assert json.loads(out.stdout)["queues"]["bulk"]["queued_items"] == 15_000, out.stdout
    entries = own_redis.slowlog_get(100_000)
    commands = [[as_str(a) for a in e["command"].split()] if isinstance(e["command"], bytes)
                else [as_str(a) for a in e["command"]] for e in entries]
    names = {c[0].upper() for c in commands if c}
    assert not names & {"SORT", "SORT_RO", "KEYS", "SCAN"}, names
    queue = Keys.rq_queue("bulk")  # the 5k-entry list: only its length (and that it is)
    assert {c[0].upper() for c in commands if queue in c[1:]} <= {"LLEN", "EXISTS"}, commands
    assert "HGET" in names  # the queue's count


def _commands(redis: Redis) -> int:
    """Commands Redis has run since the last reset, this INFO excepted."""
    stats = redis.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info") - 1


def _batch(url: str, folder: Path, n: int) -> Batch:
    make_images(folder, n)
    made = Client(url).submit_set("caption", [folder], job_size=1)
    assert isinstance(made, Batch) and len(made.job_ids()) == n
    return made


def test_status_and_wait_of_a_batch_cost_the_same_at_any_size(own_redis: Redis,
                                                              tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{own_redis.connection_pool.connection_kwargs['port']}/0"
    costs: dict[int, tuple[int, int]] = {}
    for n in (3, 60):
        batch = _batch(url, tmp_path / str(n), n)
        client = Client(url)
        own_redis.config_resetstat()
        status = client.batch(batch.id).status()
        status_cost = _commands(own_redis)
        assert status["jobs"] == n and status["by_status"] == {"queued": n}
        batch.cancel()
        own_redis.config_resetstat()
        assert client.batch(batch.id).wait(timeout=5) == "canceled"
        costs[n] = (status_cost, _commands(own_redis))
        client.close()
    assert costs[3] == costs[60], costs
