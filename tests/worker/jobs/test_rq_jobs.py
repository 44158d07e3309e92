"""The RQ 3.0 lifecycle of batched jobs, against real Redis: what `rq info`, registries,
results and dead-worker cleanup see while one process runs many jobs at once."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner
from redis import Redis
from rq import Queue
from rq.cli import main as rq_cli
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import Worker, WorkerStatus

from tests.support.factories import job_payload
from tests.support.helpers import Tripwire, abandoned, raw_enqueue
from vlmq.shared import constants as C
from vlmq.shared import results
from vlmq.shared.enqueue import enqueue, fetch_job
from vlmq.shared.keys import Keys
from vlmq.shared.messages import JobPayload
from vlmq.worker.jobs.rq_jobs import BatchWorker, JobLifecycle, Refused, Running

QUEUES = ("high", "low")


def make_lifecycle(redis: Redis, **kwargs: object) -> JobLifecycle:
    worker = BatchWorker(list(QUEUES), connection=redis, name=f"batch-{uuid.uuid4().hex[:8]}",
                         **kwargs)  # type: ignore[arg-type]
    return JobLifecycle(worker)


@pytest.fixture
def life(redis: Redis) -> Iterator[JobLifecycle]:
    lc = make_lifecycle(redis)
    lc.register_birth()
    yield lc
    lc.register_death()


def take_running(life: JobLifecycle) -> Running:
    got = life.take()
    assert isinstance(got, Running), got
    return got


def take_refused(life: JobLifecycle) -> Refused:
    got = life.take()
    assert isinstance(got, Refused), got
    return got


def wip(redis: Redis, queue: str) -> list[bytes]:
    """The raw started-registry zset, without RQ's cleanup-on-read."""
    return list(redis.zrange(f"rq:wip:{queue}", 0, -1))


def failure_text(redis: Redis, job_id: str) -> str:
    result = fetch_job(redis, job_id).latest_result()
    assert result is not None and result.exc_string is not None
    return result.exc_string


# --- taking -------------------------------------------------------------------------------

def test_take_three_jobs_from_two_queues_runs_them_concurrently(redis, redis_url, life):
    low = enqueue(redis, job_payload(2), queue="low")
    high = [enqueue(redis, job_payload(2), queue="high") for _ in range(2)]

    running = [take_running(life) for _ in range(3)]
    assert life.take() is None
    # Priority order: "high" is drained before "low".
    assert [r.job_id for r in running] == [*high, low]
    assert [r.queue.name for r in running] == ["high", "high", "low"]
    assert life.in_flight == 3

    for r in running:
        assert fetch_job(redis, r.job_id).get_status() == JobStatus.STARTED
        assert len(r.payload.items) == 2
    assert sorted(StartedJobRegistry(queue=Queue("high", connection=redis)).get_job_ids()) \
        == sorted(high)
    assert StartedJobRegistry(queue=Queue("low", connection=redis)).get_job_ids() == [low]
    # Taken jobs leave the intermediate lists: RQ's maintenance fails anything left there.
    for q in QUEUES:
        assert redis.llen(f"rq:queue:{q}:intermediate") == 0

    workers = {w.name: w for w in Worker.all(connection=redis)}
    me = workers[life.worker.name]
    assert me.get_state() == WorkerStatus.BUSY
    assert me.queue_names() == list(QUEUES)
    assert {e.job_id for e in me.get_current_executions()} == {*high, low}

    out = CliRunner().invoke(rq_cli, ["info", "--url", redis_url, "--raw"])
    assert out.exit_code == 0, out.output
    assert f"worker {life.worker.name}" in out.output and "busy high, low" in out.output


def test_take_returns_none_on_empty_queues(life):
    assert life.take() is None
    assert life.in_flight == 0


def test_batch_worker_refuses_non_json_serializer(redis):
    with pytest.raises(ValueError, match="JSON serializer"):
        BatchWorker(["low"], connection=redis, serializer="pickle")
    worker = BatchWorker(["low"], connection=redis, serializer="json")
    with pytest.raises(ValueError, match="JSON serializer"):
        JobLifecycle(worker, [Queue("low", connection=redis)])


def test_batch_worker_refuses_rqs_single_job_loop(redis):
    worker = BatchWorker(["low"], connection=redis, heartbeat_ttl=9)
    with pytest.raises(NotImplementedError, match="JobLifecycle"):
        worker.work(burst=True)
    assert JobLifecycle(worker).heartbeat_interval == 3


def test_a_crashing_validator_fails_the_job_not_the_worker(redis, life, monkeypatch):
    def broken(job: Job) -> JobPayload:
        raise RuntimeError("validator bug")

    monkeypatch.setattr("vlmq.worker.jobs.taking.payload_of", broken)
    job_id = enqueue(redis, job_payload(2), queue="low")
    refused = take_refused(life)
    assert "validator bug" in refused.reason
    assert fetch_job(redis, job_id).get_status() == JobStatus.FAILED
    assert life.in_flight == 0


# --- ending -------------------------------------------------------------------------------

