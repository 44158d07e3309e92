"""Ending a job's execution: finished, failed, requeued, or dropped as no longer ours.

Each end is one fenced transaction (worker/jobs/fencing.py) holding what RQ's own handlers would
write, the owner key's release, and the job's terminal event (end_job.lua through
shared/results.end_job_event, or shared/enqueue.fail_job), so an end lands whole or not at
all, and only while this execution still owns the job.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from redis.client import Pipeline
from rq import Queue
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.utils import now
from rq.worker import WorkerStatus

from vlmq.shared import constants as C
from vlmq.shared import job_index, results
from vlmq.shared.connection import RedisClock
from vlmq.shared.enqueue import fail_job
from vlmq.shared.keys import Keys
from vlmq.shared.logs import job_fields
from vlmq.worker.jobs.fencing import ORPHANED, Fence, Whys
from vlmq.worker.jobs.running import BatchWorker, Running

log = logging.getLogger(__name__)

# JobEnd.succeed's answer when item results are missing at the moment of finishing.
INCOMPLETE = "item results missing"
# RQ job hash fields a finished job drops: callbacks and group RQ writes empty, and what
# only a queued or running job or a failed one reads (heartbeat, first start, timeout,
# retry intervals, failure TTL, the item count that queued-item sums read). retries_left
# stays: it says whether a worker died under the job.
FINISHED_DROPS = ("success_callback_name", "failure_callback_name", "stopped_callback_name",
                  "group_id", "last_heartbeat", "retry_intervals", "timeout", "failure_ttl",
                  C.FIRST_STARTED_FIELD, job_index.ITEMS_FIELD)


class JobEnd:
    """Every way a job's execution on this worker ends."""

    def __init__(self, worker: BatchWorker, keys: Keys, fence: Fence, clock: RedisClock) -> None:
        self.worker = worker
        self.keys = keys
        self.fence = fence
        self.clock = clock
        self.connection = worker.connection

    # --- finished ------------------------------------------------------------------------

    def succeed(self, running: Running, summary: Mapping[str, Any], *,
                require_items: bool = False) -> str | None:
        """Finish the job with `summary` as its result, fenced.

        The status change, the registries and the `finished` event are one transaction.
        The event carries the summary's fields, and the whole summary as JSON in
        `summary`; the job hash keeps the summary (end_job.lua), RQ's results stream
        none. Returns None when finished; with require_items, INCOMPLETE when,
        checked in the same transaction, not every item has a stored result (nothing
        written: compute the missing ones); else why the job is not this worker's any more.
        """
        return self.succeed_many([(running, summary)], require_items=require_items)[0]

    def succeed_many(self, ends: Sequence[tuple[Running, Mapping[str, Any]]], *,
                     require_items: bool = False) -> Whys:
        """`succeed` for several jobs in one transaction (one WATCH, one MULTI/EXEC): each
        job is checked on its own and only the ones that pass are finished; returns each
        job's answer, in order."""
        if not ends:
            return []
        batch = [r for r, _ in ends]
        values = [_return_value(summary) for _, summary in ends]
        ttls = [r.job.get_result_ttl(self.worker.default_result_ttl) for r in batch]
        watch = self.fence.watch_keys(batch)
        if require_items:
            watch += [self.keys.job_items(r.job_id) for r in batch]

        def build(pipe: Pipeline, whys: Whys) -> None:
            for r, value, ttl, why in zip(batch, values, ttls, whys, strict=True):
                if why is None:
                    self._finish(pipe, r, value, ttl)
            if not self.worker.executions:  # the last one ended: idle, in the same EXEC
                self.worker.set_state(WorkerStatus.IDLE, pipeline=pipe)

        whys, _ = self.fence.fenced_many(watch, lambda: self._unfinished(batch, require_items),
                                         build, skip_if_none=True)
        for r, why in zip(batch, whys, strict=True):
            if why is None:
                r.job.send_webhooks(JobStatus.FINISHED)
        if any(why != INCOMPLETE for why in whys):
            self._after_end()
        return whys

    def _unfinished(self, batch: Sequence[Running], require_items: bool) -> Whys:
        """Why each job may not finish now: not ours, or (require_items) not every item
        stored; None for those that may."""
        if not require_items:
            return self.fence.read_whys(batch)[0]
        whys, stored = self.fence.read_whys(
            batch, lambda rp, r: rp.hlen(self.keys.job_items(r.job_id)))
        return [INCOMPLETE if why is None and int(n) < r.total else why
                for r, why, n in zip(batch, whys, stored, strict=True)]

    def _finish(self, pipe: Pipeline, running: Running, value: dict[str, Any],
                result_ttl: int) -> None:
        """What RQ's handle_job_success writes (vlmq jobs have no dependents, repeats or
        rate limits), queued on the caller's fenced transaction instead of RQ's own."""
        job, worker = running.job, self.worker
        job.ended_at = now()
        job.set_status(JobStatus.FINISHED, pipeline=pipe)
        job.save(pipeline=pipe, include_meta=False, include_result=False)
        # What a finished job no longer needs (RQ writes them empty or for a run that
        # ended): each hash field costs ~60 B for the job's whole result_ttl.
        pipe.hdel(job.key, *FINISHED_DROPS)
        if result_ttl != 0:
            # No RQ Result: its stream would cost ~4.7 kB a job (Redis 7.0 preallocates a
            # stream node) for a summary the job hash already holds (end_job.lua's
            # vlmq_event); producers read it there (PROTOCOL.md section 6).
            job.finished_job_registry.add(job, result_ttl, pipe)
            if result_ttl > 0:  # RQ scored it by this machine's clock
                pipe.zadd(job.finished_job_registry.key,
                          {str(job.id): self.clock.now() + result_ttl}, xx=True)
        job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
        self._close(pipe, running.job, running.execution)
        results.end_job_event(self.connection, self.keys, running.job_id, "finished",
                              queue=running.queue.name,
                              ttl_s=results.ended_ttl(result_ttl, C.RESULT_TTL_S),
                              fields={**value, "summary": value}, pipeline=pipe)
        worker.increment_successful_job_count(pipeline=pipe)

    # --- failed, requeued ----------------------------------------------------------------

    def fail(self, running: Running, message: str, *, retry: bool = False) -> str | None:
        """Fail the job, fenced; `message` is its latest_result().exc_string and the `error`
        of its `failed` event. Returns None when failed, else why the job is not ours.

        vlmq jobs carry retries for one reason: a worker that dies mid-job (RQ's cleanup
        then requeues it and the next worker resumes at item level). Failures reported
        here would repeat (bad input, wrong model, timeout), so by default they do not
        spend those retries. With retry=True and retries left, RQ requeues or schedules
        the job instead and records no failure result, so the message is only logged.
        """
        return self.end_failed(running.job, running.queue, running.execution, running.token,
                               message, retry=retry)

    def end_failed(self, job: Job, queue: Queue, execution: Execution, token: str,
                   message: str, *, retry: bool) -> str | None:
        """`fail` for a job started but not yet Running (its payload was refused)."""
        if not retry:
            job.retries_left = 0
        requeue = job.should_retry
        if requeue:
            log.warning("job %s failed, RQ will retry it: %s", job.id, message,
                        extra=job_fields(job.id))
        worker = self.worker

        def build(pipe: Pipeline) -> None:
            # What RQ's handle_job_failure writes, in this fenced transaction.
            if requeue:
                job.ended_at = now()
                self._close(pipe, job, execution)
                job.retry(queue, pipe)
                job_index.tally_sync(self.connection, self.keys, [str(job.id)],
                                     pipeline=pipe)  # counted queued (or scheduled) again
                return
            fail_job(pipe, self.keys, job, queue.name, message, worker_name=worker.name,
                     execution=execution)  # sets ended_at, which _close counts
            self._close(pipe, job, execution)
            worker.increment_failed_job_count(pipe)

        why = self.fence.fenced(job, token, build)
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
            job_index.tally_sync(self.connection, self.keys, [running.job_id],
                                 pipeline=pipe)  # counted queued again, in the same EXEC

        why = self.fence.fenced(job, running.token, build)
        self._after_end()
        return why

    # --- no longer ours ------------------------------------------------------------------

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
            results.end_job_event(self.connection, self.keys, running.job_id, "canceled",
                                  queue=running.queue.name,
                                  ttl_s=results.ended_ttl(running.job.result_ttl, C.RESULT_TTL_S))
        self._after_end()

    # --- shared by every end -------------------------------------------------------------

    def _close(self, pipe: Pipeline, job: Job, execution: Execution) -> None:
        """End this worker's execution and release the job's owner key."""
        self.worker.cleanup_execution(job, pipeline=pipe, execution=execution)
        self.fence.release(pipe, str(job.id))
        if job.started_at is not None and job.ended_at is not None:
            self.worker.increment_total_working_time(job.ended_at - job.started_at, pipe)

    def _after_end(self) -> None:
        if not self.worker.executions and self.worker.get_state() != WorkerStatus.IDLE:
            self.worker.set_state(WorkerStatus.IDLE)


def _return_value(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The summary as the job's RQ result: checked to be JSON here, since RQ would store
    "Unserializable return value" in its place instead of raising."""
    value = dict(summary)
    json.dumps(value)
    return value
