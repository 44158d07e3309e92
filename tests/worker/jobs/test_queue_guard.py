"""Queue content can never crash a worker: poison is dead-lettered with its reason."""

from __future__ import annotations

import json
import resource
import uuid
import zlib
from collections.abc import Iterator

import pytest
from redis import Redis
from rq import Queue
from rq.job import Job, JobStatus

from tests.support.factories import SHA, item, payload
from vlmq.shared import bounded_reads
from vlmq.shared import constants as C
from vlmq.shared.enqueue import enqueue_lua, raw_exc_info
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import parse_payload
from vlmq.worker.jobs import queue_guard
from vlmq.worker.jobs.queue_guard import scrub_intermediate
from vlmq.worker.jobs.rq_jobs import BatchWorker, JobLifecycle, Refused, Running


def _enqueue(redis: Redis, payload: dict[str, object], **kw: str) -> str:
    redis.set(Keys().blob(SHA), b"x")  # enqueue.lua checks that every blob exists
    return enqueue_lua(redis, payload, **kw)


@pytest.fixture
def life(redis: Redis) -> Iterator[JobLifecycle]:
    worker = BatchWorker(["q"], connection=redis, name=f"guard-{uuid.uuid4().hex[:8]}")
    lc = JobLifecycle(worker, keys=Keys())
    lc.register_birth()
    yield lc
    lc.register_death()


def dead(redis: Redis) -> list[dict[str, str]]:
    return [json.loads(x) for x in redis.lrange(Keys().dead, 0, -1)]


def bomb_data(inflated: int) -> bytes:
    """zlib of a JSON job tuple whose string is `inflated` bytes of spaces."""
    head = json.dumps([C.TASK_FUNC, None, [payload(item(source="a.png"))], {}])[:-1] + ', "'
    z = zlib.compressobj(9)
    out = z.compress(head.encode())
    chunk = b" " * (1 << 20)
    for _ in range(inflated >> 20):
        out += z.compress(chunk)
    return out + z.compress(b'"]') + z.flush()


def deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def huge_int_data(digits: int = 4401) -> bytes:
    """Job data whose max_side is an integer of `digits` digits, as a raw producer writes it
    (Python's own json.dumps refuses to write one past 4,300)."""
    text = json.dumps([C.TASK_FUNC, None, [payload(item(source="a.png"), max_side=0)], {}])
    return text.replace('"max_side": 0', '"max_side": 1' + "0" * (digits - 1)).encode()


def list_job(redis: Redis, job_id: str = "listjob") -> None:
    """rq:job:<id> written as a Redis list, its id pushed: no hash command works on it."""
    redis.rpush(Keys.rq_job(job_id), "x")
    redis.rpush("rq:queue:q", job_id)


def side_key_of_type(redis: Redis, key: str) -> str:
    """A valid job whose `key` (one of its vlmq keys) is a Redis list."""
    job_id = _enqueue(redis, payload(item(source="a.png")), queue="q")
    redis.delete(key.format(job_id=job_id))
    redis.rpush(key.format(job_id=job_id), "x")
    return job_id


def poison_job(redis: Redis, field: str, value: bytes | None) -> str:
    job_id = _enqueue(redis, payload(item(source="a.png")), queue="q")
    if value is None:
        redis.hdel(Keys.rq_job(job_id), field)
    else:
        redis.hset(Keys.rq_job(job_id), field, value)
    return job_id


