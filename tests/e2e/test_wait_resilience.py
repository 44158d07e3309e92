"""Connection resets, ridden out: `vlmq wait`, and poison risk records.

A Redis restart (every connection reset, new ones refused for longer than redis-py's own
retries last) used to end the wait with exit 1, the code for "a job failed". Now the wait
goes on and exits 0 once the job finishes; a Redis still down at --timeout exits 69.

A risk record whose deletion met a reset stayed in Redis, ready to charge its job for a
later death of that worker; now it is deleted once Redis answers again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import PIPE, Popen

import pytest
from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.helpers import (
    VLMQ,
    PersistentRedis,
    following_events,
    make_images,
    wait_for,
    worker_lifecycle,
)
from vlmq.cli.results import EXIT_UNREACHABLE
from vlmq.producer.client import Client
from vlmq.shared.keys import Keys
from vlmq.worker.jobs.poison import RiskLog
from vlmq.worker.jobs.rq_jobs import Running
from vlmq.worker.redis_server import server_binary

pytestmark = pytest.mark.slow
# Longer than redis-py's default retries (3, jittered backoff of at most 1 + 2 + 4 s).
OUTAGE_S = 8.0


@pytest.fixture
def persistent_redis(tmp_path: Path) -> Iterator[PersistentRedis]:
    """A private Redis whose data survives its restart (append-only file)."""
    binary = server_binary() or pytest.skip("needs redis-server to restart a private Redis")
    srv = PersistentRedis(binary, tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@contextmanager
def waiting(srv: PersistentRedis, inputs: Path, timeout: float) -> Iterator[tuple[str, Popen[str]]]:
    """A one-image job and `vlmq wait --timeout` on it, past its first reads (inside
    wait_all's loop: Redis lists a client blocked in XREAD on the job's events); the wait
    is killed on the way out."""
    with Client(srv.url) as client:
        job = client.caption(make_images(inputs, 1))
    proc = Popen([VLMQ, "--redis-url", srv.url, "wait", job.id, "--timeout", str(timeout)],
                 stdout=PIPE, stderr=PIPE, text=True)

    def following() -> bool:
        assert proc.poll() is None, proc.communicate()
        return following_events(conn)

    with Redis.from_url(srv.url) as conn:
        wait_for(following, 300, "`vlmq wait` to follow the job's events")
    try:
        yield job.id, proc
    finally:
        proc.kill()
        proc.wait()


def test_wait_survives_a_redis_restart_and_exits_0(persistent_redis: PersistentRedis,
                                                   tmp_path: Path) -> None:
    with waiting(persistent_redis, tmp_path / "in", 600) as (job_id, proc):
        persistent_redis.stop()
        time.sleep(OUTAGE_S)
        persistent_redis.start()
        with Redis.from_url(persistent_redis.url) as conn:
            queue = conn.hget(f"rq:job:{job_id}", "origin")
            with worker_lifecycle(conn, [queue.decode() if queue else ""]) as life:
                running = life.take()
                assert isinstance(running, Running)
                assert life.succeed(running, {"ok": 1, "failed": 0}) is None
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out, err)
    assert f"{job_id}: finished" in out


def test_wait_exits_69_when_redis_is_still_down_at_its_timeout(persistent_redis: PersistentRedis,
                                                                tmp_path: Path) -> None:
    with waiting(persistent_redis, tmp_path / "in", 10) as (_, proc):
        persistent_redis.stop()
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_UNREACHABLE, (out, err)
    assert "still unreachable after 10s" in err


def test_a_risk_record_a_reset_left_behind_is_cleared_once_redis_is_back(
        persistent_redis: PersistentRedis) -> None:
    # No client retries: the deletion meets the outage, as after a reset mid-step.
    with Redis.from_url(persistent_redis.url, retry=Retry(NoBackoff(), 0)) as conn, \
            Redis.from_url(persistent_redis.url) as check:
        risk = RiskLog(conn, Keys(), "w")
        for job_id, cleared_by in (("j1", "flush"), ("j2", "the next step")):
            with risk.step(job_id, 4, "image decode"):
                persistent_redis.stop()
            assert risk.uncleared == 1
            persistent_redis.start()
            assert check.hexists(Keys().job_risk(job_id), "4"), "the outage kept the record"
            if cleared_by == "flush":
                risk.flush()
            else:
                with risk.step("other", 0, "vision tower"):
                    pass
            assert not check.exists(Keys().job_risk(job_id)), cleared_by
            assert risk.uncleared == 0
