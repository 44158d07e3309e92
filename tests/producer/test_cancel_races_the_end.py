"""A cancel that races a job's end: the job's worker ends it (its execution record goes,
in the same transaction as its status) between the cancel's read of the job and RQ's read
of the execution. Reproduced deterministically by ending the job from inside RQ's read of
the execution registry, the moment the race opens. The cancel then answers that the job
ended (never RQ's `Execution ... not found`, which the API answered as a 500), the job
stays as it ended, and an API batch reaches `cancelled` with its other jobs cancelled,
never staying `cancelling`. Real Redis, RQ's own writes for a worker's start and end."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from flask import Flask
from redis import Redis
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job as RQJob
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from tests.producer.test_bounded_lines import request
from tests.support import openai_api as T
from vlmq.producer import job_admin
from vlmq.producer.client import Client
from vlmq.producer.openai_files import submit_openai_batch
from vlmq.shared import results
from vlmq.shared.keys import Keys


def start(redis: Redis, job_id: str) -> Execution:
    """What a worker's start writes, as RQ writes it: an execution, status started."""
    job = RQJob.fetch(job_id, connection=redis, serializer=JSONSerializer)
    pipe = redis.pipeline()
    execution = Execution.create(job, ttl=300, pipeline=pipe, worker_name="w1")
    job.set_status(JobStatus.STARTED, pipeline=pipe)
    pipe.lrem(Keys.rq_queue(job.origin), 0, job_id)
    pipe.execute()
    return execution


def finish(redis: Redis, keys: Keys, job_id: str, execution: Execution) -> None:
    """What a worker's end writes, in one transaction: finished, its execution gone."""
    job = RQJob.fetch(job_id, connection=redis, serializer=JSONSerializer)
    pipe = redis.pipeline()
    job.set_status(JobStatus.FINISHED, pipeline=pipe)
    execution.delete(job=job, pipeline=pipe)
    results.end_job_event(redis, keys, job_id, "finished", queue=job.origin, ttl_s=600,
                          fields={"items": 1, "ok": 1, "failed": 0}, pipeline=pipe)
    pipe.execute()


def end_during_rq_read(monkeypatch: pytest.MonkeyPatch, end: Callable[[str], None],
                       ends: set[str], *, before: bool = False) -> None:
    """When RQ's cancel reads the execution ids of a job in `ends`, that job ends (once)
    right after the read (RQ then reads a record that is gone), or right before it (RQ
    then finds none and writes over the end): the race, at the moment it opens."""
    original = ExecutionRegistry.get_execution_ids

    def racing(self: ExecutionRegistry, *args: Any, **kwargs: Any) -> list[str]:
        due = self.job_id in ends
        ends.discard(self.job_id)
        if due and before:
            end(self.job_id)
        ids: list[str] = original(self, *args, **kwargs)
        if due and not before:
            end(self.job_id)
        return ids

    monkeypatch.setattr(ExecutionRegistry, "get_execution_ids", racing)


@pytest.mark.parametrize("before", [False, True], ids=["after-the-read", "before-the-read"])
def test_a_job_that_ends_as_it_is_cancelled_stays_finished(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: bool) -> None:
    client = Client(redis_url)
    path = tmp_path / "in.jsonl"
    path.write_text(request("a") + "\n")
    batch, _ = submit_openai_batch(client, path)
    (job_id,) = [j.id for j in batch.jobs()]
    execution = start(client.redis, job_id)
    end_during_rq_read(monkeypatch, lambda j: finish(client.redis, client.keys, j, execution),
                       {job_id}, before=before)
    with pytest.raises(job_admin.CannotCancel, match="already finished"):
        job_admin.cancel(client.redis, client.keys, job_id)
    assert client.redis.hget(Keys.rq_job(job_id), "status") == b"finished"
    assert b'"type": "finished"' in (client.redis.hget(client.keys.job_end(job_id), "event")
                                     or b"").replace(b'":"', b'": "')
    client.close()


