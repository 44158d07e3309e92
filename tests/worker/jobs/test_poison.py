"""Poison attribution: a dead worker's job in risky work is charged; the others are not."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager

import pytest
from redis import Redis
from rq.job import JobStatus

from tests.support.factories import job_payload
from tests.support.helpers import abandoned, wait_for
from vlmq.shared import constants as C
from vlmq.shared.enqueue import enqueue, fetch_job
from vlmq.shared.keys import Keys
from vlmq.worker.jobs.poison import RiskLog
from vlmq.worker.jobs.rq_jobs import BatchWorker, JobLifecycle, Running

_NEVER_EXITED: list[AbstractContextManager[None]] = []


def lifecycle(redis: Redis, ttl: int) -> JobLifecycle:
    worker = BatchWorker(["q"], connection=redis, name=f"w-{uuid.uuid4().hex[:8]}",
                         heartbeat_ttl=ttl)
    life = JobLifecycle(worker, keys=Keys(), poison_kills=2)
    life.register_birth()
    return life


def die_with(redis: Redis, poisoned: str, *, ttl: int = 1) -> str:
    """A worker takes every queued job, enters risky work on `poisoned` item 1, and dies
    there (no exit from the step, no more heartbeats). Returns its name."""
    life = lifecycle(redis, ttl)
    taken: list[Running] = []
    while (r := life.take()) is not None:
        assert isinstance(r, Running)
        taken.append(r)
    assert poisoned in {r.job_id for r in taken}
    step = RiskLog(redis, Keys(), life.worker.name).step(poisoned, 1, "image decode")
    step.__enter__()
    _NEVER_EXITED.append(step)  # a dead process never leaves the step (nor GCs it)
    time.sleep(ttl + 1.2)  # its executions expire (registry scores are whole seconds)
    return life.worker.name


def reclaim(redis: Redis) -> None:
    life = lifecycle(redis, 60)
    life.worker.last_cleaned_at = None  # maintenance due now
    life.maintain()
    life.register_death()


@pytest.fixture(autouse=True)
def _exit_steps() -> Iterator[None]:
    yield
    while _NEVER_EXITED:  # close them while Redis is still reachable
        _NEVER_EXITED.pop().__exit__(None, None, None)


def test_only_the_job_in_risky_work_is_charged_and_fails_at_poison_kills(redis: Redis) -> None:
    bad = enqueue(redis, job_payload(3), queue="q")
    innocent = enqueue(redis, job_payload(3), queue="q")

    first = die_with(redis, bad)
    reclaim(redis)
    b, i = fetch_job(redis, bad), fetch_job(redis, innocent)
    assert b.get_status() == i.get_status() == JobStatus.QUEUED
    assert i.retries_left == C.CRASH_RETRIES  # requeued without spending a retry
    assert b.retries_left == C.CRASH_RETRIES - 1  # charged: RQ's retry spent
    assert redis.hget(Keys().job_kills(bad), "count") == b"1"
    assert not redis.exists(Keys().job_risk(bad))

    second = die_with(redis, bad)
    reclaim(redis)
    b, i = fetch_job(redis, bad), fetch_job(redis, innocent)
    assert b.get_status() == JobStatus.FAILED
    result = b.latest_result()
    assert result is not None and result.exc_string is not None
    assert "item 1 killed 2 worker(s)" in result.exc_string
    assert second in result.exc_string and first != second
    assert "--poison-kills 2" in result.exc_string
    assert i.get_status() == JobStatus.QUEUED and i.retries_left == C.CRASH_RETRIES
    events = redis.xrange(Keys().job_events(bad))
    assert events[-1][1][b"type"] == b"failed"


def test_a_death_nobody_is_charged_for_spends_one_retry_of_each_job(redis: Redis) -> None:
    """No item was in risky work (an operator's kill -9, or a crash in an unwatched step):
    RQ's own accounting applies, so a job that keeps killing workers there still runs out
    of retries instead of being requeued forever."""
    ids = [enqueue(redis, job_payload(3), queue="q") for _ in range(2)]
    life = lifecycle(redis, 1)
    while life.take() is not None:
        pass
    wait_for(lambda: abandoned(redis, "q", *ids), 120, "its executions to expire unbeaten")
    reclaim(redis)
    for job in (fetch_job(redis, j) for j in ids):
        assert job.get_status() == JobStatus.QUEUED
        assert job.retries_left == C.CRASH_RETRIES - 1
        assert not redis.exists(Keys().job_kills(job.id))


def test_risk_records_are_cleared_when_the_step_ends(redis: Redis) -> None:
    risk = RiskLog(redis, Keys(), "w")
    with risk.step("j1", 4, "image decode"):
        assert redis.hget(Keys().job_risk("j1"), "4").startswith(b"w|image decode|")
    assert not redis.exists(Keys().job_risk("j1"))
    try:
        with risk.step("j1", 5, "vision tower"):
            raise ValueError("bad input fails the item, it does not kill the worker")
    except ValueError:
        pass
    assert not redis.exists(Keys().job_risk("j1"))


def test_junk_in_a_jobs_kill_count_or_risk_record_stops_no_reclaim(redis: Redis) -> None:
    """A foreign writer's junk in the keys the reclaim reads (a kill count that is no
    number, a risk key of another type): the next worker's maintenance still runs, the job
    in risky work is charged from a fresh count, and the other keeps its retries."""
    bad = enqueue(redis, job_payload(3), queue="q")
    innocent = enqueue(redis, job_payload(3), queue="q")
    redis.hset(Keys().job_kills(bad), "count", "1" + "0" * 5000)
    die_with(redis, bad)
    redis.rpush(Keys().job_risk(innocent), "not a hash")
    reclaim(redis)
    b, i = fetch_job(redis, bad), fetch_job(redis, innocent)
    assert b.get_status() == i.get_status() == JobStatus.QUEUED
    assert redis.hget(Keys().job_kills(bad), "count") == b"1"
    assert b.retries_left == C.CRASH_RETRIES - 1
    assert i.retries_left == C.CRASH_RETRIES
