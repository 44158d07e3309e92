"""Taking jobs: queue entries moved, checked, and their jobs started and fenced.

Entries are LMOVEd into each queue's intermediate list as RQ does, checked with bounded
raw reads (worker/jobs/queue_guard.py) before RQ loads anything, and started several per round
trip: STARTED, an execution in `rq:wip:<q>`, and the owner key that fences every later
write (worker/jobs/fencing.py). This module owns the queue lists and their intermediate lists.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from redis.client import Pipeline
from redis.exceptions import ResponseError, WatchError
from rq import Queue
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.worker import WorkerStatus

from vlmq.shared import constants as C
from vlmq.shared import fair, job_index, results
from vlmq.shared.connection import RedisClock
from vlmq.shared.enqueue import payload_of
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import Keys
from vlmq.shared.logs import job_fields
from vlmq.shared.redis_text import as_str
from vlmq.worker.jobs import queue_guard
from vlmq.worker.jobs.fencing import Fence
from vlmq.worker.jobs.heartbeat import score_execution
from vlmq.worker.jobs.job_end import JobEnd
from vlmq.worker.jobs.running import BatchWorker, Refused, Running

log = logging.getLogger(__name__)

Taken = Running | Refused


class Intake:
    """Takes and starts the jobs of one worker's queues, in their priority order."""

    def __init__(self, worker: BatchWorker, queues: Sequence[Queue], keys: Keys, fence: Fence,
                 clock: RedisClock, ends: JobEnd) -> None:
        self.worker = worker
        self.queues = queues
        self.keys = keys
        self.fence = fence
        self.clock = clock
        self.ends = ends  # a payload refused after its start fails like any started job
        self.connection = worker.connection

    def take_many(self, limit: int, *, block_s: float = 0.0,
                  queues: Sequence[Queue] | None = None) -> tuple[list[Taken], bool]:
        """Start up to `limit` jobs, the first queue drained before the next, each queue's
        batches in fair turns (shared/fair.py); returns them and whether every queue was
        found empty. `queues`: those of this worker's queues to look at (default: all).

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
        out: list[Taken] = []
        looked = list(self.queues if queues is None else queues)
        for queue in looked:
            while len(out) < limit:
                raws = self._pop(queue, limit - len(out))
                if not raws:
                    break  # this queue is empty: look at the next
                out += self._take_entries(queue, raws)
            if len(out) >= limit:
                return out, False
        if not out and block_s > 0 and len(looked) == 1:
            queue = looked[0]
            raw = self.connection.blmove(queue.key, queue.intermediate_queue_key,
                                         block_s)  # type: ignore[arg-type]  # Redis takes a float
            if raw is not None:
                return self._take_entries(queue, [raw]), False
        return out, True

    def _pop(self, queue: Queue, want: int) -> list[bytes]:
        """Move up to `want` entries into the intermediate list, in fair turns between the
        queue's batches (shared/fair.py: one script call, one round trip)."""
        return fair.take(self.connection, self.keys, queue.name, want).entries

    # --- entries to jobs -----------------------------------------------------------------

    def _take_entries(self, queue: Queue, raws: Sequence[bytes | str]) -> list[Taken]:
        """Start popped entries (refused ones as Refused; stale ones left out)."""
        out: list[Taken] = []
        jobs: list[Job] = []
        first: dict[str, float | None] = {}  # each job's first start on any worker, if any
        checked = queue_guard.inspect_many(self.connection, self.keys, raws)
        for raw, (verdict, fields) in zip(raws, checked, strict=True):
            loaded = self._load(verdict, fields)
            if isinstance(loaded, Job):
                jobs.append(loaded)
                first[str(loaded.id)] = _float_or_none(
                    (fields or {}).get(C.FIRST_STARTED_FIELD.encode()))
            elif loaded.reason is None:  # deleted since it was pushed: nothing to run or fail
                self.connection.lrem(queue.intermediate_queue_key, 1, raw)  # type: ignore[arg-type]
            else:
                queue_guard.refuse(self.connection, self.keys, queue, raw, loaded, self.worker.name)
                out.append(Refused(loaded.label, queue.name, loaded.reason))
        for job, execution, at in self._mark_started(jobs, queue):
            out.append(self._start(job, queue, execution, first.get(str(job.id)) or at))
        self._ensure_indexed([r for r in out if isinstance(r, Running)])
        return out

    def _load(self, verdict: queue_guard.Verdict, fields: dict[bytes, bytes] | None
              ) -> Job | queue_guard.Verdict:
        """The job RQ builds from the hash the guard read, or the verdict to act on."""
        if verdict.reason is not None or fields is None:
            return verdict
        assert verdict.job_id is not None  # a valid id: inspect checked it
        try:
            job = self.worker.job_class(verdict.job_id, connection=self.connection,
                                        serializer=JSONSerializer)
            job.restore(fields)  # what Job.fetch does with the hash read above
            # RQ writes the job back at its start and end: a value restore let through but
            # cannot write (dependency_ids of 1e999) must fail here, not in the end's MULTI.
            job.to_dict()
        except Exception as exc:  # noqa: BLE001  # whatever RQ raises on a hash it cannot load
            return queue_guard.Verdict(verdict.job_id, f"RQ cannot read its hash "
                                       f"({type(exc).__name__}: {exc})", hash_exists=True)
        return job

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

    def _start(self, job: Job, queue: Queue, execution: Execution,
               first_started: float) -> Taken:
        """The started job as Running, or failed and Refused when its payload is bad."""
        try:
            payload = payload_of(job)
        except PayloadError as exc:
            reason = f"vlmq refused job {job.id}: {exc}"
        except Exception as exc:  # a validator bug must fail this job, not the worker (logged)
            log.exception("job %s: payload validation crashed", job.id,
                          extra=job_fields(job.id))
            reason = f"vlmq refused job {job.id}: payload validation crashed ({exc!r})"
        else:
            return Running(job_id=str(job.id), payload=payload, job=job, queue=queue,
                           execution=execution, token=self.fence.token(execution),
                           first_started=first_started)
        self.ends.end_failed(job, queue, execution, self.fence.token(execution), reason,
                             retry=False)
        return Refused(str(job.id), queue.name, reason)

    # --- STARTED -------------------------------------------------------------------------

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
                statuses = self.fence.watched_reads(lambda rp: [rp.hget(job.key, "status")
                                                                for job in jobs])
                fresh, stale = _sort_out(jobs, statuses)
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
                return self._one_by_one(jobs, queue)
            except ResponseError as exc:  # a job's key replaced by another type meanwhile
                queue_guard.wrong_type(exc)  # any other refusal is the server's own: raised
                pipe.reset()
                return self._retyped(jobs, queue)
        for job, why in stale:
            log.warning("job %s listed in queue %s but %s: stale entry skipped", job.id,
                        queue.name, why, extra=job_fields(job.id))
        for _, execution, _ in started:
            worker.executions[execution.id] = execution
        return started

    def _one_by_one(self, jobs: Sequence[Job], queue: Queue
                    ) -> list[tuple[Job, Execution, float]]:
        """A job changed between the check and the start: each is tried again alone, and
        a lone job that changed was taken by another worker."""
        if len(jobs) > 1:
            return [s for job in jobs for s in self._mark_started([job], queue)]
        self.connection.lrem(queue.intermediate_queue_key, 1, jobs[0].id)
        log.warning("job %s listed in queue %s but taken by another worker: stale "
                    "entry skipped", jobs[0].id, queue.name, extra=job_fields(jobs[0].id))
        return []

    def _retyped(self, jobs: Sequence[Job], queue: Queue
                 ) -> list[tuple[Job, Execution, float]]:
        """A key of one of `jobs` became another Redis type after the guard read it: each
        is tried again alone, and a lone one that still fails is dead-lettered."""
        if len(jobs) > 1:
            return [s for job in jobs for s in self._mark_started([job], queue)]
        job_id = str(jobs[0].id)
        queue_guard.refuse(self.connection, self.keys, queue, job_id, queue_guard.Verdict(
            job_id, "one of its keys became another Redis type as it was taken (written by "
                    "hand?): no command on it can succeed"), self.worker.name)
        return []

    def _queue_start(self, pipe: Pipeline, job: Job, queue: Queue, at: float) -> Execution:
        worker = self.worker
        if job.origin != queue.name:
            # A hand-written hash without origin would land in the wrong registries.
            log.warning("job %s: origin %r repaired to %r", job.id, job.origin, queue.name,
                        extra=job_fields(job.id))
            job.origin = queue.name
            pipe.hset(job.key, "origin", queue.name)
        ttl = worker.get_heartbeat_ttl(job)
        execution = Execution.create(job, ttl, pipeline=pipe, worker_name=worker.name)
        score_execution(pipe, queue, execution, ttl, at)
        job.prepare_for_execution(worker.name, pipe)
        pipe.hsetnx(job.key, C.FIRST_STARTED_FIELD, f"{at:.3f}")
        pipe.hdel(job.key, C.FAIR_FIELD)  # taken, whichever way: no turn may take it again
        self.fence.claim(pipe, str(job.id), execution)
        pipe.hdel(job.key, results.END_FIELD)  # a new run gets its own terminal event
        pipe.hdel(self.keys.job_end(str(job.id)),
                  results.END_EVENT)  # (a payload moved there stays)
        pipe.persist(job.key)  # a job enqueued with ttl= must not vanish mid-run
        pipe.lrem(queue.intermediate_queue_key, 1, job.id)
        return execution


def _sort_out(jobs: Sequence[Job], statuses: Sequence[Any]
              ) -> tuple[list[Job], list[tuple[Job, str]]]:
    """The jobs to start (QUEUED, or a hash without status), and the stale rest with why:
    started elsewhere meanwhile, or the same id twice in one batch."""
    fresh: list[Job] = []
    stale: list[tuple[Job, str]] = []
    for job, status in zip(jobs, statuses, strict=True):
        if status is not None and as_str(status) != JobStatus.QUEUED.value:
            stale.append((job, f"already {as_str(status)}"))
        elif any(job.id == f.id for f in fresh):
            stale.append((job, "already taken here"))
        else:
            fresh.append(job)
    return fresh, stale


def _float_or_none(raw: Any) -> float | None:
    try:
        return float(as_str(raw)) if raw is not None and as_str(raw) else None
    except ValueError:
        return None
