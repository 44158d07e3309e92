"""The RQ 3.x job lifecycle for one worker process that runs many jobs at once.

RQ's own loop runs one job at a time (`perform_job`, death penalty, fork). A vlmq worker
keeps a model loaded and feeds items from many jobs into one batcher, so it drives RQ's
bookkeeping itself: take a job (STARTED, in `rq:wip:<q>`), heartbeat it while its items
run, then succeed, fail or requeue it. Every step goes through RQ's own worker methods so
that `rq info`, rq-dashboard, registries, retries and dead-worker cleanup keep working.

The phases live in their own modules, each owning its keys: taking (queue entries,
starting, the fence's claim), fencing (the owner key and fenced transactions), heartbeat
(the worker hash, heartbeats, registry upkeep) and job_end (every end, end_job.lua).
JobLifecycle is their one face for the main loop and the tests.

Security: jobs are read with RQ's JSONSerializer only, and a job whose data is not JSON is
refused by looking at its bytes, never by trying to unpickle them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rq import Queue
from rq.serializers import JSONSerializer

from vlmq.shared.connection import RedisClock
from vlmq.shared.keys import Keys
from vlmq.worker.jobs.fencing import ORPHANED, Fence
from vlmq.worker.jobs.heartbeat import CLOCK_WARN_S, Heartbeats
from vlmq.worker.jobs.job_end import INCOMPLETE, JobEnd
from vlmq.worker.jobs.running import BatchWorker, Refused, Running
from vlmq.worker.jobs.taking import Intake, Taken
from vlmq.worker.options import DEFAULT_POISON_KILLS

__all__ = ["CLOCK_WARN_S", "INCOMPLETE", "ORPHANED", "BatchWorker", "JobLifecycle", "Refused",
           "Running"]


class JobLifecycle:
    """Owns the RQ side of every job one BatchWorker runs.

    Call take/succeed/fail/requeue from one loop. heartbeat() may run on another thread
    (it only writes Redis and the Running objects' timestamps); a job that ends meanwhile
    can leave its execution hash behind until heartbeat_ttl expires it, nothing worse.
    """

    def __init__(self, worker: BatchWorker, queues: Sequence[Queue] | None = None,
                 keys: Keys | None = None, *,
                 poison_kills: int = DEFAULT_POISON_KILLS) -> None:
        if poison_kills < 1:
            raise ValueError(f"poison_kills must be at least 1, got {poison_kills}")
        self.worker = worker
        self.keys = keys if keys is not None else Keys.from_env()
        self.connection = worker.connection
        # Every expiry and takeover decision uses Redis's clock, never this machine's.
        self.clock = RedisClock(self.connection)
        # Priority order: take() drains the first queue before looking at the next.
        self.queues: list[Queue] = list(queues) if queues is not None else list(worker.queues)
        for q in self.queues:
            # A pickle queue's registries would unpickle job meta during cleanup.
            if q.serializer is not JSONSerializer:
                raise ValueError(f"queue {q.name!r} does not use the JSON serializer")
        self.fence = Fence(worker, self.keys)
        self.ends = JobEnd(worker, self.keys, self.fence, self.clock)
        self.intake = Intake(worker, self.queues, self.keys, self.fence, self.clock, self.ends)
        self.beats = Heartbeats(worker, self.queues, self.keys, self.fence, self.clock,
                                poison_kills=poison_kills)

    @property
    def in_flight(self) -> int:
        return len(self.worker.executions)

    @property
    def heartbeat_interval(self) -> float:
        return self.beats.interval

    # --- intake --------------------------------------------------------------------------

    def take(self) -> Taken | None:
        """Start the next job, non-blocking; None when every queue is empty."""
        taken, _ = self.intake.take_many(1)
        return taken[0] if taken else None

    def take_many(self, limit: int, *, block_s: float = 0.0,
                  queues: Sequence[Queue] | None = None) -> tuple[list[Taken], bool]:
        return self.intake.take_many(limit, block_s=block_s, queues=queues)

    # --- presence, heartbeats, registry upkeep -------------------------------------------

    def register_birth(self) -> None:
        self.beats.register_birth()

    def register_death(self) -> None:
        self.beats.register_death()

    def heartbeat(self, running: Iterable[Running]) -> list[tuple[Running, str]]:
        return self.beats.heartbeat(running)

    def maintain(self) -> None:
        self.beats.maintain()

    def sweep_index(self) -> int:
        return self.beats.sweep_index()

    # --- ownership -----------------------------------------------------------------------

    def lost(self, running: Sequence[Running]) -> list[tuple[Running, str]]:
        return self.fence.lost(running)

    def is_ours(self, running: Running) -> bool:
        return self.fence.is_ours(running)

    # --- ends ----------------------------------------------------------------------------

    def succeed(self, running: Running, summary: Mapping[str, Any], *,
                require_items: bool = False) -> str | None:
        return self.ends.succeed(running, summary, require_items=require_items)

    def succeed_many(self, ends: Sequence[tuple[Running, Mapping[str, Any]]], *,
                     require_items: bool = False) -> list[str | None]:
        return self.ends.succeed_many(ends, require_items=require_items)

    def fail(self, running: Running, message: str, *, retry: bool = False) -> str | None:
        return self.ends.fail(running, message, retry=retry)

    def requeue(self, running: Running) -> str | None:
        return self.ends.requeue(running)

    def drop(self, running: Running, why: str = "") -> None:
        self.ends.drop(running, why)
