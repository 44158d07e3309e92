"""One raw write stops no worker: a job whose data holds an integer too long to convert,
and a job key stored as a Redis list, through real workers and the CLI.

Both are what a producer in another language can write with HSET/RPUSH, skipping
enqueue.lua. Each fails (or is dead-lettered) alone, once, with its reason; the valid jobs
taken in the same moment run; a worker that starts later with the poison still in RQ's
intermediate list starts and serves; `vlmq status`, `result` and `retry` answer one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis import Redis

from tests.support import helpers
from vlmq.producer.client import Client
from vlmq.producer.options import JobOptions
from vlmq.shared import constants as C
from vlmq.shared.enqueue import raw_exc_info
from vlmq.shared.keys import Keys
from vlmq.shared.messages import utc_now_iso

QUEUE = "rawq"
OPTS = JobOptions(max_tokens=4, max_side=56, queue=QUEUE)
HUGE_REASON = "job data holds a number of 4401 characters"
LIST_REASON = "is a Redis list, where vlmq keeps a hash"

pytestmark = pytest.mark.slow


def huge_int_job(redis: Redis, job_id: str, blob: str) -> None:
    """The issue's job: `"max_side": 1000...0` (4,401 digits), written as a hash and
    pushed, as any Redis client can."""
    payload = {"v": 1, "task": "caption", "items": [{"kind": "image", "blob": blob}],
               "max_side": 0}
    data = json.dumps([C.TASK_FUNC, None, [payload], {}]).replace(
        '"max_side": 0', '"max_side": 1' + "0" * 4400)
    now = utc_now_iso()
    redis.hset(Keys.rq_job(job_id), mapping={
        "data": data, "origin": QUEUE, "description": "raw", "timeout": C.JOB_TIMEOUT_S,
        "result_ttl": C.RESULT_TTL_S, "failure_ttl": C.FAILURE_TTL_S, "created_at": now,
        "enqueued_at": now, "status": "queued", "meta": "{}"})
    redis.rpush(Keys.rq_queue(QUEUE), job_id)


def list_job(redis: Redis, job_id: str) -> None:
    redis.rpush(Keys.rq_job(job_id), "not", "a", "hash")
    redis.rpush(Keys.rq_queue(QUEUE), job_id)


def dead_reasons(redis: Redis, entry: str) -> list[str]:
    return [r["reason"] for r in map(json.loads, redis.lrange(Keys().dead, 0, -1))
            if r["entry"] == entry]


def texts(client: Client, job_id: str) -> list[str | None]:
    return [r.text for r in helpers.finished_results(client, job_id)]


def test_poison_beside_valid_jobs_fails_alone_and_no_worker_stops(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: helpers.Spawn) -> None:
    images = helpers.make_images(tmp_path / "in", 4)
    worker_args = ("--queues", QUEUE, "--burst", "--max-batch", "8", "--result-cache-mb", "0")
    with Client(redis_url) as client:
        before = [client.caption([p], options=OPTS).id for p in images[:2]]
        blob = client.job(before[0]).payload().items[0].blob
        assert blob is not None
        huge_int_job(redis, "huge", blob)
        list_job(redis, "listed")
        after = [client.caption([p], options=OPTS).id for p in images[2:]]
        # One worker takes all six in one take (batch room 8): exit 0, the four run.
        code, out = helpers.finish(start_worker(redis_url, tiny_model, tmp_path, *worker_args,
                                                name="first"), timeout=300)
        assert code == 0, out
        assert "Traceback" not in out, out
        first = {j: texts(client, j) for j in before + after}
        assert all(t and t[0] for t in first.values()), first

        assert redis.hget(Keys.rq_job("huge"), "status") == b"failed"
        assert HUGE_REASON in (raw_exc_info(redis, "huge") or "")
        assert len(dead_reasons(redis, "huge")) == 1 and HUGE_REASON in dead_reasons(
            redis, "huge")[0]
        assert redis.lrange(Keys.rq_job("listed"), 0, -1) == [b"not", b"a", b"hash"]
        (reason,) = dead_reasons(redis, "listed")
        assert LIST_REASON in reason

        # The CLI on both: a clear error line (`result` adds the status and the failure
        # below it), never a traceback (invoke_cli would raise one).
        for job_id, why in (("huge", HUGE_REASON), ("listed", "is a Redis list, not a job hash")):
            for command in (["status", job_id], ["result", job_id], ["retry", job_id]):
                res = helpers.invoke_cli(redis_url, *command)
                shown = res.stdout + res.stderr
                assert why in shown, (command, shown)
                assert "Traceback" not in shown, (command, shown)
                if command[0] != "status" or job_id == "listed":
                    assert res.exit_code != 0, (command, shown)
                    assert res.stderr.startswith("vlmq: error: ") and why in \
                        res.stderr.splitlines()[0], (command, shown)

        # As a worker that died between its take and its start would leave them (the old
        # worker did): both in RQ's intermediate list, a valid job queued behind. The next
        # worker starts, dead-letters them at its first maintenance, and serves the job.
        huge_int_job(redis, "huge2", blob)
        list_job(redis, "listed2")
        for _ in range(2):
            redis.lmove(Keys.rq_queue(QUEUE), f"{Keys.rq_queue(QUEUE)}:intermediate")
        last = client.caption([images[0]], options=OPTS).id
        code, out = helpers.finish(start_worker(redis_url, tiny_model, tmp_path, *worker_args,
                                                name="second"), timeout=300)
        assert code == 0, out
        assert texts(client, last) == first[before[0]]
    assert redis.llen(f"{Keys.rq_queue(QUEUE)}:intermediate") == 0
    assert redis.hget(Keys.rq_job("huge2"), "status") == b"failed"
    assert len(dead_reasons(redis, "huge2")) == 1 and len(dead_reasons(redis, "listed2")) == 1
    assert len(dead_reasons(redis, "huge")) == 1 and len(dead_reasons(redis, "listed")) == 1
    # And the operator can remove the failed one like any other job.
    deleted = helpers.invoke_cli(redis_url, "delete", "huge")
    assert deleted.exit_code == 0 and not redis.exists(Keys.rq_job("huge")), deleted.output
