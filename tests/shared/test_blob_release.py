"""A job lets go of its blobs by one rule whoever ends it: a deleted job through
BlobStore.release (blob_release.lua) and a finished one through end_job.lua run the same
Lua (shared/blob_release_lib.lua, copied into both), so they leave the same state."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from redis import Redis
from redis.exceptions import ResponseError

from vlmq.shared import lua
from vlmq.shared.blobs import BlobStore
from vlmq.shared.keys import Keys
from vlmq.shared.results import end_job_event

KEYS = Keys("rel")
JOB = "j-release"
HOUR_MS = 3600 * 1000
# The blobs of the job, each with the other holders it shares them with.
LIVE, FAILED, STALE, ALONE = "a" * 64, "b" * 64, "c" * 64, "d" * 64
KEEP_S = {LIVE: 30, FAILED: 40, STALE: 50, ALONE: 60}


def _setup(redis: Redis) -> None:
    """The job holds four blobs: one another live job holds too, one a failed job holds
    for two more hours, one only a failed job whose record expired holds, one it alone."""
    now_ms = int(redis.time()[0]) * 1000
    others: dict[str, dict[str, float]] = {
        LIVE: {"j-live": math.inf}, FAILED: {"j-failed": now_ms + 2 * HOUR_MS},
        STALE: {"j-gone": now_ms - HOUR_MS}, ALONE: {}}
    for sha, holders in others.items():
        redis.set(KEYS.blob(sha), b"x", px=5 * HOUR_MS)
        redis.zadd(KEYS.blob_jobs(sha), {JOB: math.inf, **holders})
        redis.pexpire(KEYS.blob_jobs(sha), 5 * HOUR_MS)
    redis.hset(KEYS.job_inputs(JOB), mapping=KEEP_S)


def _state(redis: Redis) -> dict[str, object]:
    """The blob keys' holders and lifetimes (to the minute: the two runs are apart)."""
    out: dict[str, object] = {"inputs": redis.exists(KEYS.job_inputs(JOB))}
    for sha in KEEP_S:
        out[sha] = (sorted(m.decode() for m in redis.zrange(KEYS.blob_jobs(sha), 0, -1)),
                    round(int(redis.pttl(KEYS.blob(sha))) / 60_000),
                    round(int(redis.pttl(KEYS.blob_jobs(sha))) / 60_000))
    return out


def _delete(redis: Redis) -> None:
    assert BlobStore(redis, KEYS).release(JOB) == len(KEEP_S)


def _finish(redis: Redis) -> None:
    redis.hset(Keys.rq_job(JOB), mapping={"status": "finished", "data": "{}"})
    end_job_event(redis, KEYS, JOB, "finished", queue=None, ttl_s=600)


def _run(redis: Redis, end: Callable[[Redis], None]) -> dict[str, object]:
    redis.flushdb()
    _setup(redis)
    end(redis)
    return _state(redis)


def test_deleting_and_finishing_a_job_release_its_blobs_alike(redis: Redis) -> None:
    deleted, finished = _run(redis, _delete), _run(redis, _finish)
    assert deleted == finished
    # and the rule itself: a live holder keeps the blob's TTL, a failed holder's record
    # sets it, an expired holder is pruned, a blob alone gets the job's keep_inputs
    assert deleted == {
        "inputs": 0,
        LIVE: (["j-live"], 300, 300),
        FAILED: (["j-failed"], 120, 120),
        STALE: ([], 1, 0),  # no holder left: the empty set is gone
        ALONE: ([], 1, 0),
    }


def test_release_of_a_job_holding_nothing_is_zero(redis: Redis) -> None:
    assert BlobStore(redis, KEYS).release("j-none") == 0
    assert list(redis.scan_iter(f"{KEYS.prefix}:*")) == []


@pytest.mark.parametrize("name", [lua.END_JOB, lua.BLOB_RELEASE])
def test_both_scripts_carry_the_one_library(name: str) -> None:
    lib = lua.script_path(lua.BLOBS_LIB).read_text(encoding="utf-8")
    assert lib.strip() in lua.source(name)


def test_release_refuses_keys_of_another_job(redis: Redis) -> None:
    with pytest.raises(ResponseError, match="KEYS\\[1\\]: must be"):
        lua.script(redis, lua.BLOB_RELEASE)(keys=[KEYS.job_inputs("other")], args=[JOB])
