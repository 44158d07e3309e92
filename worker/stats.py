"""Live worker stats, published to Redis for `vlmq status` and logged as throughput lines."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from redis import Redis
from redis.typing import EncodableT, FieldT

from vlmq.shared import fair
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult

log = logging.getLogger("vlmq.worker")


class Counters:
    """Thread-safe work counters, so the worker and tests can prove a cache hit did no work.

    Prep increments them (decode, the render pool and its child) and the stats read them:
    they live here, below prep, so that reading them never imports a phase.
    """

    NAMES = ("image_decodes", "pdf_renders", "pdf_opens", "text_extracts")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = dict.fromkeys(self.NAMES, 0)

    def incr(self, name: str) -> None:
        with self._lock:
            self._n[name] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)

    def reset(self) -> None:
        with self._lock:
            self._n = dict.fromkeys(self.NAMES, 0)


COUNTERS = Counters()

RATE_WINDOW_S = 30.0
LOG_EVERY_S = 10.0
# What worker/prep/render_pool.py says of a page its render process could not finish: its
# memory limit, a crash, or (RENDER_TIMED_OUT) its time limit. Counted from item errors.
RENDER_FAILED = "too complex to render"
RENDER_TIMED_OUT = "render time limit"
JOB_EVENTS = ("taken", "refused", "finished", "failed", "requeued")
# How an interactive request ended (shared/chat.py FINISH_REASONS: its End entry's).
INTERACTIVE_ENDS = ("stop", "length", "cancelled", "error")


class _EngineView(Protocol):
    """What the stats read of the engine's shared state (worker/engine/batcher.EngineState)."""

    @property
    def active(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def tower_calls(self) -> int: ...
    @property
    def peak_waiting(self) -> int: ...
    @property
    def busy_s(self) -> float: ...
    @property
    def prefill_turn_s(self) -> float: ...
    @property
    def decode_turn_rows(self) -> int: ...
    @property
    def decode_turns(self) -> int: ...
    @property
    def repetitions(self) -> int: ...
    @property
    def isolations(self) -> int: ...
    @property
    def deferrals(self) -> int: ...
    @property
    def kv_in_flight(self) -> int: ...
    @property
    def kv_budget(self) -> int: ...
    @property
    def batch_limit(self) -> int: ...
    @property
    def batch_reason(self) -> str: ...
    @property
    def prefix_hits(self) -> int: ...
    @property
    def prefix_tokens_skipped(self) -> int: ...
    @property
    def prefill_tokens(self) -> int: ...
    @property
    def prefix_bytes(self) -> int: ...
    @property
    def interactive_admitted(self) -> int: ...
    @property
    def bulk_rows_delayed(self) -> int: ...
    @property
    def cancelled(self) -> int: ...


class _CacheView(Protocol):
    def stats(self) -> dict[str, int]: ...


class _RenderView(Protocol):
    """What the stats read of the PDF render pool (worker/prep/render_pool.RenderPool)."""

    @property
    def pids(self) -> list[int]: ...


class WorkerStats:
    def __init__(self, name: str, max_batch: int, window: int | None) -> None:
        """`max_batch`: the cap; `window`: the prep window, None when it follows the
        batch limit (twice it)."""
        self.name = name
        self.max_batch = max_batch
        self.window = window
        self.model = ""
        self.blas = ""          # what serves MLX's matmuls, as logged at start
        self.blas_library = ""  # the library file vlmq loaded for it; "" when none
        self.started = time.monotonic()
        self.items_ok = 0
        self.items_failed = 0
        self.tokens = 0
        self.peak_waiting = 0
        self.result_cache_hits = 0
        self.result_cache_stores = 0
        self.result_cache_misses = 0  # items looked up and not found
        self.renders: _RenderView | None = None  # set once the render processes are up
        # Set as the worker starts, for the metrics thread to read (never to call MLX).
        self.model_type = ""
        self.engine: _EngineView | None = None
        self.cache: _CacheView | None = None
        # Totals the metrics thread reads (worker/metrics.py): guarded by _lock, since a
        # new label value adds a key while a scrape copies the dict.
        self._lock = threading.Lock()
        # (task, ok|failed, finish_reason) -> items
        self._items: dict[tuple[str, str, str], int] = {}
        self._tokens: dict[tuple[str, str], int] = {}  # (task, prompt|generated) -> tokens
        self._phase_s: dict[str, float] = {}  # timing name (queue_s...) -> seconds
        self._jobs: dict[tuple[str, str], int] = {}  # (queue, JOB_EVENTS) -> jobs
        self.render_failures = 0
        self.render_timeouts = 0
        # Called with each stored item result and its job's task (the metrics' histograms),
        # and with each job taken and how long it waited in its queue.
        self.on_item: Callable[[ItemResult, str], None] | None = None
        self.on_wait: Callable[[str, float], None] | None = None
        # Interactive requests answered, by how they ended; and the histograms' hook,
        # called with ("ttft", seconds from the job's take to its first token) and
        # ("tokens_per_s", its decode rate).
        self._interactive: dict[str, int] = {}
        self.on_interactive: Callable[[str, float], None] | None = None
        self._first_token_seen: set[str] = set()
        # The jobs in hand by batch (shared/fair.py), replaced whole at each publish: the
        # metrics thread reads whichever list is current.
        self.shares: list[fair.Share] = []
        self._samples: deque[tuple[float, int, int]] = deque()
        # Preprocessing counters are process-wide; report this worker's share only.
        self._work_base = COUNTERS.snapshot()
        self._next_log = time.monotonic() + LOG_EVERY_S

    def count_item(self, result: ItemResult, task: str = "") -> None:
        """One stored item result (the one hook the result writer calls)."""
        if result.ok:
            self.items_ok += 1
        else:
            self.items_failed += 1
        error = result.error or result.model_error or ""
        if RENDER_FAILED in error:
            self.render_failures += 1
            self.render_timeouts += RENDER_TIMED_OUT in error
        with self._lock:
            key = (task, "ok" if result.ok else "failed", result.finish_reason or "none")
            self._items[key] = self._items.get(key, 0) + 1
            if not result.result_cache_hit:
                for kind, n in (("prompt", result.prompt_tokens),
                                ("generated", result.completion_tokens)):
                    self._tokens[task, kind] = self._tokens.get((task, kind), 0) + n
                for name, seconds in result.timings.items():
                    self._phase_s[name] = self._phase_s.get(name, 0.0) + seconds
        if self.on_item is not None:
            self.on_item(result, task)
        if result.result_cache_hit:
            self.result_cache_hits += 1  # nothing was generated: no tokens to count
            return
        self.tokens += result.completion_tokens

    def count_job(self, queue: str, event: str, *, waited_s: float | None = None) -> None:
        """A job taken, refused, finished, failed or requeued here (JOB_EVENTS); a taken
        job with the seconds it waited in its queue."""
        with self._lock:
            self._jobs[queue, event] = self._jobs.get((queue, event), 0) + 1
        if waited_s is not None and self.on_wait is not None:
            self.on_wait(queue, waited_s)

    def first_token(self, job_id: str, seconds: float) -> None:
        """An interactive job's first text went out, `seconds` after it was taken."""
        if job_id in self._first_token_seen:
            return
        self._first_token_seen.add(job_id)
        if self.on_interactive is not None:
            self.on_interactive("ttft", seconds)

    def interactive_done(self, job_id: str, end: str, *, first_token_s: float | None = None,
                         tokens: int = 0, generate_s: float = 0.0) -> None:
        """An interactive request ended (`end`: INTERACTIVE_ENDS); `first_token_s` counts
        when no streamed text said it earlier."""
        with self._lock:
            self._interactive[end] = self._interactive.get(end, 0) + 1
        if first_token_s is not None:
            self.first_token(job_id, first_token_s)
        self._first_token_seen.discard(job_id)
        if self.on_interactive is not None and tokens > 0 and generate_s > 0:
            self.on_interactive("tokens_per_s", tokens / generate_s)

    def interactive_totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._interactive)

    def totals(self) -> tuple[dict[tuple[str, str, str], int], dict[tuple[str, str], int],
                              dict[str, float], dict[tuple[str, str], int]]:
        """Copies of the labelled totals: items, tokens, seconds by phase, jobs."""
        with self._lock:
            return dict(self._items), dict(self._tokens), dict(self._phase_s), dict(self._jobs)

    def work_counts(self) -> dict[str, int]:
        """This worker's preprocessing counters (image decodes, PDF renders, ...)."""
        return {k: v - self._work_base.get(k, 0) for k, v in COUNTERS.snapshot().items()}

    def observe_waiting(self, n: int) -> None:
        self.peak_waiting = max(self.peak_waiting, n)

    def _rates(self, now: float) -> tuple[float, float]:
        items = self.items_ok + self.items_failed
        self._samples.append((now, self.tokens, items))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        t0, tok0, it0 = self._samples[0]
        dt = now - t0
        if dt <= 0:
            return 0.0, 0.0
        return (self.tokens - tok0) / dt, (items - it0) / dt

    def publish(self, redis: Redis, keys: Keys, engine: _EngineView, cache: _CacheView,
                jobs: int, in_prep: int, ttl_s: int = 30) -> dict[FieldT, EncodableT]:
        now = time.monotonic()
        tok_s, items_s = self._rates(now)
        cs = cache.stats()
        lookups = cs.get("hits", 0) + cs.get("misses", 0)
        hit_rate = cs.get("hits", 0) / lookups if lookups else 0.0
        fields = {
            "model": self.model,
            "blas": self.blas,
            "blas_library": self.blas_library,
            "jobs_in_flight": jobs,
            "in_flight": engine.active + engine.waiting + in_prep,
            "batch_active": engine.active,
            "batch_occupancy": round(engine.active / max(1, engine.batch_limit), 3),
            "batch_limit": engine.batch_limit,
            "batch_cap": self.max_batch,
            "batch_reason": engine.batch_reason,
            "waiting": engine.waiting + in_prep,
            "peak_waiting": self.peak_waiting,
            "window": self.window or 2 * engine.batch_limit,
            "tokens_per_s": round(tok_s, 1),
            "items_per_s": round(items_s, 3),
            "items_ok": self.items_ok,
            "items_failed": self.items_failed,
            "tokens": self.tokens,
            "cache_hits": cs.get("hits", 0),
            "cache_misses": cs.get("misses", 0),
            "cache_hit_rate": round(hit_rate, 3),
            "cache_mem_bytes": cs.get("mem_bytes", 0),
            "cache_disk_bytes": cs.get("disk_bytes", 0),
            "result_cache_hits": self.result_cache_hits,
            "result_cache_stores": self.result_cache_stores,
            "engine_peak_waiting": engine.peak_waiting,
            "tower_calls": engine.tower_calls,
            # Prefix reuse (worker/engine/prefix_cache.py)
            "prefix_hits": engine.prefix_hits,
            "prefix_tokens_skipped": engine.prefix_tokens_skipped,
            "prefill_tokens": engine.prefill_tokens,
            "prefix_bytes": engine.prefix_bytes,
            "mlx_busy_s": round(engine.busy_s, 3),
            "mlx_prefill_turn_s": round(engine.prefill_turn_s, 3),
            "decode_turn_rows": engine.decode_turn_rows,
            "decode_turns": engine.decode_turns,
            # Interactive requests (shared/chat.py): answered here, and bulk rows that
            # waited while one took a row.
            "interactive_requests": sum(self.interactive_totals().values()),
            "bulk_rows_delayed": engine.bulk_rows_delayed,
            # PDF render processes running (started before the worker says it is ready).
            "render_procs": len(self.renders.pids) if self.renders is not None else 0,
            # The batches of the jobs in hand, with their jobs and items left.
            "shares": fair.shares_json(self.shares),
            **self.work_counts(),
            "uptime_s": round(now - self.started, 1),
        }
        out: dict[FieldT, EncodableT] = {k: str(v) for k, v in fields.items()}
        pipe = redis.pipeline(transaction=False)
        pipe.hset(keys.worker_stats(self.name), mapping=out)
        pipe.expire(keys.worker_stats(self.name), ttl_s)
        pipe.sadd(keys.workers, self.name)
        pipe.execute()
        if now >= self._next_log and (engine.active or tok_s):
            log.info("throughput: %.1f tok/s, %.2f items/s, batch %d/%d, cache hit rate %.0f%%",
                     tok_s, items_s, engine.active, engine.batch_limit, 100 * hit_rate)
            self._next_log = now + LOG_EVERY_S
        return out

    def retire(self, redis: Redis, keys: Keys) -> None:
        """Leave the set of live workers; the last stats stay readable until they expire."""
        redis.srem(keys.workers, self.name)