def test_an_execution_whose_record_is_gone_does_not_stop_a_cancel(redis_url: str,
                                                                  tmp_path: Path) -> None:
    client = Client(redis_url)
    path = tmp_path / "in.jsonl"
    path.write_text(request("a") + "\n")
    batch, _ = submit_openai_batch(client, path)
    (job_id,) = [j.id for j in batch.jobs()]
    execution = start(client.redis, job_id)
    client.redis.delete(execution.key)  # its record's TTL ran out; the registries still list it
    job_admin.cancel(client.redis, client.keys, job_id)
    assert client.redis.hget(Keys.rq_job(job_id), "status") == b"canceled"
    assert client.redis.zcard(RQJob.fetch(job_id, connection=client.redis,
                                          serializer=JSONSerializer)
                              .started_job_registry.key) == 0
    client.close()


@pytest.fixture
def app(redis_url: str, tmp_path: Path) -> Iterator[Flask]:
    with T.in_process_app(redis_url, tmp_path / "files") as made:
        yield made



def until(api: openai.OpenAI, batch_id: str, leave: str) -> str:
    for _ in range(400):
        status = api.batches.retrieve(batch_id).status
        if status != leave:
            return status
        time.sleep(0.05)
    raise AssertionError(f"{batch_id} stayed {leave}")


def test_an_api_cancel_racing_the_end_succeeds_and_ends_cancelled(
        app: Flask, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api = T.sdk(app)
    client = Client(redis_url)
    path = tmp_path / "in.jsonl"
    # Lines of distinct max_tokens: three jobs.
    path.write_text("".join(request(f"r{i}", max_completion_tokens=4 + i) + "\n"
                            for i in range(3)))
    made = api.files.create(file=path, purpose="batch")
    batch = api.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    assert until(api, batch.id, "validating") == "in_progress"
    vlmq_batch = client.redis.hget(client.keys.api_batch(batch.id), "vlmq_batch")
    jobs = client.batch(vlmq_batch.decode()).job_ids()
    assert len(jobs) == 3
    executions = {j: start(client.redis, j) for j in jobs}
    # The first job ends as the cancel reaches it; the others are running.
    end_during_rq_read(monkeypatch, lambda j: finish(client.redis, client.keys, j,
                                                     executions[j]), {jobs[0]})
    cancelled = api.batches.cancel(batch.id)  # a 500 raises openai.InternalServerError
    assert cancelled.status in ("cancelling", "cancelled")
    assert until(api, batch.id, "cancelling") == "cancelled"
    states = [client.redis.hget(Keys.rq_job(j), "status") for j in jobs]
    assert states == [b"finished", b"canceled", b"canceled"]
    with pytest.raises(openai.ConflictError):  # ended: a clear 409, not a 500
        api.batches.cancel(batch.id)
    client.close()


def test_a_batch_whose_cancel_missed_a_job_is_cancelled_on_the_next_look(
        app: Flask, redis_url: str, tmp_path: Path) -> None:
    api = T.sdk(app)
    client = Client(redis_url)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(request(f"r{i}", max_completion_tokens=4 + i) + "\n"
                            for i in range(2)))
    made = api.files.create(file=path, purpose="batch")
    batch = api.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    assert until(api, batch.id, "validating") == "in_progress"
    vlmq_batch = client.redis.hget(client.keys.api_batch(batch.id), "vlmq_batch")
    jobs = client.batch(vlmq_batch.decode()).job_ids()
    # A cancel recorded while one job escaped it (it was enqueued or taken meanwhile).
    client.redis.hset(client.keys.api_batch(batch.id), "cancelling_at", int(time.time()))
    job_admin.cancel(client.redis, client.keys, jobs[0])
    # Cancelling again while one is under way is the same cancel: a 200, not a 409.
    assert api.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    assert until(api, batch.id, "cancelling") == "cancelled"
    assert [client.redis.hget(Keys.rq_job(j), "status") for j in jobs] == [b"canceled"] * 2
    client.close()
