"""Poison attribution: when a worker dies, charge the job whose item was in risky work.

RQ treats every job of a dead worker alike: each spends a retry, and after three deaths
an innocent job that merely shared a batch with a poison item is failed with only
"AbandonedJobError". vlmq records, before each step that could take the process down on
one item's input (decoding its image, running the vision tower and prefill on it), a
field `<index>` = "<worker>|<step>" in `<prefix>:job:<id>:risk`, deleted when the step
ends. A worker that dies leaves the field behind.

The reclaiming side (registry maintenance, under RQ's own per-queue maintenance lock and
before RQ's cleanup of abandoned jobs) reads it:
- a job with a risk record is charged: its kill count goes up; at `poison_kills` it is
  failed naming the item, otherwise RQ retries it as usual (spending a retry);
- every other abandoned job is requeued without spending a retry (its retries_left is
  raised by one before RQ's cleanup lowers it), and resumes at item level.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from redis import Redis
from redis.exceptions import RedisError, ResponseError
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer

from vlmq.shared import constants as C
from vlmq.shared.enqueue import fail_job
from vlmq.shared.keys import Keys
from vlmq.shared.logs import job_fields
from vlmq.shared.redis_text import as_str

log = logging.getLogger(__name__)

RISK_TTL_S = C.FAILURE_TTL_S  # outlives any reclaim; deleted as soon as the step ends


class RiskLog:
    """Marks item steps that could kill this process (thread-safe: one Redis per call).

    A record whose deletion failed (the connection was reset as its step ended) is kept in
    memory and deleted at the next step or `flush()`, as soon as Redis answers again. Left
    in Redis, it would charge its job if this worker died later in unrelated work.
    """

    def __init__(self, redis: Redis, keys: Keys, worker: str) -> None:
        self.redis = redis
        self.keys = keys
        self.worker = worker
        self._uncleared: set[tuple[str, str]] = set()  # (risk key, index) left in Redis
        self._lock = threading.Lock()

    @property
    def uncleared(self) -> int:
        """Records this worker could not delete yet."""
        with self._lock:
            return len(self._uncleared)

    def flush(self) -> None:
        """Delete the records left by steps that ended while Redis was unreachable; the
        worker calls it after each heartbeat. Raises RedisError while Redis is still away."""
        with self._lock:
            pending = list(self._uncleared)
        if not pending:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for key, index in pending:
                pipe.hdel(key, index)
            pipe.execute()
        with self._lock:
            self._uncleared.difference_update(pending)
        log.info("%d risk record(s) left by a Redis outage cleared", len(pending))

    @contextmanager
    def step(self, job_id: str, index: int, what: str) -> Iterator[None]:
        key, field = self.keys.job_risk(job_id), str(index)
        with self._lock:
            self._uncleared.discard((key, field))  # rewritten now, deleted when this ends
        try:
            self.flush()
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, field, f"{self.worker}|{what}|{time.time():.0f}")
                pipe.expire(key, RISK_TTL_S)
                pipe.execute()
        except RedisError as exc:  # Redis down: the work goes on, unattributed if it kills
            log.debug("job %s item %d: risk record not written (%s)", job_id, index, exc,
                      extra=job_fields(job_id, index))
        try:
            yield
        finally:
            try:
                self.redis.hdel(key, field)
            except RedisError as exc:  # deleted at the next step or flush, once Redis is back
                with self._lock:
                    self._uncleared.add((key, field))
                log.warning("job %s item %d: risk record not cleared yet (%s)", job_id, index,
                            exc, extra=job_fields(job_id, index))


def reclaim(redis: Redis, keys: Keys, queue: Queue, *, poison_kills: int,
            at: float | None = None) -> None:
    """Attribute the abandoned jobs of `queue` before RQ's cleanup handles them.

    `at` is the cutoff, Redis's time (TIME) by default: never this machine's clock, which
    may run ahead of the workers whose heartbeats scored the registry.

    Runs under the queue's maintenance lock (taken here; skipped when another worker holds
    it), so two workers never reclaim the same job.
    """
    if at is None:
        secs, micros = redis.time()
        at = int(secs) + int(micros) / 1e6
    if not queue.acquire_maintenance_lock():
        return
    try:
        registry = queue.started_job_registry
        expired = [str(j) for j in registry.get_expired_job_ids(at)]
        culprits = _culprit_workers(redis, keys, expired)
        for job_id in expired:
            try:
                _attribute(redis, keys, job_id, poison_kills, culprits)
            except ResponseError as exc:  # a key of this job replaced by hand: its own problem
                log.warning("job %s: its worker's death not attributed (%s); RQ's cleanup "
                            "handles it", job_id, exc, extra=job_fields(job_id))
    finally:
        queue.release_maintenance_lock()  # type: ignore[no-untyped-call]


def _culprit_workers(redis: Redis, keys: Keys, job_ids: list[str]) -> set[str]:
    """Workers that died with some item in risky work: the deaths someone is charged for."""
    workers: set[str] = set()
    with redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hvals(keys.job_risk(job_id))
        replies = pipe.execute(raise_on_error=False)
    for records in replies:
        if not isinstance(records, ResponseError):  # a risk key of another type: no record
            workers.update(as_str(record).partition("|")[0] for record in records)
    return workers


def _records(redis: Redis, risk_key: str) -> dict[bytes, bytes]:
    """A job's risk records; a risk key of another type (written by hand) holds none."""
    try:
        return redis.hgetall(risk_key)  # type: ignore[return-value]  # bytes: not decoded
    except ResponseError:
        return {}


