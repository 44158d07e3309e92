"""What the main loop does on a clock rather than on an item: heartbeats and job timeouts,
jobs taken away, the index sweep and published stats, and the watch for a Redis restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from redis import Redis
from rq import Queue
from rq.worker import WorkerStatus

from vlmq.shared import fair, redis_checks
from vlmq.shared.keys import Keys
from vlmq.worker.engine.batcher import EngineState
from vlmq.worker.events import Flight
from vlmq.worker.item_order import ItemOrder
from vlmq.worker.jobs.poison import RiskLog
from vlmq.worker.jobs.rq_jobs import JobLifecycle, Running
from vlmq.worker.prep.vision_cache import VisionCache
from vlmq.worker.results.writer import ResultWriter
from vlmq.worker.stats import WorkerStats

log = logging.getLogger("vlmq.worker")

RESTART_CHECK_S = 0.5  # how often the loop compares Redis's run_id with the one at start


def check_redis(redis: Redis, allow_eviction: bool | None) -> str | None:
    """Eviction refused (unless allowed), persistence warned about: why not to run, or None."""
    try:
        warning = redis_checks.check_eviction(redis, allow_eviction)
    except redis_checks.EvictionRefused as exc:
        return f"refusing to start: {exc}"
    for message in (warning, redis_checks.persistence_warning(redis)):
        if message:
            log.warning("%s", message)
    return None


class Upkeep:
    def __init__(self, redis: Redis, keys: Keys, name: str, lifecycle: JobLifecycle,
                 order: ItemOrder[Running], writer: ResultWriter, stats: WorkerStats,
                 engine: EngineState, cache: VisionCache, flight: Flight, *,
                 risk: RiskLog | None, stats_s: float,
                 restarts: redis_checks.RestartWatch | None,
                 allow_eviction: bool | None) -> None:
        self.redis = redis
        self.keys = keys
        self.name = name
        self.lifecycle = lifecycle
        self.order = order
        self.writer = writer
        self.stats = stats
        self.engine = engine
        self.cache = cache
        self.flight = flight
        self.risk = risk
        self.stats_s = stats_s
        self.restarts = restarts
        self.allow_eviction = allow_eviction
        self._next_heartbeat = self._next_stats = time.monotonic()
        self._next_restart_check = 0.0

    def tick(self, now: float) -> None:
        """Heartbeat and stats when each is due."""
        if now >= self._next_heartbeat:
            self.heartbeat()
            self._next_heartbeat = now + self.lifecycle.heartbeat_interval
        if now >= self._next_stats:
            self._drop(self.lifecycle.lost(list(self.order.jobs.values())))
            self.lifecycle.sweep_index()
            self.publish()
            self._next_stats = now + self.stats_s

    def heartbeat(self) -> None:
        """Keep every owned job alive in RQ; drop jobs lost or past their timeout."""
        states = list(self.order.jobs.values())
        self._drop(self.lifecycle.heartbeat(states))
        if self.risk is not None:
            self.risk.flush()  # records a connection reset left behind
        for state in states:
            if state.job_id in self.order.jobs and state.timed_out():
                done = state.already_done + state.finished_here
                self.writer.fail(state, _timeout_message(state, done, state.total))
        self.lifecycle.maintain()

    def publish(self, *, stopped: bool = False) -> None:
        jobs, preparing = (0, 0) if stopped else (len(self.order), self.flight.preparing)
        held = [] if stopped else [(j.share, j.left) for j in self.order.jobs.values()]
        self.stats.shares = fair.shares_of(held)
        self.stats.publish(self.redis, self.keys, self.engine, self.cache, jobs, preparing)

    def _drop(self, lost: Iterable[tuple[Running, str]]) -> None:
        """Stop work on jobs canceled, deleted or lost meanwhile: write nothing more."""
        for running, why in lost:
            self.writer.drop(running, why)

    # --- Redis restarts ------------------------------------------------------------------

    def look_soon(self) -> None:
        """A Redis error broke the connections, which a restart does: look first."""
        self._next_restart_check = 0.0

    def watch_restart(self) -> str | None:
        """A Redis that restarted (run_id changed) may have come back empty: say so for each
        job in flight whose hash is gone, forget those, and register this worker again. A
        Redis restored from AOF or RDB keeps its jobs, and they run on. Returns why the
        worker must stop (the new Redis evicts), else None."""
        now = time.monotonic()
        # Every turn while jobs run: a result flushed to the new Redis would be dropped as
        # "deleted" before a slower check said why.
        if self.restarts is None or (not self.order.jobs
                                     and now < self._next_restart_check):
            return None
        self._next_restart_check = now + RESTART_CHECK_S
        old = self.restarts.changed()
        if old is None:
            return None
        self._forget_lost(old, self.restarts.run_id)
        # The heartbeat may have recreated a partial worker hash: register from scratch.
        self.redis.delete(self.lifecycle.worker.key)
        self.lifecycle.register_birth()
        if self.order.jobs:
            self.lifecycle.worker.set_state(WorkerStatus.BUSY)
        self.publish()
        log.info("worker %s registered again after the Redis restart", self.name)
        return check_redis(self.redis, self.allow_eviction)

    def _forget_lost(self, old: str, new: str) -> None:
        states = list(self.order.jobs.values())
        with self.redis.pipeline(transaction=False) as pipe:
            for state in states:
                pipe.exists(state.job.key)
            kept = pipe.execute()
        lost = [state for state, there in zip(states, kept, strict=True) if not there]
        log.error("Redis restarted (run_id %s -> %s): %d of %d job(s) in flight here were "
                  "lost with it", old[:8], new[:8], len(lost), len(states))
        for state in lost:
            log.error("job %s lost with the Redis restart (its hash, queue entry and "
                      "results are gone): enqueue it again", state.job_id)
            self.writer.drop(state, "lost with the Redis restart")
        redis_checks.record_restart(self.redis, self.keys, old, new, self.name,
                                    [s.job_id for s in lost])


def _timeout_message(running: Running, done: int, total: int) -> str:
    limit = running.job.timeout or Queue.DEFAULT_TIMEOUT
    ran = time.monotonic() - running.started
    return (f"job timeout exceeded: the job's limit is {limit} s and it ran {ran:.0f} s here, "
            f"with {done}/{total} items done (their results are kept)")