def test_succeed_keeps_the_summary_in_the_hash_and_leaves_no_wip_entries(redis, life):
    job_id = enqueue(redis, job_payload(2), queue="low")
    r = take_running(life)
    summary = {"items": 2, "ok": 2, "failed": 0, "prompt_tokens": 10,
               "completion_tokens": 7, "wall_s": 0.5, "cache_hits": 1}
    life.succeed(r, summary)

    job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FINISHED
    # the summary lives in the kept terminal event; RQ's results stream holds none
    assert results.read_end(redis, Keys(), job_id)["summary"] == summary
    assert job.return_value() is None and not redis.exists(Keys.rq_results(job_id))
    assert job_id in FinishedJobRegistry(queue=Queue("low", connection=redis)).get_job_ids()
    assert wip(redis, "low") == []
    assert redis.zcard(f"rq:executions:{job_id}") == 0
    assert redis.scard(life.worker.executions_key) == 0
    assert life.in_flight == 0
    me = {w.name: w for w in Worker.all(connection=redis)}[life.worker.name]
    assert me.get_state() == WorkerStatus.IDLE
    assert me.successful_job_count == 1


def test_succeed_rejects_a_summary_json_cannot_hold(redis, life):
    enqueue(redis, job_payload(2), queue="low")
    r = take_running(life)
    with pytest.raises(TypeError):
        life.succeed(r, {"when": object()})
    assert fetch_job(redis, r.job_id).get_status() == JobStatus.STARTED


def test_fail_records_message_in_failed_registry(redis, life):
    job_id = enqueue(redis, job_payload(2, model="other/model"), queue="low")
    r = take_running(life)
    life.fail(r, f"job wants model {r.payload.get('model')!r} but this worker runs 'tiny/qwen2-vl'")

    assert fetch_job(redis, job_id).get_status() == JobStatus.FAILED
    assert job_id in FailedJobRegistry(queue=Queue("low", connection=redis)).get_job_ids()
    text = failure_text(redis, job_id)
    assert "other/model" in text and "tiny/qwen2-vl" in text
    assert wip(redis, "low") == []
    assert life.in_flight == 0


def test_fail_retries_only_when_asked(redis, life):
    retried = enqueue(redis, job_payload(2), queue="low")
    final = enqueue(redis, job_payload(2), queue="low")
    for job_id in (retried, final):
        redis.hset(f"rq:job:{job_id}", "retries_left", 1)  # as if enqueued with Retry(max=1)

    life.fail(take_running(life), "transient", retry=True)
    assert fetch_job(redis, retried).get_status() == JobStatus.QUEUED
    assert Queue("low", connection=redis).get_job_ids() == [final, retried]

    life.fail(take_running(life), "bad input")  # the default spends no crash retry
    assert fetch_job(redis, final).get_status() == JobStatus.FAILED
    assert "bad input" in failure_text(redis, final)


# --- heartbeats ---------------------------------------------------------------------------

def test_heartbeats_keep_long_jobs_from_being_abandoned(redis):
    life = make_lifecycle(redis, heartbeat_ttl=2)
    life.register_birth()
    beating_id = enqueue(redis, job_payload(2), queue="low")
    silent_id = enqueue(redis, job_payload(2), queue="low")
    beating, _silent = take_running(life), take_running(life)

    # Beating until the silent one's execution has expired: the beaten one's has not.
    deadline = time.monotonic() + 120
    while not abandoned(redis, "low", silent_id):
        assert life.heartbeat([beating]) == []
        assert time.monotonic() < deadline, "the silent job's execution never expired"
        time.sleep(0.1)
    assert life.heartbeat([beating]) == []
    assert not abandoned(redis, "low", beating_id)
    StartedJobRegistry(queue=Queue("low", connection=redis)).cleanup()

    assert fetch_job(redis, beating_id).get_status() == JobStatus.STARTED
    # Without heartbeats RQ's cleanup takes the job for one of a dead worker: it spends
    # one of the crash retries vlmq enqueues with and puts the job back for the next worker.
    silent = fetch_job(redis, silent_id)
    assert silent.get_status() == JobStatus.QUEUED
    assert silent.retries_left == C.CRASH_RETRIES - 1
    assert redis.lrange("rq:queue:low", 0, -1) == [silent_id.encode()]

    life.succeed(beating, {"items": 2})
    assert fetch_job(redis, beating_id).get_status() == JobStatus.FINISHED
    life.register_death()


def test_heartbeat_reports_jobs_deleted_while_running(redis, life):
    kept_id = enqueue(redis, job_payload(2), queue="low")
    deleted_id = enqueue(redis, job_payload(2), queue="low")
    kept, deleted = take_running(life), take_running(life)
    fetch_job(redis, deleted_id).delete()

    assert life.heartbeat([kept, deleted]) == [(deleted, "deleted")]
    assert not redis.exists(f"rq:job:{deleted_id}")  # the heartbeat did not resurrect it
    assert fetch_job(redis, kept_id).get_status() == JobStatus.STARTED