def _charge(redis: Redis, keys: Keys, job_id: str) -> int:
    """One more death for the job; a count that is no number (written by hand) starts over,
    so junk there neither stops the reclaim nor spares the job."""
    key = keys.job_kills(job_id)
    try:
        kills = int(redis.hincrby(key, "count", 1))
    except ResponseError:
        redis.delete(key)
        kills = int(redis.hincrby(key, "count", 1))
    redis.expire(key, C.FAILURE_TTL_S)
    return kills


def _attribute(redis: Redis, keys: Keys, job_id: str, poison_kills: int,
               culprits: set[str]) -> None:
    status, worker_name = redis.hmget(Keys.rq_job(job_id), ["status", "worker_name"])
    if status is None or as_str(status) != JobStatus.STARTED.value:
        return
    risk_key = keys.job_risk(job_id)
    risks = {as_str(k): as_str(v) for k, v in _records(redis, risk_key).items()}
    if not risks:
        if worker_name is None or as_str(worker_name) not in culprits:
            # Nobody is charged for this death (no item of any job was in risky work):
            # RQ's own accounting applies, so a job that kills workers in a step we do not
            # watch still runs out of retries instead of looping forever.
            return
        # Innocent: it only shared a process with the job charged for the death. RQ's
        # cleanup lowers retries_left by one when it requeues; give that one back first.
        redis.hincrby(Keys.rq_job(job_id), "retries_left", 1)
        log.warning("job %s: its worker died while none of its items was in risky work; "
                    "requeued without spending a retry", job_id, extra=job_fields(job_id))
        return
    index, record = min(risks.items())
    worker, _, rest = record.partition("|")
    step = rest.partition("|")[0]
    kills = _charge(redis, keys, job_id)
    redis.delete(risk_key)
    message = (f"item {index} killed {kills} worker(s) (last: {worker}, during {step}); "
               f"failed after --poison-kills {poison_kills}")
    if kills < poison_kills:
        log.warning("job %s: item %s was in %s when worker %s died (%d/%d kills); RQ retries "
                    "the job", job_id, index, step, worker, kills, poison_kills,
                    extra=job_fields(job_id))
        return
    try:
        job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except Exception as exc:  # noqa: BLE001  # RQ's cleanup deals with an unreadable hash
        log.warning("job %s: cannot load it to fail it (%s)", job_id, exc,
                    extra=job_fields(job_id))
        return
    log.error("job %s failed: %s", job_id, message, extra=job_fields(job_id))
    # Failed without a worker (the dead one's execution is RQ's cleanup to end); the job is
    # FAILED before that cleanup looks, so it neither retries nor fails it again.
    with redis.pipeline() as pipe:
        fail_job(pipe, keys, job, job.origin, message)
        pipe.execute()
