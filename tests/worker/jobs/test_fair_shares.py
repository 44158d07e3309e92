"""Fair shares between batches at intake: which queue entry a worker takes next.

Real Redis, the real enqueue paths (Python and enqueue.lua) and the real take script: the
batches waiting in one queue take turns by items, whatever their arrival order, while the
queue list stays what RQ knows; entries no turn holds (requeued, pushed by hand) go first;
ids taken, canceled or deleted meanwhile are skipped; nothing is taken twice."""

from __future__ import annotations

import uuid
from typing import Any

from redis import Redis

from tests.support.factories import SHA, job_payload, payload
from tests.support.helpers import raw_enqueue, worker_lifecycle
from vlmq.shared import constants as C
from vlmq.shared import fair
from vlmq.shared.enqueue import enqueue, enqueue_lua
from vlmq.shared.keys import Keys
from vlmq.shared.redis_text import as_str
from vlmq.worker.jobs.rq_jobs import Running

Q = "fq"


def _put(redis: Redis, keys: Keys, batch: str | None, n: int, items: int = 1) -> list[str]:
    """`n` jobs of `items` items each under `batch` (None: no batch), in one MULTI each."""
    redis.set(keys.blob(SHA), b"x")
    settings: dict[str, Any] = {} if batch is None else {"batch": batch}
    return [enqueue(redis, job_payload(items, **settings), queue=Q, keys=keys)
            for _ in range(n)]


def _take_all(redis: Redis, keys: Keys, one_at_a_time: bool = True) -> list[str]:
    out: list[str] = []
    while True:
        got = fair.take(redis, keys, Q, 1 if one_at_a_time else 8)
        if not got.entries:
            return out
        out += [as_str(e) for e in got.entries]


def _batch_of(ids: dict[str, list[str]]) -> dict[str, str]:
    return {j: b for b, js in ids.items() for j in js}


def test_batches_take_turns_whatever_their_arrival_order(redis: Redis, keys: Keys) -> None:
    ids = {"big": _put(redis, keys, "b-big", 30), "small": _put(redis, keys, "b-small", 2),
           "loose": _put(redis, keys, None, 2)}
    assert redis.llen(Keys.rq_queue(Q)) == 34
    order = [_batch_of(ids)[j] for j in _take_all(redis, keys)]
    # Each batch (and the jobs without one, together) gets a turn in each round.
    assert order[:6].count("small") == 2 and order[:6].count("loose") == 2, order
    assert order[6:] == ["big"] * 28
    # Within a batch, its own order; the queue list and intermediate list hold every id once.
    taken = [j for j in _take_all(redis, keys)]
    assert taken == []
    moved = [as_str(e) for e in redis.lrange(Keys.rq_intermediate(Q), 0, -1)]
    assert [j for j in moved if j in ids["big"]] == ids["big"]
    assert sorted(moved) == sorted(j for js in ids.values() for j in js)
    assert redis.llen(Keys.rq_queue(Q)) == 0
    assert not redis.exists(keys.fair_ring(Q), keys.fair_jobs(Q, "b-big"))


def test_turns_are_weighted_by_items(redis: Redis, keys: Keys) -> None:
    """A batch of 5-item jobs gets one job for every five of a batch of 1-item jobs."""
    ids = {"five": _put(redis, keys, "b-five", 4, items=5),
           "one": _put(redis, keys, "b-one", 20)}
    order = [_batch_of(ids)[j] for j in _take_all(redis, keys)]
    assert order[:12].count("five") == 2, order
    assert order[:12].count("one") == 10, order


def test_a_batch_enqueued_later_is_served_at_once(redis: Redis, keys: Keys) -> None:
    """A batch arriving while another has had many turns starts at the clock: its first
    job goes next, with no credit or debt from before."""
    big = _put(redis, keys, "b-big", 40)
    first = [as_str(e) for e in fair.take(redis, keys, Q, 20).entries]
    assert first == big[:20]
    late = _put(redis, keys, "b-late", 3)
    nxt = [as_str(e) for e in fair.take(redis, keys, Q, 4).entries]
    assert nxt.count(late[0]) == 1 and nxt.index(late[0]) <= 1, nxt
    assert [j for j in nxt if j in late] == late[:2]


