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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from redis.client import Pipeline
from redis.exceptions import WatchError
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job, JobStatus
from rq.registry import (
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ReadyJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.serializers import JSONSerializer, resolve_serializer
from rq.utils import now
from rq.worker import SimpleWorker, WorkerStatus
from rq.worker_registration import clean_worker_registry

from vlmq.shared import constants as C
from vlmq.shared import job_index
from vlmq.shared import results as R
from vlmq.shared.connection import RedisClock
from vlmq.shared.errors import PayloadError
from vlmq.shared.jobs import UNREADABLE_HASH_ERRORS, fail_job, payload_of
from vlmq.shared.keys import Keys
from vlmq.shared.text import as_str
from vlmq.worker import poison
from vlmq.worker import queue_guard as guard
from vlmq.worker.scheduler import JobState

log = logging.getLogger(__name__)

class _Stale(Exception):
    """A queue entry whose job is not QUEUED any more."""


# The owner key (Keys.job_owner) lives this many heartbeat TTLs, at least OWNER_TTL_MIN_S.
OWNER_TTL_HEARTBEATS = 10
OWNER_TTL_MIN_S = 600
# JobLifecycle.succeed's answer when item results are missing at the moment of finishing.
INCOMPLETE = "item results missing"
# Why a STARTED job is not ours when its owner key is gone (it expired while this worker
# stalled far past its heartbeat TTL, and nobody took the job).
ORPHANED = "its owner key expired; RQ requeues it once its heartbeat TTL has passed"
# At start the worker warns when its clock and Redis's differ by more than this.
CLOCK_WARN_S = 2.0


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


@dataclass(kw_only=True, eq=False)
class Running(JobState):
    """One in-flight job: its RQ side (job, queue, execution) and, from JobState, where its
    items stand. Pass it back to JobLifecycle to heartbeat or end it."""

    job: Job
    queue: Queue
    execution: Execution
    token: str  # this execution's value of the job's owner key (Keys.job_owner)
    # Epoch seconds (Redis's clock) of the job's first start on any worker: a resumed
    # job's summary covers the whole job.
    first_started: float | None = None

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
        # Every expiry and takeover decision uses Redis's clock, never this machine's.
        self.clock = RedisClock(self.connection)
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
        """Register the worker, and warn when this machine's clock is off Redis's."""
        self.clock.measure()
        if abs(self.clock.offset) > CLOCK_WARN_S:
            log.warning("this machine's clock is %+.1f s off Redis's (TIME); vlmq times "
                        "heartbeats and expiries by Redis, but fix the clock (NTP): logs "
                        "and RQ's own timestamps use it", -self.clock.offset)
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
        at = self.clock.measure()  # "expired" means by Redis's clock, for every worker alike
        expired = {q.name: q.started_job_registry.get_expired_job_ids(at) for q in self.queues}
        for queue in self.queues:
            guard.scrub_intermediate(self.connection, self.keys, queue, self.worker.name)
            # Dead workers' jobs: charge the one in risky work, spare the others' retries.
            poison.reclaim(self.connection, self.keys, queue, poison_kills=self.poison_kills,
                           at=at)
        try:
            self._clean_registries(at)
        except (*UNREADABLE_HASH_ERRORS, NoSuchJobError, RecursionError):
            # RQ's cleanup fetches every job it finds; one unreadable hash (e.g. a timeout
            # of "86400.0" from a hand-written producer) must not stop this worker.
            log.exception("RQ registry maintenance failed on an unreadable job; skipped")
        self.worker.last_cleaned_at = now()  # type: ignore[assignment]  # next run in an interval
        self._end_abandoned(expired)

    def _clean_registries(self, at: float) -> None:
        """RQ's Worker.clean_registries, with Redis's time `at` as the cutoff.

        RQ's own version cuts at this machine's clock: a worker running ahead would fail or
        requeue every other worker's live jobs as abandoned. Each queue is cleaned under
        its maintenance lock, released whatever happens.
        """
        worker = self.worker
        for queue in self.queues:
            if not queue.acquire_maintenance_lock():
                continue
            try:
                args: dict[str, Any] = {"name": queue.name, "connection": self.connection,
                                        "job_class": queue.job_class,
                                        "serializer": queue.serializer}
                FinishedJobRegistry(**args).cleanup(at)
                # vlmq pushes no RQ exception handlers: abandoned jobs end in _end_abandoned.
                StartedJobRegistry(**args).cleanup(at, exception_handlers=[])
                FailedJobRegistry(**args).cleanup(at)
                DeferredJobRegistry(**args).cleanup()
                ReadyJobRegistry(**args).cleanup()
                clean_worker_registry(queue)
                queue.intermediate_queue.cleanup(worker, queue)
            finally:
                queue.release_maintenance_lock()  # type: ignore[no-untyped-call]
        worker.clean_group_registries()  # type: ignore[no-untyped-call]

    def _end_abandoned(self, expired: Mapping[str, Sequence[str]]) -> None:
        """The terminal event of each job RQ's cleanup failed as abandoned (its worker
        died and its retries are spent): RQ writes none. end_job_event writes it once,
        whichever worker's maintenance gets here first."""
        for queue, job_ids in expired.items():
            for job_id in job_ids:
                status, ttl = self.connection.hmget(Keys.rq_job(job_id),
                                                    ["status", "failure_ttl"])
                if status is None or as_str(status) != JobStatus.FAILED.value:
                    continue
                R.end_job_event(
                    self.connection, self.keys, job_id, "failed", queue=queue,
                    ttl_s=R.ended_ttl(_int_or_none(ttl), C.FAILURE_TTL_S),
                    fields={"error": "the worker running this job stopped (no heartbeat) "
                                     "and the job's retries are spent (AbandonedJobError)"})

    # --- taking jobs ---------------------------------------------------------------------

    def take(self) -> Running | Refused | None:
        """Start the next job, non-blocking; None when every queue is empty."""
        taken, _ = self.take_many(1)
        return taken[0] if taken else None

    def take_many(self, limit: int, *, block_s: float = 0.0
                  ) -> tuple[list[Running | Refused], bool]:
        """Start up to `limit` jobs, the first queue drained before the next; returns them
        and whether every queue was found empty.

        Each entry is LMOVEd into the queue's intermediate list, as RQ does for one queue:
        a crash between the pop and the start leaves the job where maintenance finds it
        instead of losing it (rq#580). Entries are popped, checked and started several at
        a time, a few round trips for all of them. The entries and their hashes are
        checked with bounded raw reads (queue_guard) before RQ loads anything: poison is
        dead-lettered and its job failed, never raised into this loop.

        `block_s` > 0 with one queue: when it is empty, wait that long for an entry with
        a blocking BLMOVE (into the same intermediate list), so an idle worker takes a job
        the moment it is pushed. Several queues cannot be waited on together that way
        (BLMPOP would lose the intermediate list): the caller polls them instead.
        """
        out: list[Running | Refused] = []
        for queue in self.queues:
            while len(out) < limit:
                raws = self._pop(queue, limit - len(out))
                if not raws:
                    break  # this queue is empty: look at the next
                out += self._take_entries(queue, raws)
            if len(out) >= limit:
                return out, False
        if not out and block_s > 0 and len(self.queues) == 1:
            queue = self.queues[0]
            raw = self.connection.blmove(queue.key, queue.intermediate_queue_key,
                                         block_s)  # type: ignore[arg-type]  # Redis takes a float
            if raw is not None:
                return self._take_entries(queue, [raw]), False
        return out, True

    def _pop(self, queue: Queue, want: int) -> list[bytes]:
        """Move up to `want` entries into the intermediate list: one, with the queue's
        length, then as many more as it said in one pipeline (an empty queue costs one
        round trip of two commands)."""
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.llen(queue.key)
            pipe.lmove(queue.key, queue.intermediate_queue_key)
            length, first = pipe.execute()
        if first is None:
            return []
        more = min(want, int(length)) - 1
        if more <= 0:
            return [first]
        with self.connection.pipeline(transaction=False) as pipe:
            for _ in range(more):
                pipe.lmove(queue.key, queue.intermediate_queue_key)
            return [first, *(raw for raw in pipe.execute() if raw is not None)]

    def _take_entries(self, queue: Queue, raws: Sequence[bytes | str]
                      ) -> list[Running | Refused]:
        """Start popped entries (refused ones as Refused; stale ones left out)."""
        out: list[Running | Refused] = []
        jobs: list[Job] = []
        first: dict[str, float | None] = {}  # each job's first start on any worker, if any
        for raw, (verdict, fields) in zip(raws, guard.inspect_many(self.connection, raws),
                                          strict=True):
            if verdict.reason is None and fields is not None:
                assert verdict.job_id is not None  # a valid id: inspect checked it
                try:
                    job = self.worker.job_class(verdict.job_id, connection=self.connection,
                                                serializer=JSONSerializer)
                    job.restore(fields)  # what Job.fetch does with the hash read above
                except Exception as exc:  # noqa: BLE001  # whatever RQ raises on a hash it cannot load
                    verdict = guard.Verdict(verdict.job_id, f"RQ cannot read its hash "
                                            f"({type(exc).__name__}: {exc})", hash_exists=True)
                else:
                    jobs.append(job)
                    first[str(job.id)] = _float_or_none(
                        fields.get(C.FIRST_STARTED_FIELD.encode()))
                    continue
            if verdict.reason is None:  # deleted since it was pushed: nothing to run or fail
                self.connection.lrem(queue.intermediate_queue_key, 1, raw)  # type: ignore[arg-type]
                continue
            guard.refuse(self.connection, self.keys, queue, raw, verdict, self.worker.name)
            out.append(Refused(verdict.label, queue.name, verdict.reason))
        for job, execution, at in self._mark_started(jobs, queue):
            out.append(self._start(job, queue, execution, first.get(str(job.id)) or at))
        self._ensure_indexed([r for r in out if isinstance(r, Running)])
        return out

    def _ensure_indexed(self, started: Sequence[Running]) -> None:
        """List jobs a producer wrote without vlmq's indexes (RQ's hash and queue entry by
        hand, or from before the indexes): writes only, one round trip for the batch."""
        if not started:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for r in started:
                job_index.ensure(self.connection, self.keys, r.job_id, r.payload, r.queue.name,
                                 job_index.us_of(r.job.created_at), pipeline=pipe)
            pipe.execute()

    def sweep_index(self) -> int:
        """One step of the walk that drops index entries of jobs RQ's TTL deleted."""
        return job_index.sweep(self.connection, self.keys)

    def _start(self, job: Job, queue: Queue, execution: Execution,
               first_started: float) -> Running | Refused:
        try:
            payload = payload_of(job)
        except PayloadError as exc:
            reason = f"vlmq refused job {job.id}: {exc}"
        except Exception as exc:  # a validator bug must fail this job, not the worker (logged)
            log.exception("job %s: payload validation crashed", job.id)
            reason = f"vlmq refused job {job.id}: payload validation crashed ({exc!r})"
        else:
            return Running(job_id=str(job.id), payload=payload, job=job, queue=queue,
                           execution=execution, token=self._token(execution),
                           first_started=first_started)
        self._end_failed(job, queue, execution, self._token(execution), reason, retry=False)
        return Refused(str(job.id), queue.name, reason)

    def _token(self, execution: Execution) -> str:
        return f"{execution.id} {self.worker.name}"

    def _mark_started(self, jobs: Sequence[Job], queue: Queue
                      ) -> list[tuple[Job, Execution, float]]:
        """What RQ's prepare_execution + prepare_job_execution do, for several jobs in one
        transaction.

        Only a QUEUED job is started, checked under WATCH: an id pushed twice onto a queue
        (a producer's naive retry) or a job started meanwhile by another worker is skipped,
        never run twice. If any of the jobs changes between the check and the start, each
        is tried again on its own. Returns the jobs started, with their executions and the
        (Redis) time they started.
        """
        if not jobs:
            return []
        worker = self.worker
        with self.connection.pipeline() as pipe:
            try:
                pipe.watch(*{job.key for job in jobs})  # type: ignore[no-untyped-call]
                fresh: list[Job] = []
                stale: list[tuple[Job, str]] = []
                statuses = self._watched_reads(lambda rp: [rp.hget(job.key, "status")
                                                           for job in jobs])
                for job, status in zip(jobs, statuses, strict=True):
                    if status is not None and as_str(status) != JobStatus.QUEUED.value:
                        stale.append((job, f"already {as_str(status)}"))
                    elif any(job.id == f.id for f in fresh):  # the id twice in one batch
                        stale.append((job, "already taken here"))
                    else:
                        fresh.append(job)
                at = self.clock.now()
                pipe.multi()
                started = [(job, self._queue_start(pipe, job, queue, at), at) for job in fresh]
                for job, _ in stale:
                    pipe.lrem(queue.intermediate_queue_key, 1, job.id)
                if fresh:
                    worker.heartbeat(pipeline=pipe)
                    worker.set_state(WorkerStatus.BUSY, pipeline=pipe)
                pipe.execute()
            except WatchError:
                pipe.reset()
                if len(jobs) > 1:
                    return [s for job in jobs for s in self._mark_started([job], queue)]
                self.connection.lrem(queue.intermediate_queue_key, 1, jobs[0].id)
                log.warning("job %s listed in queue %s but taken by another worker: stale "
                            "entry skipped", jobs[0].id, queue.name)
                return []
        for job, why in stale:
            log.warning("job %s listed in queue %s but %s: stale entry skipped", job.id,
                        queue.name, why)
        for _, execution, _ in started:
            worker.executions[execution.id] = execution
        return started

    def _queue_start(self, pipe: Pipeline, job: Job, queue: Queue, at: float) -> Execution:
        worker = self.worker
        if job.origin != queue.name:
            # A hand-written hash without origin would land in the wrong registries.
            log.warning("job %s: origin %r repaired to %r", job.id, job.origin, queue.name)
            job.origin = queue.name
            pipe.hset(job.key, "origin", queue.name)
        ttl = worker.get_heartbeat_ttl(job)
        execution = Execution.create(job, ttl, pipeline=pipe, worker_name=worker.name)
        _rescore(pipe, queue, execution, ttl, at)
        job.prepare_for_execution(worker.name, pipe)
        pipe.hsetnx(job.key, C.FIRST_STARTED_FIELD, f"{at:.3f}")
        # The fence: from here on only this execution writes for the job (see _owned).
        pipe.set(self.keys.job_owner(str(job.id)), self._token(execution), ex=self._owner_ttl)
        pipe.hdel(job.key, R.END_FIELD)  # a new run gets its own terminal event
        pipe.persist(job.key)  # a job enqueued with ttl= must not vanish mid-run
        pipe.lrem(queue.intermediate_queue_key, 1, job.id)
        return execution

    # --- ownership -----------------------------------------------------------------------

    @property
    def _owner_ttl(self) -> int:
        """The owner key outlives many missed heartbeats (it is refreshed by each), and
        expires on its own after a worker died holding it."""
        return max(OWNER_TTL_MIN_S, OWNER_TTL_HEARTBEATS * self.worker.heartbeat_ttl)

    def _watched_reads(self, queue: Callable[[Pipeline], object]) -> list[Any]:
        """The reads of a check-then-write transaction, for many jobs in one round trip.

        The caller WATCHes the keys first; these reads then run pipelined on another
        connection. Any change to a watched key after the WATCH, before or after these
        reads, makes the caller's EXEC fail, so what they return still holds when the
        writes apply: the same guarantee as reading on the watching connection, which
        redis-py would do one round trip per read.
        """
        with self.connection.pipeline(transaction=False) as rp:
            queue(rp)
            return list(rp.execute())

    def _owned(self, conn: Any, job: Job, token: str) -> str | None:
        """None while `token` is the job's current execution, else why not (for the log).

        The job must be STARTED and its owner key must hold this execution's token: a
        worker that stalled past its heartbeat finds the job requeued (QUEUED), taken by
        another worker (another token), ended, canceled or deleted.
        """
        status = conn.hget(job.key, "status")
        owner = conn.get(self.keys.job_owner(str(job.id)))
        return _why_not_ours(status, owner, token)

    def _fenced(self, job: Job, token: str, build: Callable[[Pipeline], None], *,
                check: Callable[[Pipeline], str | None] | None = None,
                watch: Sequence[str] = ()) -> str | None:
        """Run `build`'s writes in one transaction, only if execution `token` still owns
        the job (and `check`, reading the `watch` keys, returns None).

        WATCH makes the check and the writes atomic: if the job hash or its owner key
        changes in between (another worker takes the job, someone cancels it), the
        transaction is dropped and the check runs again. Returns None when written, else
        why the job is not ours any more (nothing was written).
        """
        keys = [job.key, self.keys.job_owner(str(job.id)), *watch]
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*keys)  # type: ignore[no-untyped-call]
                    why = self._owned(pipe, job, token)
                    if why is None and check is not None:
                        why = check(pipe)
                    if why is not None:
                        pipe.reset()
                        return why
                    pipe.multi()
                    build(pipe)
                    pipe.execute()
                    return None
                except WatchError:
                    continue

    def lost(self, running: Sequence[Running]) -> list[tuple[Running, str]]:
        """Those of `running` this worker no longer owns, each with why (one round trip)."""
        if not running:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for r in running:
                pipe.hget(r.job.key, "status")
                pipe.get(self.keys.job_owner(r.job_id))
            replies = pipe.execute()
        out = []
        for i, r in enumerate(running):
            why = _why_not_ours(replies[2 * i], replies[2 * i + 1], r.token)
            if why is not None:
                out.append((r, why))
        return out

    def is_ours(self, running: Running) -> bool:
        return self._owned(self.connection, running.job, running.token) is None

    # --- while running -------------------------------------------------------------------

    def heartbeat(self, running: Iterable[Running]) -> list[tuple[Running, str]]:
        """Extend the worker, and each owned job's execution, wip entry and owner key, by
        heartbeat_ttl; returns the jobs this worker no longer owns, each with why.

        Call it every heartbeat_interval seconds (registry scores are whole seconds, so the
        real margin is up to 1 s short of the TTL), or StartedJobRegistry.cleanup fails the
        jobs as AbandonedJobError while they are still running. heartbeat([]) keeps an idle
        worker listed by `rq info` (its key expires after worker_ttl + 60 s).

        A job that is not ours any more (deleted, canceled, or requeued and maybe taken by
        another worker while this one was stalled) gets no heartbeat: that would put a stale
        entry back into its started registry. Stop working on those and `drop` them.
        """
        batch = list(running)
        worker = self.worker
        watched = [k for r in batch for k in (r.job.key, self.keys.job_owner(r.job_id))]
        at = self.clock.measure()
        stamp = datetime.fromtimestamp(at, timezone.utc)
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    if watched:
                        pipe.watch(*watched)  # type: ignore[no-untyped-call]
                    reads = self._watched_reads(lambda rp: [
                        (rp.hget(r.job.key, "status"), rp.get(self.keys.job_owner(r.job_id)))
                        for r in batch])
                    gone = [(r, why) for r, (status, owner, _) in zip(batch, _triples(reads, 2),
                                                                       strict=True)
                            if (why := _why_not_ours(status, owner, r.token)) is not None]
                    pipe.multi()
                    worker.heartbeat(pipeline=pipe)  # HSET returns 1 if the worker key was gone
                    for r in batch:
                        if any(g is r for g, _ in gone):
                            continue
                        ttl = worker.get_heartbeat_ttl(r.job)
                        r.execution.heartbeat(r.queue.started_job_registry, ttl, pipeline=pipe)
                        _rescore(pipe, r.queue, r.execution, ttl, at)
                        r.job.heartbeat(stamp, ttl, pipeline=pipe)
                        pipe.expire(self.keys.job_owner(r.job_id), self._owner_ttl)
                    results = pipe.execute()
                    break
                except WatchError:
                    continue
        if results[0] == 1:  # same repair as RQ's Worker.maintain_heartbeats
            with self.connection.pipeline() as pipe:
                pipe.hset(worker.key, mapping=worker.serialize())
                pipe.expire(worker.key, worker.worker_ttl + 60)
                pipe.execute()
        return gone

    def drop(self, running: Running, why: str = "") -> None:
        """Forget a job this worker no longer owns: end its own execution record (its wip
        entry must not come back as a stale one), write nothing into the job.

        An ORPHANED job keeps its wip entry: it is the only way RQ's cleanup finds the job
        (still STARTED) and requeues it. A job found canceled by someone who wrote no
        terminal event (RQ's own Job.cancel) gets its `canceled` event, which
        end_job_event writes once whoever calls it.
        """
        if why == ORPHANED:
            self.worker.executions.pop(running.execution.id, None)
        else:
            with self.connection.pipeline() as pipe:
                self.worker.cleanup_execution(running.job, pipeline=pipe,
                                              execution=running.execution)
                pipe.execute()
        if why == JobStatus.CANCELED.value:
            R.end_job_event(self.connection, self.keys, running.job_id, "canceled",
                            queue=running.queue.name,
                            ttl_s=R.ended_ttl(running.job.result_ttl, C.RESULT_TTL_S))
        self._after_end()

    # --- ending --------------------------------------------------------------------------

    def succeed(self, running: Running, summary: Mapping[str, Any], *,
                require_items: bool = False) -> str | None:
        """Finish the job with `summary` as its RQ result (job.return_value()), fenced.

        The status change, the result, the registries and the `finished` event are one
        transaction. The event carries the summary's fields, and the whole summary as JSON
        in `summary`. Returns None when finished; with require_items, INCOMPLETE when,
        checked in the same transaction, not every item has a stored result (nothing
        written: compute the missing ones); else why the job is not this worker's any more.
        """
        return self.succeed_many([(running, summary)], require_items=require_items)[0]

    def succeed_many(self, ends: Sequence[tuple[Running, Mapping[str, Any]]], *,
                     require_items: bool = False) -> list[str | None]:
        """`succeed` for several jobs in one transaction (one WATCH, one MULTI/EXEC): each
        job is checked on its own and only the ones that pass are finished; returns each
        job's answer, in order."""
        if not ends:
            return []
        worker = self.worker
        plans: list[tuple[Running, dict[str, Any], int]] = []
        for running, summary in ends:
            value = dict(summary)
            # RQ would silently store "Unserializable return value" instead of raising.
            json.dumps(value)
            plans.append((running, value, running.job.get_result_ttl(worker.default_result_ttl)))
        watch = [key for r, _, _ in plans
                 for key in (r.job.key, self.keys.job_owner(r.job_id),
                             *([self.keys.job_items(r.job_id)] if require_items else []))]
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(*watch)  # type: ignore[no-untyped-call]
                    reads = self._watched_reads(lambda rp: [
                        (rp.hget(r.job.key, "status"), rp.get(self.keys.job_owner(r.job_id)),
                         rp.hlen(self.keys.job_items(r.job_id)) if require_items else None)
                        for r, _, _ in plans])
                    whys: list[str | None] = []
                    for (r, _, _), (status, owner, stored) in zip(
                            plans, _triples(reads, 3 if require_items else 2), strict=True):
                        why = _why_not_ours(status, owner, r.token)
                        if why is None and require_items and int(stored) < r.total:
                            why = INCOMPLETE
                        whys.append(why)
                    if all(why is not None for why in whys):
                        pipe.reset()
                        break
                    pipe.multi()
                    for (r, value, ttl), why in zip(plans, whys, strict=True):
                        if why is None:
                            self._finish(pipe, r, value, ttl)
                    if not worker.executions:  # the last one ended: idle, in the same EXEC
                        worker.set_state(WorkerStatus.IDLE, pipeline=pipe)
                    pipe.execute()
                    break
                except WatchError:
                    continue
        for (r, _, _), why in zip(plans, whys, strict=True):
            if why is None:
                r.job.send_webhooks(JobStatus.FINISHED)
        if any(why != INCOMPLETE for why in whys):
            self._after_end()
        return whys

    def _finish(self, pipe: Pipeline, running: Running, value: dict[str, Any],
                result_ttl: int) -> None:
        """What RQ's handle_job_success writes (vlmq jobs have no dependents, repeats or
        rate limits), queued on the caller's fenced transaction instead of RQ's own."""
        job, worker = running.job, self.worker
        job.ended_at = now()
        job.set_status(JobStatus.FINISHED, pipeline=pipe)
        job.save(pipeline=pipe, include_meta=False, include_result=False)
        if result_ttl != 0:
            Result.create(job, Result.Type.SUCCESSFUL, ttl=result_ttl, return_value=value,
                          worker_name=worker.name, pipeline=pipe,
                          execution_id=running.execution.id,
                          execution_started_at=running.execution.created_at,
                          execution_ended_at=job.ended_at)
            job.finished_job_registry.add(job, result_ttl, pipe)
            if result_ttl > 0:  # RQ scored it by this machine's clock
                pipe.zadd(job.finished_job_registry.key,
                          {str(job.id): self.clock.now() + result_ttl}, xx=True)
        job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
        self._close(pipe, running.job, running.execution)
        R.end_job_event(self.connection, self.keys, running.job_id, "finished",
                        queue=running.queue.name,
                        ttl_s=R.ended_ttl(result_ttl, C.RESULT_TTL_S),
                        fields={**value, "summary": value}, pipeline=pipe)
        worker.increment_successful_job_count(pipeline=pipe)

    def fail(self, running: Running, message: str, *, retry: bool = False) -> str | None:
        """Fail the job, fenced; `message` is its latest_result().exc_string and the `error`
        of its `failed` event. Returns None when failed, else why the job is not ours.

        vlmq jobs carry retries for one reason: a worker that dies mid-job (RQ's cleanup
        then requeues it and the next worker resumes at item level). Failures reported
        here would repeat (bad input, wrong model, timeout), so by default they do not
        spend those retries. With retry=True and retries left, RQ requeues or schedules
        the job instead and records no failure result, so the message is only logged.
        """
        return self._end_failed(running.job, running.queue, running.execution, running.token,
                                message, retry=retry)

    def _end_failed(self, job: Job, queue: Queue, execution: Execution, token: str,
                    message: str, *, retry: bool) -> str | None:
        if not retry:
            job.retries_left = 0
        requeue = job.should_retry
        if requeue:
            log.warning("job %s failed, RQ will retry it: %s", job.id, message)
        worker = self.worker

        def build(pipe: Pipeline) -> None:
            # What RQ's handle_job_failure writes, in this fenced transaction.
            if requeue:
                job.ended_at = now()
                self._close(pipe, job, execution)
                job.retry(queue, pipe)
                return
            fail_job(pipe, self.keys, job, queue.name, message, worker_name=worker.name,
                     execution=execution)  # sets ended_at, which _close counts
            self._close(pipe, job, execution)
            worker.increment_failed_job_count(pipe)

        why = self._fenced(job, token, build)
        if why is None and not requeue:
            job.send_webhooks(JobStatus.FAILED, exc_string=message)
        self._after_end()
        return why

    def requeue(self, running: Running) -> str | None:
        """Put a job back at the FRONT of its queue (QUEUED), e.g. on a warm shutdown.

        Its execution ends without a result; items already written stay, so whoever takes
        it next resumes at item level. Fenced like every end; returns why not, or None.
        """
        job, queue = running.job, running.queue
        job.get_meta(refresh=True)  # enqueue_job saves meta: keep what others wrote meanwhile
        job.started_at = None
        job.ended_at = None

        def build(pipe: Pipeline) -> None:
            self._close(pipe, job, running.execution)
            queue.enqueue_job(job, pipeline=pipe, at_front=True)

        why = self._fenced(job, running.token, build)
        self._after_end()
        return why

    def _close(self, pipe: Pipeline, job: Job, execution: Execution) -> None:
        """End this worker's execution and release the job's owner key."""
        self.worker.cleanup_execution(job, pipeline=pipe, execution=execution)
        pipe.delete(self.keys.job_owner(str(job.id)))
        if job.started_at is not None and job.ended_at is not None:
            self.worker.increment_total_working_time(job.ended_at - job.started_at, pipe)

    def _after_end(self) -> None:
        if not self.worker.executions and self.worker.get_state() != WorkerStatus.IDLE:
            self.worker.set_state(WorkerStatus.IDLE)


