"""The worker's side of intake: jobs taken while there is room, then made ready to run.

JobLifecycle takes and starts jobs in RQ (worker/jobs/taking.py); here each one gets its
settings resolved on this model, its blobs' lifetimes refreshed, the items already done
(a resumed job) and those the result cache answers left out, before its items are
scheduled. A job that cannot start fails alone: never the worker.

Interactive requests (the chat queue, shared/chat.py) are taken first at every turn,
before the fair-share take of the bulk queues and whatever the bulk jobs fill: they have
a window of their own (as many jobs as the bulk window), so a worker full of bulk work
still takes them at once.

It sits beside loop.py, above the phases, because making a job ready joins three of them:
the lifecycle (jobs/), the result cache and writer (results/) and the requests (prep/).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from redis import Redis
from redis.exceptions import RedisError
from rq import Queue

from vlmq.shared.chat import CHAT_QUEUE
from vlmq.shared.connection import transient
from vlmq.shared.keys import Keys
from vlmq.shared.logs import job_fields
from vlmq.shared.messages import ItemResult
from vlmq.shared.redis_text import as_str
from vlmq.worker.item_order import ItemOrder
from vlmq.worker.jobs.rq_jobs import JobLifecycle, Refused, Running
from vlmq.worker.prep.preparer import Preparer
from vlmq.worker.results.cache import ResultCache, cached_results_many
from vlmq.worker.results.writer import ResultWriter
from vlmq.worker.stats import WorkerStats

log = logging.getLogger("vlmq.worker")


class JobStarter:
    def __init__(self, redis: Redis, keys: Keys, lifecycle: JobLifecycle, preparer: Preparer,
                 results: ResultCache, writer: ResultWriter, order: ItemOrder[Running],
                 stats: WorkerStats, *, job_limit: Callable[[], int]) -> None:
        """`job_limit`: how many jobs may be in flight now (it follows the batch limit)."""
        self.redis = redis
        self.keys = keys
        self.lifecycle = lifecycle
        self.preparer = preparer
        self.results = results
        self.writer = writer
        self.order = order
        self.stats = stats
        self.job_limit = job_limit
        # Started in Redis but not yet here: a transient Redis error cut their start short,
        # so they are finished next turn (or requeued at shutdown), not lost until RQ's
        # cleanup.
        self.starting: list[Running] = []
        self.queues_empty = False

    def pull(self, *, block_s: float = 0.0) -> int:
        """Take jobs while there is room, several per round trip, interactive ones first;
        returns how many were taken (queues_empty then says whether every queue was found
        empty)."""
        if self.starting:  # a Redis error cut their start short: finish it first
            jobs, self.starting = self.starting, []
            self.start(jobs)
        chat = [q for q in self.lifecycle.queues if q.name == CHAT_QUEUE]
        bulk = [q for q in self.lifecycle.queues if q.name != CHAT_QUEUE]
        interactive = sum(state.interactive for state in self.order.jobs.values())
        took, empty = 0, True
        for queues, room in ((chat, self.job_limit() - interactive),
                             (bulk, self.job_limit() - (len(self.order) - interactive))):
            if not queues:
                continue
            if room <= 0:
                empty = False
                continue
            # Only a worker of one queue waits in a blocking pop (the loop says so).
            n, found_empty = self._take(room, queues, block_s)
            took += n
            empty = empty and found_empty
        self.queues_empty = empty
        return took

    def _take(self, room: int, queues: list[Queue], block_s: float) -> tuple[int, bool]:
        """Take and start up to `room` jobs of `queues`; how many, and whether all of
        `queues` were found empty."""
        taken, empty = self.lifecycle.take_many(room, block_s=block_s, queues=queues)
        started: list[Running] = []
        for running in taken:
            if isinstance(running, Refused):
                log.warning("job %s (%s) refused: %s", running.job_id, running.queue,
                            running.reason, extra=job_fields(running.job_id))
                self.stats.count_job(running.queue, "refused")
            else:
                started.append(running)
                self.stats.count_job(running.queue.name, "taken", waited_s=self._waited(running))
        if started:
            self.start(started)
        return len(taken), empty

    def _waited(self, running: Running) -> float | None:
        """Seconds from the job's (re)enqueue to now, by Redis's clock (RQ's enqueued_at
        comes from the producer's clock: a skewed one is clamped at 0)."""
        enqueued = running.job.enqueued_at
        if enqueued is None:
            return None
        return max(0.0, self.lifecycle.clock.now() - enqueued.timestamp())

    def start(self, jobs: list[Running]) -> None:
        """Resolve each job's settings, then read what every one needs in one round trip:
        its blobs' lifetimes refreshed (a long wait in the queue must not expire them) and
        the items already done (a resumed job)."""
        ready = [running for running in jobs if self._resolve(running)]
        if not ready:
            return
        self.starting = ready
        todo_of = self._todo(ready)
        hits_of = self._cached(ready, todo_of)
        self.starting = []
        for running, todo, hits in zip(ready, todo_of, hits_of, strict=True):
            try:
                self._begin(running, todo, hits)
            except Exception as exc:  # noqa: BLE001  # handled as one job's failure
                self._failed(running, exc)

    def _resolve(self, running: Running) -> bool:
        """The job's settings on this model; False when it failed instead."""
        try:
            earlier = self.order.jobs.get(running.job_id)
            if earlier is not None:
                # take() only starts a QUEUED job: it was requeued (by hand, or by RQ's
                # cleanup after this worker missed its heartbeats), so the earlier
                # execution is stale.
                self.writer.drop(earlier, "requeued while running here; its new run resumes")
            settings = self.preparer.check_job(running.payload)
            if isinstance(settings, str):
                self.writer.fail(running, settings)
                return False
            running.settings = settings
            running.interactive = running.queue.name == CHAT_QUEUE
            return True
        except Exception as exc:  # noqa: BLE001  # handled as one job's failure
            self._failed(running, exc)
            return False

    def _todo(self, ready: list[Running]) -> list[list[int]]:
        """Each job's items without a stored result, with its blobs touched, one round
        trip for all (already_done is set on each)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for running in ready:
                pipe.hkeys(self.keys.job_items(running.job_id))
            for running in ready:
                self.preparer.touch_blobs(running.payload, running.resolved, pipeline=pipe)
            done_of = pipe.execute()[:len(ready)]
        todo_of: list[list[int]] = []
        for running, done_raw in zip(ready, done_of, strict=True):
            n = len(running.payload.items)
            done = {i for i in map(_item_index, done_raw) if i is not None and i < n}
            running.already_done = len(done)
            todo_of.append([i for i in range(n) if i not in done])
        return todo_of

    def _cached(self, ready: list[Running], todo_of: list[list[int]]
                ) -> list[dict[int, ItemResult]]:
        """The result cache's answers among each job's items to do. A bad reference fails
        even when its content's text is cached, so only readable items are asked."""
        asked = [(running, self.preparer.readable(running.payload, todo))
                 for running, todo in zip(ready, todo_of, strict=True)]
        hits_of = cached_results_many(self.results, asked)
        self.stats.result_cache_misses += sum(
            len(indexes) - len(hits)
            for (running, indexes), hits in zip(asked, hits_of, strict=True)
            if self.results.applies(running.resolved))
        return hits_of

    def _begin(self, running: Running, todo: list[int], hits: dict[int, ItemResult]) -> None:
        running.pending = deque(i for i in todo if i not in hits)
        done = running.already_done
        log.info("job %s started: %s, %d items%s", running.job_id, running.payload.task,
                 running.total, f" ({done} already done, resuming)" if done else "",
                 extra=job_fields(running.job_id))
        self.order.add(running)
        self.writer.hold(running.job_id, hits.values())

    def _failed(self, running: Running, exc: Exception) -> None:
        """A job that could not start fails alone: never the worker."""
        if isinstance(exc, RedisError):
            if transient(exc):
                raise exc  # the job stays STARTED; RQ reclaims it if we never come back
            log.error("job %s could not be started", running.job_id, exc_info=exc,
                      extra=job_fields(running.job_id))
            self.writer.fail(running, f"Redis refused a command for this job: {exc}")
            return
        log.error("job %s could not be started", running.job_id, exc_info=exc,
                  extra=job_fields(running.job_id))
        self.writer.fail(running, f"worker error starting the job: "
                                  f"{type(exc).__name__}: {exc}")


def _item_index(field: bytes | str) -> int | None:
    """A field of a job's results hash as an item index; any other field (written by hand)
    names no result."""
    text = as_str(field)
    return int(text) if len(text) <= 9 and text.isascii() and text.isdigit() else None