# Each case: how to make the poison, the expected reason, whether a job hash is failed.
CASES = {
    "non-UTF-8 id": (lambda r: r.rpush("rq:queue:q", b"\xff\xfe") and None,
                     "is not UTF-8 text"),
    "id with a colon": (lambda r: r.rpush("rq:queue:q", "x:y") and None,
                        "is not a valid job id"),
    "id with a newline": (lambda r: r.rpush("rq:queue:q", "abc\n") and None,
                          "is not a valid job id"),
    "hash without data": (lambda r: poison_job(r, "data", None), "has no data field"),
    "zlib bomb data": (lambda r: poison_job(r, "data", bomb_data(64 << 20)),
                       "inflates to more than 16 MiB"),
    "deeply nested data": (lambda r: poison_job(r, "data", zlib.compress(deep_json(100_000))),
                           "nests JSON deeper than 32 levels"),
    "deeply nested meta": (lambda r: poison_job(r, "meta", deep_json(50)),
                           "job meta nests JSON deeper"),
    "unparseable date": (lambda r: poison_job(r, "created_at", b"yesterday"),
                         "RQ cannot read its hash (ValueError"),
    "bad status": (lambda r: poison_job(r, "status", b"bogus"), "RQ cannot read its hash"),
    "float timeout": (lambda r: poison_job(r, "timeout", b"86400.0"),
                      "job timeout '86400.0' is not a whole number of seconds"),
    "4,401-digit integer in data": (lambda r: poison_job(r, "data", huge_int_data()),
                                    "job data holds a number of 4401 characters"),
    "same, zlib-compressed": (lambda r: poison_job(r, "data", zlib.compress(huge_int_data())),
                              "job data holds a number of 4401 characters"),
    "400-digit integer in data": (lambda r: poison_job(r, "data", huge_int_data(400)),
                                  "over the 100-character limit"),
    "4,401-digit integer in meta": (lambda r: poison_job(r, "meta", b"1" + b"0" * 4400),
                                    "job meta holds a number of 4401 characters"),
    "job key a list": (lambda r: list_job(r), "its key rq:job:listjob is a Redis list, where "
                       "vlmq keeps a hash"),
    "items key a list": (lambda r: side_key_of_type(r, "vlmq:job:{job_id}:items"),
                         ":items is a Redis list, where vlmq keeps a hash"),
    "events key a list": (lambda r: side_key_of_type(r, "vlmq:job:{job_id}:events"),
                          ":events is a Redis list, where vlmq keeps a stream"),
    "40-digit timeout": (lambda r: poison_job(r, "timeout", b"9" * 40),
                         "is not a whole number of seconds (at most 12 digits)"),
    "400-digit result_ttl": (lambda r: poison_job(r, "result_ttl", b"9" * 400),
                             "job field result_ttl"),
    "dependency_ids a number": (lambda r: poison_job(r, "dependency_ids", b"1e999"),
                                "job dependency_ids is not a list of job ids"),
    "meta a list": (lambda r: poison_job(r, "meta", b"[1]"), "job meta is not a JSON object"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_poison_entry_is_dead_lettered_and_the_next_job_runs(redis: Redis, life: JobLifecycle,
                                                             case: str) -> None:
    make, reason = CASES[case]
    bad_id = make(redis)
    good_id = _enqueue(redis, payload(item(source="a.png")), queue="q")

    refused = life.take()
    assert isinstance(refused, Refused), refused
    assert reason in refused.reason
    (record,) = dead(redis)
    assert record["queue"] == "q" and reason in record["reason"]
    assert redis.llen("rq:queue:q:intermediate") == 0
    if bad_id is not None:  # a hash exists: the job is failed, visibly
        assert Job(bad_id, connection=redis).get_status(refresh=True) == JobStatus.FAILED
        assert reason in (raw_exc_info(redis, bad_id) or "")
    running = life.take()
    assert isinstance(running, Running) and running.job_id == good_id


def test_bomb_is_refused_without_inflating_it(redis: Redis, life: JobLifecycle) -> None:
    data = bomb_data(1 << 30)  # ~1 MB that unpacks to 1 GiB
    assert len(data) < 2 << 20
    job_id = poison_job(redis, "data", data)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused = life.take()
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert isinstance(refused, Refused) and "decompression bomb" in refused.reason
    assert grew_mb < 200, grew_mb
    assert Job(job_id, connection=redis).get_status(refresh=True) == JobStatus.FAILED


def test_id_x_colon_y_fails_its_own_hash_not_job_x(redis: Redis, life: JobLifecycle) -> None:
    x = _enqueue(redis, payload(item(source="a.png")), queue="other", job_id="x")
    redis.hset("rq:job:x:y", mapping={"status": "queued", "data": b"[]"})
    redis.rpush("rq:queue:q", "x:y")
    assert isinstance(life.take(), Refused)
    assert redis.hget("rq:job:x:y", "status") == b"failed"
    assert Job(x, connection=redis).get_status(refresh=True) == JobStatus.QUEUED


def test_maintenance_survives_poison_in_the_intermediate_list(redis: Redis,
                                                              life: JobLifecycle) -> None:
    queue = Queue("q", connection=redis)
    redis.rpush(queue.intermediate_queue_key, b"\xff\xfe", "x:y")
    healthy = _enqueue(redis, payload(item(source="a.png")), queue="q")
    redis.lmove("rq:queue:q", queue.intermediate_queue_key)  # another worker mid-take
    life.worker.last_cleaned_at = None  # due now
    life.maintain()
    assert redis.lrange(queue.intermediate_queue_key, 0, -1) == [healthy.encode()]
    assert len(dead(redis)) == 2
    assert not redis.exists(queue.registry_cleaning_key)  # the lock is not left held
    assert life.worker.last_cleaned_at is not None
    assert scrub_intermediate(redis, Keys(), queue, "w") == 0  # nothing left to refuse


def test_maintenance_survives_a_huge_integer_and_a_list_job_key(redis: Redis,
                                                                life: JobLifecycle) -> None:
    """Left in the intermediate list by a worker that died between its take and its start:
    the next worker's maintenance dead-letters both (and fails the one with a hash) instead
    of dying on them at every start, and leaves the healthy entry for RQ's own cleanup."""
    queue = Queue("q", connection=redis)
    huge = poison_job(redis, "data", huge_int_data())
    list_job(redis)
    healthy = _enqueue(redis, payload(item(source="a.png")), queue="q")
    for _ in range(3):
        redis.lmove("rq:queue:q", queue.intermediate_queue_key)
    life.worker.last_cleaned_at = None  # due now
    life.maintain()
    assert redis.lrange(queue.intermediate_queue_key, 0, -1) == [healthy.encode()]
    reasons = {r["entry"]: r["reason"] for r in dead(redis)}
    assert reasons.keys() == {huge, "listjob"}
    assert "holds a number of 4401 characters" in reasons[huge]
    assert "rq:job:listjob is a Redis list" in reasons["listjob"]
    assert Job(huge, connection=redis).get_status(refresh=True) == JobStatus.FAILED
    assert redis.type(Keys.rq_job("listjob")) == b"list"  # not ours to delete


def test_a_job_key_turned_into_a_list_as_it_is_taken(redis: Redis, life: JobLifecycle,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer racing the take: the guard read a hash, and the key is a list by the time
    the job is started. That job is dead-lettered; the one taken with it starts."""
    bad = _enqueue(redis, payload(item(source="a.png")), queue="q")
    good = _enqueue(redis, payload(item(source="b.png")), queue="q")
    checked = queue_guard.inspect_many

    def racing(conn: Redis, keys: Keys, raws: list[bytes | str]) -> object:
        out = checked(conn, keys, raws)
        redis.delete(Keys.rq_job(bad))
        redis.rpush(Keys.rq_job(bad), "x")
        return out

    monkeypatch.setattr(queue_guard, "inspect_many", racing)
    taken, _ = life.take_many(2)
    assert [t.job_id for t in taken if isinstance(t, Running)] == [good]
    (record,) = dead(redis)
    assert record["entry"] == bad and "became another Redis type" in record["reason"]
    assert redis.llen("rq:queue:q:intermediate") == 0


def test_a_job_hash_turned_into_a_list_between_the_guards_two_reads(
        redis: Redis, life: JobLifecycle, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = _enqueue(redis, payload(item(source="a.png")), queue="q")
    good = _enqueue(redis, payload(item(source="b.png")), queue="q")
    sizes = queue_guard._check_sizes

    def racing(*args: object) -> object:
        out = sizes(*args)  # type: ignore[arg-type]
        redis.delete(Keys.rq_job(bad))
        redis.rpush(Keys.rq_job(bad), "x")
        return out

    monkeypatch.setattr(queue_guard, "_check_sizes", racing)
    taken, _ = life.take_many(2)
    assert [t.job_id for t in taken if isinstance(t, Running)] == [good]
    (record,) = dead(redis)
    assert record["entry"] == bad
    assert f"its key rq:job:{bad} is of another Redis type" in record["reason"]


def test_bounded_helpers() -> None:
    assert bounded_reads.inflate(zlib.compress(b"x" * 100), cap=100) == b"x" * 100
    with pytest.raises(bounded_reads.BoundError, match="more than"):
        bounded_reads.inflate(zlib.compress(b"x" * 101), cap=100)
    assert bounded_reads.inflate(b'["plain json"]') == b'["plain json"]'
    assert bounded_reads.loads(deep_json(32)) is not None
    assert bounded_reads.loads(b"[" + b"9" * 100 + b", 1.5e300, NaN]")[0] == int("9" * 100)
    for number in (b"1" + b"0" * 4400, b"9" * 101, b"0." + b"1" * 100, b"-" + b"9" * 100):
        with pytest.raises(bounded_reads.BoundError, match="over the 100-character limit"):
            bounded_reads.loads(b'{"a": [' + number + b"]}")
    with pytest.raises(json.JSONDecodeError):  # not JSON stays a JSON error, not a bound
        bounded_reads.loads(b"[1, 2")
    with pytest.raises(UnicodeDecodeError):
        bounded_reads.loads(b'["\xff"]')
    with pytest.raises(bounded_reads.BoundError, match="deeper than 32"):
        bounded_reads.loads(deep_json(33))
    with pytest.raises(bounded_reads.BoundError, match="deeper than 32"):
        bounded_reads.loads(deep_json(1_000_000))


def test_lone_surrogate_in_a_prompt_is_a_clear_payload_error() -> None:
    raw = json.loads('{"v": 1, "task": "caption", "prompt": "caf\\ud800", "items": '
                     '[{"kind": "image", "blob": "' + SHA + '"}]}')
    with pytest.raises(PayloadError, match=r"prompt: is not valid UTF-8 text \(a lone "
                                           r"surrogate U\+D800 at character 3\)"):
        parse_payload(raw)