def _rescore(pipe: Pipeline, queue: Queue, execution: Execution, ttl: int, at: float) -> None:
    """Score the execution's registry entries from Redis's time `at`.

    RQ's Execution.create and Execution.heartbeat score them now + ttl by this machine's
    clock; the same entries (ZADD XX, in the same transaction) get Redis's time instead, so
    a worker whose clock runs behind does not look dead to the others.
    """
    if ttl < 0:
        return
    pipe.zadd(queue.started_job_registry.key, {execution.composite_key: at + ttl}, xx=True)
    # RQ keeps a job's own executions 60 s past the TTL.
    pipe.zadd(ExecutionRegistry(job_id=execution.job_id, connection=pipe).key,
              {execution.id: at + ttl + 60}, xx=True)


def _why_not_ours(status: Any, owner: Any, token: str) -> str | None:
    """None when the job is STARTED and owned by `token`, else a short reason."""
    if status is None:
        return "deleted"
    st = as_str(status)
    if st != JobStatus.STARTED.value:
        return st  # queued (requeued after a missed heartbeat), canceled, finished, failed...
    if owner is None:
        return ORPHANED
    if as_str(owner) != token:
        return f"taken over by worker {as_str(owner).split(' ', 1)[-1]}"
    return None


def _triples(flat: Sequence[Any], width: int) -> list[tuple[Any, Any, Any]]:
    """Pipelined replies, `width` per job, as (a, b, c) rows (None where width is 2)."""
    rows = [tuple(flat[i:i + width]) for i in range(0, len(flat), width)]
    return [(r[0], r[1], r[2] if width > 2 else None) for r in rows]


def _float_or_none(raw: Any) -> float | None:
    try:
        return float(as_str(raw)) if raw is not None and as_str(raw) else None
    except ValueError:
        return None


def _int_or_none(raw: Any) -> int | None:
    try:
        return int(as_str(raw)) if raw is not None and as_str(raw) else None
    except ValueError:
        return None