def test_timed_out_follows_the_rq_job_timeout(redis, life):
    enqueue(redis, job_payload(2), queue="low", timeout=5)
    r = take_running(life)
    assert not r.timed_out()
    assert r.timed_out(at=r.started + 6)


# --- refusals -----------------------------------------------------------------------------

def test_pickled_job_is_refused_without_unpickling(redis, life, tmp_path):
    marker = tmp_path / "unpickled"
    pickle_queue = Queue("low", connection=redis)  # RQ's default serializer: pickle
    job = pickle_queue.enqueue_call(func=C.TASK_FUNC, args=(Tripwire(marker),),
                                    meta={"trap": Tripwire(marker)})

    refused = take_refused(life)
    assert refused.job_id == job.id and refused.queue == "low"
    assert "not JSON" in refused.reason
    assert fetch_job(redis, job.id).get_status() == JobStatus.FAILED
    assert "never unpickle" in failure_text(redis, job.id)
    assert job.id in FailedJobRegistry(queue=Queue("low", connection=redis,
                                                   serializer=JSONSerializer)).get_job_ids()
    assert wip(redis, "low") == []
    assert life.in_flight == 0
    assert not marker.exists()


@pytest.mark.parametrize(("bad", "field"), [
    ({"v": 1, "task": "ocr"}, "items"),
    ({"v": 1, "task": "ocr", "items": [{"kind": "image", "blob": "not-a-sha"}]}, "items[0].blob"),
])
def test_malformed_payload_is_failed_naming_the_field(redis, life, bad, field):
    job_id = raw_enqueue(redis, bad, queue="low")
    refused = take_refused(life)
    assert refused.job_id == job_id
    assert fetch_job(redis, job_id).get_status() == JobStatus.FAILED
    assert f"{field}:" in failure_text(redis, job_id)
    assert wip(redis, "low") == []


def test_malformed_job_tuple_is_refused(redis, life):
    job_id = raw_enqueue(redis, job_payload(2).to_dict(), queue="low")
    redis.hset(f"rq:job:{job_id}", "data", '{"not": "a tuple"}')
    refused = take_refused(life)
    assert "[func, instance, args, kwargs]" in refused.reason
    assert fetch_job(redis, job_id).get_status() == JobStatus.FAILED


def test_unreadable_job_hash_is_failed_without_crashing(redis, life):
    bad_id = raw_enqueue(redis, job_payload(2).to_dict(), queue="low")
    good_id = raw_enqueue(redis, job_payload(2).to_dict(), queue="low")
    redis.hset(f"rq:job:{bad_id}", "created_at", "yesterday")  # Job.restore raises on it

    refused = take_refused(life)
    assert refused.job_id == bad_id and "cannot read" in refused.reason
    assert Job(bad_id, connection=redis).get_status() == JobStatus.FAILED
    assert redis.zscore("rq:failed:low", bad_id) is not None
    assert redis.llen("rq:queue:low:intermediate") == 0
    assert take_running(life).job_id == good_id


def test_lua_job_without_origin_is_repaired_into_its_queue(redis, life):
    job_id = raw_enqueue(redis, job_payload(2).to_dict(), queue="low")
    redis.hdel(f"rq:job:{job_id}", "origin")
    r = take_running(life)
    assert r.job.origin == "low"
    assert StartedJobRegistry(queue=Queue("low", connection=redis)).get_job_ids() == [job_id]
    life.succeed(r, {"items": 2})
    assert wip(redis, "low") == []


# --- shutdown -----------------------------------------------------------------------------

def test_requeue_puts_job_back_first_for_another_worker(redis, life):
    first = enqueue(redis, job_payload(2), queue="low")
    second = enqueue(redis, job_payload(2), queue="low")
    r = take_running(life)
    assert r.job_id == first

    life.requeue(r)
    assert fetch_job(redis, first).get_status() == JobStatus.QUEUED
    assert Queue("low", connection=redis).get_job_ids() == [first, second]
    assert StartedJobRegistry(queue=Queue("low", connection=redis)).get_job_ids() == []
    assert wip(redis, "low") == []
    assert redis.scard(life.worker.executions_key) == 0
    assert life.in_flight == 0

    other = make_lifecycle(redis)
    other.register_birth()
    again = take_running(other)
    assert again.job_id == first
    other.succeed(again, {"items": 2})
    end = results.read_end(redis, Keys(), first)
    assert end is not None and end["summary"] == {"items": 2}
    other.register_death()


def test_register_death_removes_the_worker(redis):
    life = make_lifecycle(redis)
    life.register_birth()
    assert life.worker.name in {w.name for w in Worker.all(connection=redis)}
    life.register_death()
    assert life.worker.name not in {w.name for w in Worker.all(connection=redis)}


def test_maintain_runs_rq_registry_cleanup(redis, life):
    enqueue(redis, job_payload(2), queue="low")
    take_running(life)
    life.maintain()  # first call is always due; must not touch live, heartbeated jobs
    assert life.worker.last_cleaned_at is not None
    assert life.in_flight == 1 and len(wip(redis, "low")) == 1
