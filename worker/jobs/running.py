"""The RQ side of a job in flight, and the RQ worker whose executions hold them.

Every phase of the job lifecycle (taking, fencing, heartbeat, job_end) passes these
objects around; they live here so that none of those modules imports another's records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rq import Queue
from rq.executions import Execution
from rq.job import Job
from rq.serializers import JSONSerializer, resolve_serializer
from rq.worker import SimpleWorker

from vlmq.worker.item_order import JobState


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
            "BatchWorker jobs run through vlmq.worker.jobs.rq_jobs.JobLifecycle, "
            "not Worker.work()")


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