def test_lua_and_python_enqueue_index_a_job_alike(redis: Redis, keys: Keys) -> None:
    redis.set(keys.blob(SHA), b"x")
    by_lua = enqueue_lua(redis, payload(batch="b-x"), queue=Q, keys=keys)
    by_py = enqueue(redis, job_payload(1, batch="b-x"), queue=Q, keys=keys)
    loose = enqueue_lua(redis, payload(), queue=Q, keys=keys)
    assert [as_str(j) for j in redis.lrange(keys.fair_jobs(Q, "b-x"), 0, -1)] == [by_lua, by_py]
    assert [as_str(j) for j in redis.lrange(keys.fair_jobs(Q, C.LOOSE_SHARE), 0, -1)] == [loose]
    assert {as_str(m) for m in redis.zrange(keys.fair_ring(Q), 0, -1)} == {"b-x", ""}
    for job_id, share in ((by_lua, "b-x"), (by_py, "b-x"), (loose, "")):
        assert redis.hget(Keys.rq_job(job_id), C.FAIR_FIELD) == share.encode()


def test_entries_no_turn_holds_go_first_and_stale_ids_are_skipped(
        redis: Redis, keys: Keys) -> None:
    ids = _put(redis, keys, "b-a", 6)
    raw = raw_enqueue(redis, payload(), queue=Q)  # pushed by hand: in no batch's list
    redis.lrem(Keys.rq_queue(Q), 0, raw)
    redis.lpush(Keys.rq_queue(Q), raw)  # and at the head, as a warm shutdown requeues
    redis.delete(Keys.rq_job(ids[0]))  # deleted: its entry and list id stay
    redis.lrem(Keys.rq_queue(Q), 0, ids[1])  # canceled: out of the queue, still listed
    redis.hset(Keys.rq_job(ids[1]), "status", "canceled")
    redis.rpush(Keys.rq_queue(Q), b"\xff not text")  # poison: the worker's guard takes it
    got = _take_all(redis, keys)
    # The hand-pushed entry first; the deleted job's entry once it reaches the head (the
    # worker then finds its hash gone); the canceled job never; the poison entry too.
    assert got[0] == raw
    assert got[1:] == [ids[0], *ids[2:], as_str(b"\xff not text")], got
    assert redis.llen(Keys.rq_queue(Q)) == 0
    assert not redis.exists(keys.fair_ring(Q))


def test_a_lost_list_never_strands_the_queue(redis: Redis, keys: Keys) -> None:
    ids = _put(redis, keys, "b-a", 3) + _put(redis, keys, "b-b", 3)
    redis.delete(keys.fair_jobs(Q, "b-a"), keys.fair_ring(Q))  # the index lost
    assert sorted(_take_all(redis, keys)) == sorted(ids)


def test_two_workers_take_every_entry_once(redis: Redis, keys: Keys) -> None:
    ids = [j for b in range(5) for j in _put(redis, keys, f"b-{b}", 8)]
    with worker_lifecycle(redis, [Q]) as one, worker_lifecycle(redis, [Q]) as two:
        seen: list[str] = []
        while True:
            a, _ = one.take_many(3)
            b, _ = two.take_many(2)
            if not a and not b:
                break
            seen += [t.job_id for t in [*a, *b] if isinstance(t, Running)]
        assert sorted(seen) == sorted(ids)
        for job_id in ids:  # started: no turn may take it again
            assert not redis.hexists(Keys.rq_job(job_id), C.FAIR_FIELD)
        assert redis.llen(Keys.rq_intermediate(Q)) == 0


def test_a_requeued_job_is_taken_before_the_waiting_batches(redis: Redis, keys: Keys) -> None:
    first = _put(redis, keys, "b-a", 1)[0]
    with worker_lifecycle(redis, [Q]) as life:
        (running,), _ = life.take_many(1)
        assert isinstance(running, Running) and running.job_id == first
        rest = _put(redis, keys, "b-b", 4)
        assert life.requeue(running) is None  # a warm shutdown: back at the queue's head
        again, _ = life.take_many(2)
        assert [t.job_id for t in again] == [first, rest[0]]
    assert uuid.UUID(first)  # the ids are real uuids (enqueue made them)


