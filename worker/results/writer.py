"""Writing a job's results: item results as they come back, then the job's end.

The worker's main thread records each item that comes back (from the engine or a failed
preparation), writes what it holds once per loop turn (one transaction per job), and
ends a job once every item has a stored result. Results wait in memory while Redis is
unreachable, and are written when it is back.

Fencing: every write here is applied only while this worker's execution still owns the
job (Keys.job_owner), checked atomically with the write: item results by one Lua script
(shared/write_items.lua), the job's end by worker/jobs/job_end.py's WATCH transaction. A worker
that stalled past its heartbeat TTL, and whose job another worker took meanwhile, writes
nothing more for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from redis import Redis
from redis.exceptions import RedisError

from vlmq.shared import constants as C
from vlmq.shared import lua
from vlmq.shared.connection import transient
from vlmq.shared.keys import Keys
from vlmq.shared.logs import job_fields
from vlmq.shared.messages import TEXT_FROM_LAYER, ItemResult, JobSummary
from vlmq.shared.results import read_items
from vlmq.worker.engine.batcher import Finished
from vlmq.worker.item_order import ItemOrder, Tally
from vlmq.worker.jobs.rq_jobs import INCOMPLETE, JobLifecycle, Running
from vlmq.worker.stats import WorkerStats

log = logging.getLogger("vlmq.worker")
# Finish reasons of an answer cut before the model ended it.
CUT = ("length", "repetition")


def finished_result(state: Running, idx: int, f: Finished, prep_s: float,
                    layer: str | None = None) -> ItemResult:
    """The engine's output for an item; with `layer` (the model failed a PDF page and the
    job falls back to its text layer) the layer's text, the model's failure kept beside."""
    item = state.payload.items[idx]
    timings = dict(f.timings)
    timings["preprocess_s"] = round(prep_s, 4)
    res = ItemResult(
        index=idx, source=item.source, page=item.page,
        text=None if f.error else f.text, finish_reason=f.finish_reason,
        prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
        vision_cache_hit=f.vision_cache_hit, error=f.error, timings=timings,
        custom_id=item.custom_id, repetition=f.repetition,
        json=None if f.error else f.json, prefix_tokens=f.prefix_tokens,
        # What a cut answer (an extract's JSON at max_tokens) held: never `text`, which
        # a failed item has none of; the OpenAI output shows it with finish_reason length.
        model_text=(f.text or None) if f.error and f.finish_reason in CUT else None)
    return res if layer is None else _from_layer(res, layer)


def failed_result(state: Running, idx: int, message: str,
                  layer: str | None = None) -> ItemResult:
    item = state.payload.items[idx]
    res = ItemResult(
        index=idx, source=item.source, page=item.page, text=None, finish_reason="error",
        prompt_tokens=0, completion_tokens=0, vision_cache_hit=False, error=message,
        timings={}, custom_id=item.custom_id)
    return res if layer is None else _from_layer(res, layer)


def layer_result(state: Running, idx: int, text: str, prep_s: float) -> ItemResult:
    """A page read from its text layer alone (text_layer prefer): no model, no tokens."""
    item = state.payload.items[idx]
    return ItemResult(
        index=idx, source=item.source, page=item.page, text=text, finish_reason="stop",
        prompt_tokens=0, completion_tokens=0, vision_cache_hit=False, error=None,
        timings={"preprocess_s": round(prep_s, 4)}, custom_id=item.custom_id,
        text_source=TEXT_FROM_LAYER)


def _from_layer(res: ItemResult, layer: str) -> ItemResult:
    """The failed `res` answered by the page's text layer: ok, the failure kept visible
    (finish_reason, repetition, model_error, model_text)."""
    return replace(res, text=layer, error=None, text_source=TEXT_FROM_LAYER,
                   model_error=res.error, model_text=res.text or res.model_text)


def result_ttl(running: Running) -> int:
    """Item results live as long as the job's own result (RQ's result_ttl)."""
    ttl = running.job.result_ttl
    return ttl if ttl is not None and ttl > 0 else C.RESULT_TTL_S


class ResultWriter:
    """Holds item results until they are stored, and ends jobs once every item is."""

    def __init__(self, redis: Redis, keys: Keys, lifecycle: JobLifecycle,
                 order: ItemOrder[Running], stats: WorkerStats, *,
                 on_stored: Callable[[list[tuple[Running, list[ItemResult]]]], None] | None
                 = None, on_failed: Callable[[Running, str], None] | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.lifecycle = lifecycle
        self.order = order
        self.stats = stats
        # Runs once per flush with the jobs whose results were stored (the result cache).
        self.on_stored = on_stored
        # Runs with each job failed here and why (an interactive job's token stream ends).
        self.on_failed = on_failed
        self._unwritten: dict[str, dict[int, ItemResult]] = {}
        self._write_items = lua.script(redis, lua.WRITE_ITEMS)

    @property
    def holding(self) -> int:
        """Results recorded but not yet stored."""
        return sum(len(r) for r in self._unwritten.values())

    # --- record --------------------------------------------------------------------------

    def record_finished(self, job_id: str, idx: int, f: Finished, prep_s: float, *,
                        layer: str | None = None) -> bool:
        state = self.order.item_returned(job_id, idx)
        if state is None:
            return False  # the job was dropped meanwhile, or this item came back already
        self._unwritten.setdefault(job_id, {})[idx] = finished_result(state, idx, f, prep_s,
                                                                      layer)
        return True

    def record_failure(self, job_id: str, idx: int, message: str, *,
                       layer: str | None = None) -> bool:
        state = self.order.item_returned(job_id, idx)
        if state is None:
            return False
        self._unwritten.setdefault(job_id, {})[idx] = failed_result(state, idx, message,
                                                                    layer)
        return True

    def record_layer(self, job_id: str, idx: int, text: str, prep_s: float) -> bool:
        state = self.order.item_returned(job_id, idx)
        if state is None:
            return False
        self._unwritten.setdefault(job_id, {})[idx] = layer_result(state, idx, text, prep_s)
        return True

    def hold(self, job_id: str, results: Iterable[ItemResult]) -> None:
        """Results ready without any work (result-cache hits): written like the others."""
        for res in results:
            self._unwritten.setdefault(job_id, {})[res.index] = res

    def drop(self, state: Running, why: str) -> None:
        """Stop running a job this worker no longer owns; write nothing more for it."""
        log.warning("job %s dropped (%s): %d result(s) not written", state.job_id, why,
                    len(self._unwritten.pop(state.job_id, {})), extra=job_fields(state.job_id))
        if self.order.jobs.get(state.job_id) is state:
            del self.order.jobs[state.job_id]
        self.lifecycle.drop(state, why)

    # --- flush ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Write held results, one atomic script per job (all of a job's new results and
        events land together or not at all, and only while the job is still ours), every
        job's script in one pipeline. Transient Redis errors propagate (the results stay
        held); any other error fails only the job whose keys refused the write."""
        batch: list[tuple[Running, dict[int, ItemResult]]] = []
        for job_id in list(self._unwritten):
            state = self.order.jobs.get(job_id)
            if state is None:
                del self._unwritten[job_id]
                continue
            batch.append((state, self._unwritten[job_id]))
        if not batch:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for state, results in batch:
                args: list[str | int] = [state.token, result_ttl(state), C.EVENTS_MAXLEN]
                for res in results.values():
                    args += [res.index, res.to_json(), int(res.ok)]
                self._write_items(keys=[state.job.key, self.keys.job_owner(state.job_id),
                                        self.keys.job_items(state.job_id),
                                        self.keys.job_events(state.job_id)],
                                  args=args, client=pipe)
            replies = pipe.execute(raise_on_error=False)
        stored: list[tuple[Running, list[ItemResult]]] = []
        for (state, results), owned in zip(batch, replies, strict=True):
            if isinstance(owned, RedisError):
                if transient(owned):
                    raise owned
                del self._unwritten[state.job_id]
                self.fail(state, f"cannot write this job's results: {owned}")
                continue
            if not owned:
                self.drop(state, self._why_lost(state))
                continue
            del self._unwritten[state.job_id]
            for res in results.values():
                self.stats.count_item(res, state.payload.task)
                state.written[res.index] = _tally(res)
                log.debug("job %s item %d written: %s, %d tokens", state.job_id, res.index,
                          res.error or res.finish_reason, res.completion_tokens,
                          extra=job_fields(state.job_id, res.index))
            state.finished_here += len(results)
            stored.append((state, list(results.values())))
        if stored and self.on_stored is not None:
            self.on_stored(stored)

    def _why_lost(self, state: Running) -> str:
        lost = self.lifecycle.lost([state])
        return lost[0][1] if lost else "ownership changed during the write"

    # --- end -----------------------------------------------------------------------------

    def finish_complete(self) -> None:
        """End every job whose items have all come back and been written.

        A job whose every item this execution wrote (the common case) is summed from what
        the worker wrote, and ends with the others in one fenced transaction that checks
        every item is still stored; the others (resumed jobs, or results that vanished)
        read their items back first."""
        done = [s for s in self.order.jobs.values()
                if s.complete and s.job_id not in self._unwritten]
        known = [s for s in done if s.already_done == 0 and not s.verify
                 and len(s.written) == s.total]
        for state in done:
            if not any(state is k for k in known):
                self.finish(state)
        if known:
            self._end([(s, self._summary(s, s.written.values())) for s in known],
                      from_memory=True)

    def finish(self, state: Running) -> None:
        """End a job whose items all came back: finished, but only once every item has a
        stored result. Items whose results vanished (an evicted or lost items hash) are
        missing, not done: they are scheduled again and the job ends later."""
        stored = {r.index: r for r in read_items(self.redis, self.keys, state.job_id)
                  if r.index < state.total}
        missing = [i for i in range(state.total) if i not in stored]
        if missing:
            why = self._why_lost(state) if not self.lifecycle.is_ours(state) else None
            if why is not None:
                self.drop(state, why)
                return
            log.warning("job %s: %d item result(s) vanished from Redis (%s); computing "
                        "them again", state.job_id, len(missing), _span(missing),
                        extra=job_fields(state.job_id))
            state.finished_here -= min(state.finished_here, len(missing))
            for i in missing:
                state.written.pop(i, None)
            self.order.redo(state.job_id, missing)
            return
        state.verify = False
        self._end([(state, self._summary(state, (_tally(r) for r in stored.values())))],
                  from_memory=False)

    def _summary(self, state: Running, tallies: Iterable[Tally]) -> JobSummary:
        ok = failed = prompt = completion = hits = cached = prefix_hits = skipped = 0
        sources: dict[str, int] = {}
        for t in tallies:
            if t.text_source is not None:
                sources[t.text_source] = sources.get(t.text_source, 0) + 1
            ok += t.ok
            failed += not t.ok
            prompt += t.prompt_tokens
            completion += t.completion_tokens
            hits += t.vision_cache_hit
            cached += t.result_cache_hit
            prefix_hits += t.prefix_tokens > 0
            skipped += t.prefix_tokens
        return JobSummary(items=state.total, ok=ok, failed=failed, prompt_tokens=prompt,
                          completion_tokens=completion, wall_s=self._whole_job_wall_s(state),
                          cache_hits=hits, labels=dict(state.payload.labels),
                          result_cache_hits=cached, text_sources=sources,
                          prefix_hits=prefix_hits, prefix_tokens_skipped=skipped)

    def _end(self, ends: list[tuple[Running, JobSummary]], *, from_memory: bool) -> None:
        whys = self.lifecycle.succeed_many([(s, summary.to_dict()) for s, summary in ends],
                                           require_items=True)
        for (state, summary), why in zip(ends, whys, strict=True):
            if why == INCOMPLETE:
                # Results vanished since they were written or read: read them back now
                # (if they were summed from memory) or next turn, to find which.
                state.verify = True
                if from_memory:
                    self.finish(state)
                continue
            if why is not None:
                self.drop(state, why)
                continue
            self.order.remove(state.job_id)
            self.stats.count_job(state.queue.name, "finished")
            layers = summary.text_sources.get(TEXT_FROM_LAYER, 0)
            log.info("job %s finished: %d ok, %d failed, %d tokens, %.1f s, %d vision-cache "
                     "hits, %d result-cache hits%s", state.job_id, summary.ok, summary.failed,
                     summary.completion_tokens, summary.wall_s, summary.cache_hits,
                     summary.result_cache_hits,
                     f", {layers} from text layers" if layers else "",
                     extra=job_fields(state.job_id))

    def _whole_job_wall_s(self, state: Running) -> float:
        """From the job's first start on any worker (Redis's clock): a resumed job's
        summary covers the whole job, not only this worker's share (the fallback)."""
        if state.first_started is not None:
            return round(max(0.0, self.lifecycle.clock.now() - state.first_started), 3)
        return round(time.monotonic() - state.started, 3)

    def fail(self, state: Running, message: str) -> None:
        """Fail a job (bad payload, timeout, unwritable results); its held results go."""
        self._unwritten.pop(state.job_id, None)
        self.order.jobs.pop(state.job_id, None)
        why = self.lifecycle.fail(state, message)
        if why is not None:
            log.warning("job %s dropped (%s) instead of failing it: %s", state.job_id, why,
                        message, extra=job_fields(state.job_id))
            self.lifecycle.drop(state, why)
            return
        self.stats.count_job(state.queue.name, "failed")
        log.info("job %s failed: %s", state.job_id, message, extra=job_fields(state.job_id))
        if self.on_failed is not None:
            self.on_failed(state, message)


def _tally(res: ItemResult) -> Tally:
    return Tally(res.ok, res.prompt_tokens, res.completion_tokens, res.vision_cache_hit,
                 res.result_cache_hit, None if res.text is None else res.text_source,
                 res.prefix_tokens)


def _span(indexes: list[int]) -> str:
    shown = ", ".join(str(i) for i in indexes[:10])
    return f"items {shown}" + (f" +{len(indexes) - 10} more" if len(indexes) > 10 else "")
