"""Writing a job's results: item results as they come back, then the job's end.

The worker's main thread records each item that comes back (from the engine or a failed
preparation), writes what it holds once per loop turn (one transaction per job), and
ends a job once every item has a stored result. Results wait in memory while Redis is
unreachable, and are written when it is back.

Fencing: every write here is applied only while this worker's execution still owns the
job (Keys.job_owner), checked atomically with the write: item results by one Lua script
(shared/write_items.lua), the job's end by JobLifecycle's WATCH transaction. A worker
that stalled past its heartbeat TTL, and whose job another worker took meanwhile, writes
nothing more for it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable

from redis import Redis
from redis.exceptions import RedisError

from vlmq.shared import constants as C
from vlmq.shared import lua
from vlmq.shared import results as R
from vlmq.shared.connection import transient
from vlmq.shared.keys import Keys
from vlmq.shared.schema import ItemResult, JobSummary
from vlmq.worker.engine import Finished
from vlmq.worker.rq_jobs import INCOMPLETE, JobLifecycle, Running
from vlmq.worker.scheduler import Scheduler
from vlmq.worker.stats import WorkerStats

log = logging.getLogger("vlmq.worker")


def finished_result(state: Running, idx: int, f: Finished, prep_s: float) -> ItemResult:
    item = state.payload.items[idx]
    timings = dict(f.timings)
    timings["preprocess_s"] = round(prep_s, 4)
    return ItemResult(
        index=idx, source=item.source, page=item.page,
        text=None if f.error else f.text, finish_reason=f.finish_reason,
        prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
        vision_cache_hit=f.vision_cache_hit, error=f.error, timings=timings,
        custom_id=item.custom_id, repetition=f.repetition)


def failed_result(state: Running, idx: int, message: str) -> ItemResult:
    item = state.payload.items[idx]
    return ItemResult(
        index=idx, source=item.source, page=item.page, text=None, finish_reason="error",
        prompt_tokens=0, completion_tokens=0, vision_cache_hit=False, error=message,
        timings={}, custom_id=item.custom_id)


def result_ttl(running: Running) -> int:
    """Item results live as long as the job's own result (RQ's result_ttl)."""
    ttl = running.job.result_ttl
    return ttl if ttl is not None and ttl > 0 else C.RESULT_TTL_S


class ResultWriter:
    """Holds item results until they are stored, and ends jobs once every item is."""

    def __init__(self, redis: Redis, keys: Keys, lifecycle: JobLifecycle,
                 scheduler: Scheduler[Running], stats: WorkerStats, *,
                 on_stored: Callable[[Running, list[ItemResult]], None] | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.lifecycle = lifecycle
        self.scheduler = scheduler
        self.stats = stats
        self.on_stored = on_stored  # runs after a job's results are stored (the result cache)
        self._unwritten: dict[str, dict[int, ItemResult]] = {}
        self._write_items = lua.script(redis, lua.WRITE_ITEMS)

    @property
    def holding(self) -> int:
        """Results recorded but not yet stored."""
        return sum(len(r) for r in self._unwritten.values())

    # --- record --------------------------------------------------------------------------

    def record_finished(self, job_id: str, idx: int, f: Finished, prep_s: float) -> bool:
        state = self.scheduler.item_returned(job_id, idx)
        if state is None:
            return False  # the job was dropped meanwhile, or this item came back already
        self._unwritten.setdefault(job_id, {})[idx] = finished_result(state, idx, f, prep_s)
        return True

    def record_failure(self, job_id: str, idx: int, message: str) -> bool:
        state = self.scheduler.item_returned(job_id, idx)
        if state is None:
            return False
        self._unwritten.setdefault(job_id, {})[idx] = failed_result(state, idx, message)
        return True

    def hold(self, job_id: str, results: Iterable[ItemResult]) -> None:
        """Results ready without any work (result-cache hits): written like the others."""
        for res in results:
            self._unwritten.setdefault(job_id, {})[res.index] = res

    def drop(self, state: Running, why: str) -> None:
        """Stop running a job this worker no longer owns; write nothing more for it."""
        log.warning("job %s dropped (%s): %d result(s) not written", state.job_id, why,
                    len(self._unwritten.pop(state.job_id, {})))
        if self.scheduler.jobs.get(state.job_id) is state:
            del self.scheduler.jobs[state.job_id]
        self.lifecycle.drop(state, why)

    # --- flush ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Write held results, one atomic script per job: all of a job's new results and
        events land together or not at all, and only while the job is still ours.
        Transient Redis errors propagate (the results stay held); any other error fails
        only the job whose keys refused the write."""
        for job_id in list(self._unwritten):
            results = self._unwritten[job_id]
            state = self.scheduler.jobs.get(job_id)
            if state is None:
                del self._unwritten[job_id]
                continue
            args: list[str | int] = [state.token, result_ttl(state), R.EVENTS_MAXLEN]
            for res in results.values():
                args += [res.index, json.dumps(res.to_dict()), int(res.ok)]
            try:
                owned = self._write_items(
                    keys=[state.job.key, self.keys.job_owner(job_id),
                          self.keys.job_items(job_id), self.keys.job_events(job_id)],
                    args=args)
            except RedisError as exc:
                if transient(exc):
                    raise
                del self._unwritten[job_id]
                self.fail(state, f"cannot write this job's results: {exc}")
                continue
            if not owned:
                self.drop(state, self._why_lost(state))
                continue
            del self._unwritten[job_id]
            for res in results.values():
                self.stats.count_item(res)
            state.finished_here += len(results)
            if self.on_stored is not None:
                self.on_stored(state, list(results.values()))

    def _why_lost(self, state: Running) -> str:
        lost = self.lifecycle.lost([state])
        return lost[0][1] if lost else "ownership changed during the write"

    # --- end -----------------------------------------------------------------------------

    def finish_complete(self) -> None:
        """End every job whose items have all come back and been written."""
        for state in [s for s in self.scheduler.jobs.values()
                      if s.complete and s.job_id not in self._unwritten]:
            self.finish(state)

    def finish(self, state: Running) -> None:
        """End a job whose items all came back: finished, but only once every item has a
        stored result. Items whose results vanished (an evicted or lost items hash) are
        missing, not done: they are scheduled again and the job ends later."""
        stored = {r.index: r for r in R.read_items(self.redis, self.keys, state.job_id)
                  if r.index < state.total}
        missing = [i for i in range(state.total) if i not in stored]
        if missing:
            why = self._why_lost(state) if not self.lifecycle.is_ours(state) else None
            if why is not None:
                self.drop(state, why)
                return
            log.warning("job %s: %d item result(s) vanished from Redis (%s); computing "
                        "them again", state.job_id, len(missing), _span(missing))
            state.finished_here -= min(state.finished_here, len(missing))
            self.scheduler.redo(state.job_id, missing)
            return
        results = list(stored.values())
        summary = JobSummary(
            items=state.total,
            ok=sum(1 for r in results if r.ok),
            failed=sum(1 for r in results if not r.ok),
            prompt_tokens=sum(r.prompt_tokens for r in results),
            completion_tokens=sum(r.completion_tokens for r in results),
            wall_s=self._whole_job_wall_s(state),
            cache_hits=sum(1 for r in results if r.vision_cache_hit),
            labels=dict(state.payload.labels),
            result_cache_hits=sum(1 for r in results if r.result_cache_hit),
        )
        why = self.lifecycle.succeed(state, summary.to_dict(), require_items=True)
        if why == INCOMPLETE:
            return  # results vanished since they were read: the next turn finds which
        if why is not None:
            self.drop(state, why)
            return
        self.scheduler.remove(state.job_id)
        log.info("job %s finished: %d ok, %d failed, %d tokens, %.1f s, %d cache hits",
                 state.job_id, summary.ok, summary.failed, summary.completion_tokens,
                 summary.wall_s, summary.cache_hits)

    def _whole_job_wall_s(self, state: Running) -> float:
        """From the job's first start on any worker: a resumed job's summary covers the
        whole job, not only this worker's share (which is the fallback)."""
        first = self.redis.hget(Keys.rq_job(state.job_id), C.FIRST_STARTED_FIELD)
        wall = _wall_since(first)
        return wall if wall is not None else round(time.monotonic() - state.started, 3)

    def fail(self, state: Running, message: str) -> None:
        """Fail a job (bad payload, timeout, unwritable results); its held results go."""
        self._unwritten.pop(state.job_id, None)
        self.scheduler.jobs.pop(state.job_id, None)
        why = self.lifecycle.fail(state, message)
        if why is not None:
            log.warning("job %s dropped (%s) instead of failing it: %s", state.job_id, why,
                        message)
            self.lifecycle.drop(state, why)
            return
        log.info("job %s failed: %s", state.job_id, message)


def _wall_since(first_started: bytes | str | None) -> float | None:
    """Seconds since the epoch time a job first started, or None if unreadable."""
    try:
        first = float(first_started.decode() if isinstance(first_started, bytes)
                      else first_started or "")
    except ValueError:
        return None
    return round(max(0.0, time.time() - first), 3)


def _span(indexes: list[int]) -> str:
    shown = ", ".join(str(i) for i in indexes[:10])
    return f"items {shown}" + (f" +{len(indexes) - 10} more" if len(indexes) > 10 else "")