def test_an_index_key_of_the_wrong_type_falls_back_to_first_in_first_out(
        redis: Redis, keys: Keys) -> None:
    """A raw write over the index (the ring as a string) never stops a worker: the queue
    is then taken in its own order."""
    ids = _put(redis, keys, "b-a", 2) + _put(redis, keys, "b-b", 2)
    redis.delete(keys.fair_ring(Q))
    redis.set(keys.fair_ring(Q), "not a zset")
    got = fair.take(redis, keys, Q, 3)
    assert [as_str(e) for e in got.entries] == ids[:3] and got.head == 3


def test_a_batch_list_of_the_wrong_type_is_passed_over(redis: Redis, keys: Keys) -> None:
    ids = _put(redis, keys, "b-a", 2) + _put(redis, keys, "b-b", 2)
    redis.delete(keys.fair_jobs(Q, "b-a"))
    redis.set(keys.fair_jobs(Q, "b-a"), "not a list")
    assert sorted(_take_all(redis, keys)) == sorted(ids)  # b-a's from the head, in turn
    assert redis.llen(Keys.rq_intermediate(Q)) == 4


def test_status_reads_the_waiting_batches_in_turn_order(redis: Redis, keys: Keys) -> None:
    _put(redis, keys, "b-big", 5)
    fair.take(redis, keys, Q, 2)
    _put(redis, keys, "b-new", 1)
    _put(redis, keys, None, 2)
    got = fair.waiting(redis, keys, [Q, "empty"])
    assert got[Q].batches == 3
    assert got[Q].next == [("", 2), ("b-new", 1), ("b-big", 3)]
    assert got[Q].to_dict()["next"][0] == {"batch": None, "jobs": 2}
    assert got["empty"] == fair.Waiting(0, [])
    redis.set(keys.fair_ring("bad"), "x")  # a raw write: read as nothing waiting
    assert fair.waiting(redis, keys, ["bad"])["bad"] == fair.Waiting(0, [])


def test_a_workers_shares_read_back_whatever_its_stats_hold() -> None:
    shares = fair.shares_of([("b-a", 2), ("b-a", 1), ("", 5)] +
                            [(f"b-{k}", 1) for k in range(20)], limit=3)
    assert [(s.batch, s.jobs, s.items) for s in shares[:2]] == [("", 1, 5), ("b-a", 2, 3)]
    assert shares[-1].batch == "..." and sum(s.jobs for s in shares) == 23
    assert fair.parse_shares(fair.shares_json(shares)) == shares
    for junk in (None, "", "[", "{}", "[1]", '[{"batch": 1, "jobs": 1, "items": 1}]',
                 "[" * 5000, '[{"batch": "b", "jobs": 1e999, "items": 1}]', "x" * 20000):
        assert fair.parse_shares(junk) == [], junk


def test_a_tenants_batches_take_one_turn_together(redis: Redis, keys: Keys) -> None:
    """A tenant with two batches gets one turn, like a tenant with one: per batch it would
    get two turns in three."""
    redis.set(keys.blob(SHA), b"x")

    def put(batch: str, tenant: str, lua: bool) -> list[str]:
        labels = {C.TENANT_LABEL: tenant}
        if lua:
            return [enqueue_lua(redis, payload(batch=batch, labels=labels), queue=Q, keys=keys)
                    for _ in range(10)]
        return [enqueue(redis, job_payload(1, batch=batch, labels=labels), queue=Q, keys=keys)
                for _ in range(10)]

    ids = {"a": put("b-a1", "alice", True) + put("b-a2", "alice", False),
           "b": put("b-b1", "bob", True)}
    assert fair.share_of({"labels": {C.TENANT_LABEL: "bob"}, "batch": "b-b1"}) == "tenant:bob"
    first = [_batch_of(ids)[j] for j in _take_all(redis, keys)][:10]
    assert first.count("b") == 5, first
