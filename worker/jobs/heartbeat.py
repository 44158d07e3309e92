"""Keeping a worker and its jobs alive in RQ, and RQ's registries clean, by Redis's clock.

The batch loop never enters RQ's Worker.work(), so nothing of RQ's own keeps the worker
registered, heartbeats its executions, or fails and retries the jobs of dead workers: this
module does, with every expiry and score taken from Redis's TIME, never this machine's.
It owns the worker hash, the started registries (`rq:wip:<q>`) and executions' scores, and
the registry maintenance.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from redis.client import Pipeline
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.executions import Execution, ExecutionRegistry
from rq.job import JobStatus
from rq.registry import (
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ReadyJobRegistry,
    StartedJobRegistry,
)
from rq.utils import now
from rq.worker import WorkerStatus
from rq.worker_registration import clean_worker_registry

from vlmq.shared import constants as C
from vlmq.shared import job_index, results
from vlmq.shared.connection import RedisClock
from vlmq.shared.enqueue import UNREADABLE_HASH_ERRORS
from vlmq.shared.keys import Keys
from vlmq.shared.redis_text import as_str
from vlmq.worker.jobs import poison, queue_guard
from vlmq.worker.jobs.fencing import Fence, Whys
from vlmq.worker.jobs.running import BatchWorker, Running

log = logging.getLogger(__name__)

# At start the worker warns when its clock and Redis's differ by more than this.
CLOCK_WARN_S = 2.0


class Heartbeats:
    """The worker's presence in RQ and its jobs' heartbeats; registry upkeep for all."""

    def __init__(self, worker: BatchWorker, queues: Sequence[Queue], keys: Keys, fence: Fence,
                 clock: RedisClock, *, poison_kills: int) -> None:
        self.worker = worker
        self.queues = queues
        self.keys = keys
        self.fence = fence
        self.clock = clock
        self.poison_kills = poison_kills
        self.connection = worker.connection

    @property
    def interval(self) -> float:
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

    # --- heartbeats ----------------------------------------------------------------------

    def heartbeat(self, running: Iterable[Running]) -> list[tuple[Running, str]]:
        """Extend the worker, and each owned job's execution, wip entry and owner key, by
        heartbeat_ttl; returns the jobs this worker no longer owns, each with why.

        Call it every `interval` seconds (registry scores are whole seconds, so the real
        margin is up to 1 s short of the TTL), or StartedJobRegistry.cleanup fails the
        jobs as AbandonedJobError while they are still running. heartbeat([]) keeps an idle
        worker listed by `rq info` (its key expires after worker_ttl + 60 s).

        A job that is not ours any more (deleted, canceled, or requeued and maybe taken by
        another worker while this one was stalled) gets no heartbeat: that would put a stale
        entry back into its started registry. Stop working on those and `drop` them.
        """
        batch = list(running)
        at = self.clock.measure()
        stamp = datetime.fromtimestamp(at, UTC)

        def build(pipe: Pipeline, whys: Whys) -> None:
            self.worker.heartbeat(pipeline=pipe)  # HSET returns 1 if the worker key was gone
            for r, why in zip(batch, whys, strict=True):
                if why is None:
                    self._extend(pipe, r, at, stamp)

        whys, replies = self.fence.fenced_many(self.fence.watch_keys(batch),
                                               lambda: self.fence.read_whys(batch)[0], build,
                                               skip_if_none=False)
        if replies[0] == 1:  # same repair as RQ's Worker.maintain_heartbeats
            self._register_again()
        return [(r, why) for r, why in zip(batch, whys, strict=True) if why is not None]

    def _extend(self, pipe: Pipeline, r: Running, at: float, stamp: datetime) -> None:
        ttl = self.worker.get_heartbeat_ttl(r.job)
        r.execution.heartbeat(r.queue.started_job_registry, ttl, pipeline=pipe)
        score_execution(pipe, r.queue, r.execution, ttl, at)
        r.job.heartbeat(stamp, ttl, pipeline=pipe)
        self.fence.extend(pipe, r.job_id)

    def _register_again(self) -> None:
        worker = self.worker
        with self.connection.pipeline() as pipe:
            pipe.hset(worker.key, mapping=worker.serialize())
            pipe.expire(worker.key, worker.worker_ttl + 60)
            pipe.execute()

    # --- registry upkeep -----------------------------------------------------------------

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
            queue_guard.scrub_intermediate(self.connection, self.keys, queue, self.worker.name)
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
                results.end_job_event(
                    self.connection, self.keys, job_id, "failed", queue=queue,
                    ttl_s=results.ended_ttl(_int_or_none(ttl), C.FAILURE_TTL_S),
                    fields={"error": "the worker running this job stopped (no heartbeat) "
                                     "and the job's retries are spent (AbandonedJobError)"})

    def sweep_index(self) -> int:
        """One step of the walk that drops index entries of jobs RQ's TTL deleted."""
        return job_index.sweep(self.connection, self.keys)


def score_execution(pipe: Pipeline, queue: Queue, execution: Execution, ttl: int,
                    at: float) -> None:
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


def _int_or_none(raw: Any) -> int | None:
    try:
        return int(as_str(raw)) if raw is not None and as_str(raw) else None
    except ValueError:
        return None
