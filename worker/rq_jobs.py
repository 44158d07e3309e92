"""The RQ 3.x job lifecycle for one worker process that runs many jobs at once.

RQ's own loop runs one job at a time (`perform_job`, death penalty, fork). A vlmq worker
keeps a model loaded and feeds items from many jobs into one batcher, so it drives RQ's
bookkeeping itself: take a job (STARTED, in `rq:wip:<q>`), heartbeat it while its items
run, then succeed, fail or requeue it. Every step goes through RQ's own worker methods so
that `rq info`, rq-dashboard, registries, retries and dead-worker cleanup keep working.

Security: jobs are read with RQ's JSONSerializer only, and a job whose data is not JSON is
refused by looking at its bytes, never by trying to unpickle them.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.client import Pipeline
from redis.exceptions import WatchError
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer, resolve_serializer
from rq.utils import now
from rq.worker import SimpleWorker, WorkerStatus

from vlmq.shared.errors import PayloadError
from vlmq.shared.jobs import UNREADABLE_HASH_ERRORS, payload_of
from vlmq.shared.keys import Keys
from vlmq.shared.schema import JobPayload
from vlmq.shared.text import as_str
from vlmq.worker import poison
from vlmq.worker import queue_guard as guard

log = logging.getLogger(__name__)

class _Stale(Exception):
    """A queue entry whose job is not QUEUED any more."""


# Statuses that mean someone took the job away from its worker.
_NOT_OURS = frozenset({JobStatus.CANCELED.value, JobStatus.STOPPED.value})


class BatchWorker(SimpleWorker):
    """An RQ worker (listed by `rq info`) whose jobs run concurrently inside one process.

    The serializer is always JSON: any other would let a producer's bytes be unpickled here.

    The execution TTL is short and constant (`heartbeat_ttl`), unlike SimpleWorker's
    `job.timeout + 60` (a day for vlmq jobs): JobLifecycle.heartbeat refreshes it, so a
    crashed worker's jobs are reclaimed by registry cleanup within `heartbeat_ttl` seconds
    instead of staying STARTED for a day.
    """

    def __init__(self, queues: Any, *, heartbeat_ttl: int | None = None,
                 serializer: Any = None, **kwargs: Any) -> None:
        if serializer is not None and resolve_serializer(serializer) is not JSONSerializer:
            raise ValueError(f"vlmq workers only use the JSON serializer, not {serializer!r}")
        super().__init__(queues, serializer=JSONSerializer, **kwargs)
        ttl = heartbeat_ttl if heartbeat_ttl is not None else self.job_monitoring_interval + 60
        if ttl < 1:
            raise ValueError(f"heartbeat_ttl must be at least 1 second, got {ttl}")
        self.heartbeat_ttl: int = ttl
        # RQ cleans registries every 10 min by default; a dead worker's jobs would then sit
        # STARTED that long after their heartbeat TTL. Look as often as the TTL itself.
        self.maintenance_interval = min(self.maintenance_interval, max(ttl, 10))

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """Constant TTL: the batcher, not a death penalty, decides when a job has run too long."""
        return self.heartbeat_ttl

    def work(self, *args: Any, **kwargs: Any) -> bool:
        """Refused: RQ's one-job loop sends no heartbeats, so with this class's short TTL
        every job longer than heartbeat_ttl would be failed as abandoned mid-run."""
        raise NotImplementedError(
            "BatchWorker jobs run through vlmq.worker.rq_jobs.JobLifecycle, not Worker.work()")


@dataclass
class Running:
    """One in-flight job; pass it back to JobLifecycle to heartbeat or end it."""

    job: Job
    queue: Queue
    execution: Execution
    payload: JobPayload
    started: float  # time.monotonic() when taken

    @property
    def job_id(self) -> str:
        return str(self.job.id)

    def timed_out(self, at: float | None = None) -> bool:
        """True once the job's RQ timeout has passed.

        Nothing kills a batched job the way RQ's death penalty would, so the caller checks
        this and fails the job itself. Like RQ, a missing timeout means the queue default
        and -1 means never.
        """
        timeout = self.job.timeout or Queue.DEFAULT_TIMEOUT
        if timeout < 0:
            return False
        return (at if at is not None else time.monotonic()) - self.started > timeout


@dataclass(frozen=True)
class Refused:
    """A job that take() failed at once (not JSON, bad payload, unreadable hash)."""

    job_id: str
    queue: str
    reason: str


class JobLifecycle:
    """Owns the RQ side of every job one BatchWorker runs.

    Call take/succeed/fail/requeue from one loop. heartbeat() may run on another thread
    (it only writes Redis and the Running objects' timestamps); a job that ends meanwhile
    can leave its execution hash behind until heartbeat_ttl expires it, nothing worse.
    """

    def __init__(self, worker: BatchWorker, queues: Sequence[Queue] | None = None,
                 keys: Keys | None = None, *,
                 poison_kills: int = poison.DEFAULT_POISON_KILLS) -> None:
        if poison_kills < 1:
            raise ValueError(f"poison_kills must be at least 1, got {poison_kills}")
        self.worker = worker
        self.keys = keys if keys is not None else Keys.from_env()
        self.poison_kills = poison_kills
        self.connection = worker.connection
        # Priority order: take() drains the first queue before looking at the next.
        self.queues: list[Queue] = list(queues) if queues is not None else list(worker.queues)
        for q in self.queues:
            # A pickle queue's registries would unpickle job meta during cleanup.
            if q.serializer is not JSONSerializer:
                raise ValueError(f"queue {q.name!r} does not use the JSON serializer")

    @property
    def in_flight(self) -> int:
        return len(self.worker.executions)

    @property
    def heartbeat_interval(self) -> float:
        """How often to call heartbeat(): a third of the TTL leaves room for two misses."""
        return self.worker.heartbeat_ttl / 3

    # --- worker registration -------------------------------------------------------------

    def register_birth(self) -> None:
        self.worker.register_birth()  # type: ignore[no-untyped-call]  # untyped in RQ
        self.worker.set_state(WorkerStatus.IDLE)

    def register_death(self) -> None:
        """Unregister the worker; requeue or end in-flight jobs first.

        Jobs still in flight are left STARTED and are failed (or retried) by registry
        cleanup once their heartbeat TTL lapses.
        """
        if self.worker.executions:
            log.warning("worker %s unregistering with %d job(s) still in flight",
                        self.worker.name, len(self.worker.executions))
        self.worker.register_death()  # type: ignore[no-untyped-call]  # untyped in RQ

    def maintain(self) -> None:
        """Run RQ's registry maintenance when due (every worker.maintenance_interval s).

        The batch loop never enters Worker.work(), so without this no one fails or retries
        the jobs of dead workers, or rescues jobs stuck in a queue's intermediate list.
        Poison in the intermediate lists is dead-lettered first (RQ's cleanup would fail on
        it); if the cleanup still fails, its locks are released so the next run can try.
        """
        if not self.worker.should_run_maintenance_tasks:
            return
        for queue in self.queues:
            guard.scrub_intermediate(self.connection, self.keys, queue, self.worker.name)
            # Dead workers' jobs: charge the one in risky work, spare the others' retries.
            poison.reclaim(self.connection, self.keys, queue, poison_kills=self.poison_kills)
        try:
            self.worker.run_maintenance_tasks()  # type: ignore[no-untyped-call]
        except (*UNREADABLE_HASH_ERRORS, NoSuchJobError, RecursionError):
            # RQ's cleanup fetches every job it finds; one unreadable hash (e.g. a timeout
            # of "86400.0" from a hand-written producer) must not stop this worker.
            log.exception("RQ registry maintenance failed on an unreadable job; skipped")
            for queue in self.queues:
                queue.release_maintenance_lock()  # type: ignore[no-untyped-call]
            self.worker.last_cleaned_at = now()  # type: ignore[assignment]  # retry next interval

    # --- taking jobs ---------------------------------------------------------------------

    def take(self) -> Running | Refused | None:
        """Start the next job, non-blocking; None when every queue is empty.

        Each entry is LMOVEd into the queue's intermediate list, as RQ does for one queue:
        a crash between the pop and the start leaves the job where maintenance finds it
        instead of losing it (rq#580). The entry and its hash are then checked with bounded
        raw reads (queue_guard) before RQ loads anything: poison is dead-lettered and its
        job failed, never raised into this loop.
        """
        for queue in self.queues:
            while True:
                raw = self.connection.lmove(queue.key, queue.intermediate_queue_key)
                if raw is None:
                    break
                taken = self._take_entry(queue, raw)
                if taken is not None:
                    return taken
        return None

    def _take_entry(self, queue: Queue, raw: bytes | str) -> Running | Refused | None:
        """Start one popped entry; None when it was stale (look at the next)."""
        verdict = guard.inspect(self.connection, raw)
        if verdict.reason is None and verdict.hash_exists:
            try:
                assert verdict.job_id is not None  # a valid id: inspect checked it
                job = self.worker.job_class.fetch(verdict.job_id, connection=self.connection,
                                                  serializer=JSONSerializer)
            except NoSuchJobError:
                verdict = guard.Verdict(verdict.job_id, None, hash_exists=False)
            except Exception as exc:  # noqa: BLE001  # whatever RQ raises on a hash it cannot load
                verdict = guard.Verdict(verdict.job_id, f"RQ cannot read its hash "
                                        f"({type(exc).__name__}: {exc})", hash_exists=True)
            else:
                return self._start(job, queue)
        if verdict.reason is None:  # deleted since it was pushed: nothing to run or fail
            self.connection.lrem(queue.intermediate_queue_key, 1, raw)  # type: ignore[arg-type]
            return None
        guard.refuse(self.connection, self.keys, queue, raw, verdict, self.worker.name)
        return Refused(verdict.label, queue.name, verdict.reason)

    def _start(self, job: Job, queue: Queue) -> Running | Refused | None:
        execution = self._mark_started(job, queue)
        if execution is None:
            return None
        try:
            payload = payload_of(job)
        except PayloadError as exc:
            reason = f"vlmq refused job {job.id}: {exc}"
        except Exception as exc:  # a validator bug must fail this job, not the worker (logged)
            log.exception("job %s: payload validation crashed", job.id)
            reason = f"vlmq refused job {job.id}: payload validation crashed ({exc!r})"
        else:
            return Running(job, queue, execution, payload, time.monotonic())
        self._end_failed(job, queue, execution, reason, retry=False)
        return Refused(str(job.id), queue.name, reason)

    def _mark_started(self, job: Job, queue: Queue) -> Execution | None:
        """What RQ's prepare_execution + prepare_job_execution do, in one transaction.

        Only a QUEUED job is started, checked under WATCH: an id pushed twice onto a queue
        (a producer's naive retry) or a job started meanwhile by another worker is skipped,
        never run twice. Returns None for such a stale entry.
        """
        worker = self.worker
        with self.connection.pipeline() as pipe:
            try:
                pipe.watch(job.key)  # type: ignore[no-untyped-call]
                status = pipe.hget(job.key, "status")
                if status is not None and as_str(status) != JobStatus.QUEUED.value:
                    raise _Stale(as_str(status))
                pipe.multi()
                execution = self._queue_start(pipe, job, queue)
                pipe.execute()
            except (_Stale, WatchError) as exc:
                pipe.reset()
                self.connection.lrem(queue.intermediate_queue_key, 1, job.id)
                log.warning("job %s listed in queue %s but %s: stale entry skipped", job.id,
                            queue.name, f"already {exc}" if isinstance(exc, _Stale)
                            else "taken by another worker")
                return None
        worker.executions[execution.id] = execution
        return execution

    def _queue_start(self, pipe: Pipeline, job: Job, queue: Queue) -> Execution:
        worker = self.worker
        if job.origin != queue.name:
            # A hand-written hash without origin would land in the wrong registries.
            log.warning("job %s: origin %r repaired to %r", job.id, job.origin, queue.name)
            job.origin = queue.name
            pipe.hset(job.key, "origin", queue.name)
        execution = Execution.create(job, worker.get_heartbeat_ttl(job), pipeline=pipe,
                                     worker_name=worker.name)
        job.prepare_for_execution(worker.name, pipe)
        pipe.persist(job.key)  # a job enqueued with ttl= must not vanish mid-run
        pipe.lrem(queue.intermediate_queue_key, 1, job.id)
        worker.heartbeat(pipeline=pipe)
        worker.set_state(WorkerStatus.BUSY, pipeline=pipe)
        return execution

    # --- while running -------------------------------------------------------------------

    def heartbeat(self, running: Iterable[Running]) -> list[Running]:
        """Extend the worker, and each job's execution and wip entry, by heartbeat_ttl.

        Call it every heartbeat_interval seconds (registry scores are whole seconds, so the
        real margin is up to 1 s short of the TTL), or StartedJobRegistry.cleanup fails the
        jobs as AbandonedJobError while they are still running. heartbeat([]) keeps an idle
        worker listed by `rq info` (its key expires after worker_ttl + 60 s).

        Returns the jobs that are no longer this worker's: deleted, canceled or stopped
        while running. Stop working on them and `drop` them; succeeding, failing or
        requeueing one would bring it back.
        """
        batch = list(running)
        worker = self.worker
        with self.connection.pipeline() as pipe:
            for r in batch:
                pipe.hget(r.job.key, "status")
            worker.heartbeat(pipeline=pipe)  # HSET returns 1 if the worker key was gone
            worker_at = len(pipe) - 1
            job_hset_at: list[int] = []
            for r in batch:
                ttl = worker.get_heartbeat_ttl(r.job)
                r.execution.heartbeat(r.queue.started_job_registry, ttl, pipeline=pipe)
                job_hset_at.append(len(pipe))
                r.job.heartbeat(now(), ttl, pipeline=pipe)
            results = pipe.execute()
            deleted = [r for r, i in zip(batch, job_hset_at, strict=True) if results[i] == 1]
            ended = [r for r, st in zip(batch, results[:len(batch)], strict=True)
                     if st is not None and st.decode() in _NOT_OURS]
            # Same repairs as RQ's Worker.maintain_heartbeats (rq#1450).
            for r in deleted:
                log.warning("job %s was deleted while running", r.job_id)
                pipe.delete(r.job.key)
            for r in ended:
                log.warning("job %s was %s while running", r.job_id,
                            results[batch.index(r)].decode())
            if results[worker_at] == 1:
                pipe.hset(worker.key, mapping=worker.serialize())
                pipe.expire(worker.key, worker.worker_ttl + 60)
            if len(pipe):
                pipe.execute()
        return deleted + [r for r in ended if r not in deleted]

    def taken_away(self, running: Sequence[Running]) -> list[Running]:
        """Those of `running` that were deleted, canceled or stopped meanwhile (one round trip)."""
        if not running:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for r in running:
                pipe.hget(r.job.key, "status")
            statuses = pipe.execute()
        return [r for r, st in zip(running, statuses, strict=True)
                if st is None or as_str(st) in _NOT_OURS]

    def is_ours(self, running: Running) -> bool:
        """Still STARTED here: not deleted, canceled or stopped by someone else meanwhile."""
        status = self.connection.hget(running.job.key, "status")
        if isinstance(status, bytes):
            status = status.decode()
        return status == JobStatus.STARTED.value

    def drop(self, running: Running) -> None:
        """Forget a job someone else deleted or canceled: end its execution, touch nothing
        else, so the job keeps whatever state they gave it."""
        with self.connection.pipeline() as pipe:
            self.worker.cleanup_execution(running.job, pipeline=pipe,
                                          execution=running.execution)
            pipe.execute()
        self._after_end()

    # --- ending --------------------------------------------------------------------------

    def succeed(self, running: Running, summary: Mapping[str, Any]) -> None:
        """Finish the job with `summary` as its RQ result (job.return_value())."""
        value = dict(summary)
        # RQ would silently store "Unserializable return value" instead of raising.
        json.dumps(value)
        job = running.job
        job.ended_at = now()
        _set_return_value(job, value)
        self.worker.handle_job_success(job, running.queue, running.queue.started_job_registry,
                                       running.execution)
        job.send_webhooks(JobStatus.FINISHED)
        self._after_end()

    def fail(self, running: Running, message: str, *, retry: bool = False) -> None:
        """Fail the job; `message` is its latest_result().exc_string.

        vlmq jobs carry retries for one reason: a worker that dies mid-job (RQ's cleanup
        then requeues it and the next worker resumes at item level). Failures reported
        here would repeat (bad input, wrong model, timeout), so by default they do not
        spend those retries. With retry=True and retries left, RQ requeues or schedules
        the job instead and records no failure result, so the message is only logged.
        """
        self._end_failed(running.job, running.queue, running.execution, message, retry=retry)

    def _end_failed(self, job: Job, queue: Queue, execution: Execution, message: str, *,
                    retry: bool) -> None:
        if not retry:
            job.retries_left = 0
        elif job.should_retry:
            log.warning("job %s failed, RQ will retry it: %s", job.id, message)
        job.ended_at = now()
        self.worker.handle_job_failure(job, queue, started_job_registry=queue.started_job_registry,
                                       exc_string=message, execution=execution)
        self._after_end()

    def requeue(self, running: Running) -> None:
        """Put a job back at the FRONT of its queue (QUEUED), e.g. on a warm shutdown.

        Its execution ends without a result; items already written stay, so whoever takes
        it next resumes at item level.
        """
        job, queue = running.job, running.queue
        job.get_meta(refresh=True)  # enqueue_job saves meta: keep what others wrote meanwhile
        job.started_at = None
        job.ended_at = None
        with self.connection.pipeline() as pipe:
            # Queue.enqueue_job(pipeline=...) calls MULTI itself unless the pipeline already
            # is in one, and MULTI raises once commands are queued: start it first.
            pipe.multi()
            self.worker.cleanup_execution(job, pipeline=pipe, execution=running.execution)
            queue.enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()
        self._after_end()

    def _after_end(self) -> None:
        if not self.worker.executions:
            self.worker.set_state(WorkerStatus.IDLE)


def _set_return_value(job: Job, value: Any) -> None:
    """PRIVATE RQ: handle_job_success stores `job._result` as the result; RQ 3.0 has no
    public setter (its perform_job assigns the attribute). Pinned by
    tests/test_rq_jobs.py::test_rq_private_result_attribute."""
    job._result = value
