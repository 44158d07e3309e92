"""The worker's main loop: pull jobs, feed the batcher, write results, stop cleanly.

Threads: this (main) thread owns Redis and RQ bookkeeping; a small CPU pool fetches,
decodes, renders and tokenizes; the engine's thread owns every MLX call. The main
thread never touches MLX and the MLX thread never touches Redis. With --metrics-port, an
HTTP thread (worker/metrics.py) reads counters, and touches neither.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from queue import Empty, SimpleQueue
from types import FrameType
from typing import TypeVar, cast

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue
from rq.serializers import JSONSerializer
from rq.worker import WorkerStatus

from vlmq.shared import redis_checks
from vlmq.shared.connection import connect, transient
from vlmq.shared.keys import Keys
from vlmq.shared.schema import ItemResult
from vlmq.shared.stores import Stores
from vlmq.shared.urls import redact_url
from vlmq.worker import blas
from vlmq.worker.engine import Engine, EngineError, Finished
from vlmq.worker.metrics import MetricsError, WorkerMetrics
from vlmq.worker.mlx_adapter import family_of
from vlmq.worker.poison import DEFAULT_POISON_KILLS, RiskLog
from vlmq.worker.prepare import FromLayer, Prepared, Preparer, PrepError
from vlmq.worker.render_pool import DEFAULT_MEM_MB as DEFAULT_RENDER_MEM_MB
from vlmq.worker.render_pool import DEFAULT_TIMEOUT_S as DEFAULT_RENDER_TIMEOUT_S
from vlmq.worker.render_pool import RenderPool
from vlmq.worker.repetition import RepetitionGuard
from vlmq.worker.result_cache import (
    DEFAULT_MAX_BYTES,
    DEFAULT_TTL_S,
    ResultCache,
    cached_results_many,
    store_results_many,
)
from vlmq.worker.results_writer import ResultWriter
from vlmq.worker.rq_jobs import BatchWorker, JobLifecycle, Refused, Running
from vlmq.worker.scheduler import Scheduler
from vlmq.worker.stats import WorkerStats
from vlmq.worker.vision_cache import VisionCache

log = logging.getLogger("vlmq.worker")

REDIS_RETRY_S = 1.0
# An idle worker on one queue waits for a job in a blocking BLMOVE this long at most (a
# stop signal is seen when it returns; Redis times blocked commands in 0.1 s steps).
IDLE_BLOCK_S = 0.5
# An idle worker on several queues looks at them all this often (no blocking pop keeps
# both their priority order and RQ's intermediate list).
IDLE_POLL_S = 0.01
# Ends of a model run that leave a page unread: a text layer may stand in (text_layer).
MODEL_FAILED = ("length", "repetition", "error")
STOP_DUMP_AFTER_S = 10.0
RESTART_CHECK_S = 0.5  # how often the loop compares Redis's run_id with the one at start
T = TypeVar("T")


class StartupError(Exception):
    """The worker cannot start; the message says why (no traceback needed)."""


@dataclass
class WorkerConfig:
    redis_url: str
    model: str
    queues: list[str]
    burst: bool = False
    max_batch: int = 8
    cache_dir: Path | None = None
    cache_mem_bytes: int = 1024 * 1024 * 1024
    cache_disk_bytes: int = 10 * 1024**3
    name: str = "vlmq-worker"
    grace_s: float = 30.0
    prep_threads: int = 2
    window: int | None = None      # prepared-but-not-batched bound; default 2 x max_batch
    max_jobs: int | None = None    # jobs in flight; default max(4, max_batch)
    stats_s: float = 2.0
    heartbeat_ttl: int | None = None  # None: RQ's job monitoring interval + 60 s
    result_cache_ttl_s: int = DEFAULT_TTL_S
    result_cache_bytes: int = DEFAULT_MAX_BYTES  # 0 turns the shared result cache off
    render_procs: int | None = None  # PDF render processes; default prep_threads
    render_mem_mb: int = DEFAULT_RENDER_MEM_MB
    render_timeout_s: float = DEFAULT_RENDER_TIMEOUT_S
    max_kv_tokens: int | None = None  # None: derived from the model and machine memory
    poison_kills: int = DEFAULT_POISON_KILLS  # worker deaths a job may cause before it fails
    blas: str | None = None  # auto | reference | a library path; None: $VLMQ_BLAS, else auto
    allow_eviction: bool | None = None  # None: $VLMQ_ALLOW_EVICTION
    metrics_port: int = 0  # Prometheus /metrics (worker/metrics.py); 0: not served
    metrics_host: str = "127.0.0.1"
    # The stores referenced items are read from (machine configuration, --store).
    stores: Stores = field(default_factory=Stores)
    keys: Keys = field(default_factory=Keys.from_env)
    repetition: RepetitionGuard | None = field(default_factory=RepetitionGuard)  # None: off

    @property
    def prep_window(self) -> int:
        return self.window or 2 * self.max_batch

    @property
    def job_limit(self) -> int:
        return self.max_jobs or max(4, self.max_batch)


class WorkerService:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.redis = connect(cfg.redis_url)
        self.scheduler: Scheduler[Running] = Scheduler()
        self.stop_requested = False
        self.deadline: float | None = None
        self._in_prep = 0
        # Failed pages whose text layer is being read (text_layer fallback): in flight, but
        # not in the prep window, which bounds what waits for the engine.
        self._in_fallback = 0
        self._prep_lock = threading.Lock()
        self._prep_failed: SimpleQueue[tuple[str, int, str]] = SimpleQueue()
        self._prep_retry: SimpleQueue[tuple[str, int]] = SimpleQueue()
        self._prep_time: dict[tuple[str, int], float] = {}
        # Pages answered by their text layer (prefer), and model failures whose page's text
        # layer was read (fallback): pool threads put them here for the main thread.
        self._from_layer: SimpleQueue[tuple[str, int, str, float]] = SimpleQueue()
        self._fell_back: SimpleQueue[tuple[Callable[..., bool], str | None]] = SimpleQueue()
        self._preparer: Preparer
        self._writer: ResultWriter
        self._results: ResultCache
        self._queues_empty = False
        self._starting: list[Running] = []  # taken, their start cut short by a Redis error
        self._next_heartbeat = self._next_stats = 0.0
        self.stats = WorkerStats(cfg.name, cfg.max_batch, cfg.prep_window)
        self._restarts: redis_checks.RestartWatch | None = None
        self._next_restart_check = 0.0

    # --- signals -------------------------------------------------------------------------

    def request_stop(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop_requested:
            log.warning("second %s: stopping now", signal.Signals(signum).name)
            self.deadline = time.monotonic()
            return
        self.stop_requested = True
        self.deadline = time.monotonic() + self.cfg.grace_s
        # A worker still alive well past its grace says where each thread is (stderr):
        # a stop that hangs is a bug, and this is what finding it needs.
        faulthandler.dump_traceback_later(self.cfg.grace_s + STOP_DUMP_AFTER_S, exit=False)
        log.info("%s: taking no more jobs; finishing in-flight items (grace %.0f s)",
                 signal.Signals(signum).name, self.cfg.grace_s)

    # --- main loop -----------------------------------------------------------------------

    def run(self) -> int:
        cfg = self.cfg
        try:
            chosen = blas.select(cfg.blas, threads=blas.worker_threads(cfg.prep_threads))
        except blas.BlasError as exc:
            log.error("%s", exc)
            return 1
        log.info("BLAS: %s", chosen.describe())
        backends = blas.mlx_backends()
        if len(backends) > 1:
            log.warning("several MLX backends are installed (%s): they overwrite each other's "
                        "libmlx.so; keep one (pip uninstall mlx-cpu for CUDA, then pip "
                        "install --force-reinstall --no-deps mlx-cuda-12)", ", ".join(backends))
        self.stats.blas = chosen.describe()
        self.stats.blas_library = chosen.path or ""
        problem = self._preflight()
        if problem:
            log.error("%s", problem)
            return 1
        metrics = self._serve_metrics()  # before the model load: a busy port fails fast
        if isinstance(metrics, str):
            log.error("%s", metrics)
            return 1
        log.info("loading model %s", cfg.model)
        engine = Engine(cfg.model, max_batch=cfg.max_batch, repetition=cfg.repetition,
                        max_kv_tokens=cfg.max_kv_tokens)
        self.stats.engine = engine.state  # plain counters: the metrics thread reads them
        try:
            return self._serve(engine)
        except StartupError as exc:
            log.error("%s", exc)
            return 1
        finally:
            engine.close(timeout=10)
            if metrics is not None:
                metrics.close()

    def _serve_metrics(self) -> WorkerMetrics | str | None:
        """The /metrics endpoint when asked for (else None), or why it cannot start."""
        cfg = self.cfg
        if not cfg.metrics_port:
            return None
        metrics = WorkerMetrics(self.stats, lambda: (len(self.scheduler), self._in_prep))
        try:
            port = metrics.serve(cfg.metrics_host, cfg.metrics_port)
        except MetricsError as exc:
            return str(exc)
        log.info("metrics: http://%s:%d/metrics", cfg.metrics_host, port)
        return metrics

    def _preflight(self) -> str | None:
        """Problems worth reporting before a model load that can take minutes."""
        try:
            self.redis.ping()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            return f"cannot reach Redis at {redact_url(self.cfg.redis_url)}: {exc}"
        problem = self._check_redis()
        if problem:
            return problem
        key = Keys.rq_worker(self.cfg.name)
        if self.redis.exists(key) and not self.redis.hexists(key, "death"):
            return (f"a worker named {self.cfg.name!r} is already registered in Redis; pick "
                    "another --name (the name of a worker that was killed frees up once its "
                    "heartbeat expires, within 8 minutes)")
        if self.cfg.cache_dir is not None and self.cfg.cache_disk_bytes > 0:
            try:
                self.cfg.cache_dir.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=self.cfg.cache_dir):
                    pass
            except OSError as exc:
                return f"cannot write to cache dir {self.cfg.cache_dir}: {exc}"
        return None

    def _check_redis(self) -> str | None:
        """Eviction refused (unless allowed), persistence warned about, run_id noted."""
        try:
            warning = redis_checks.check_eviction(self.redis, self.cfg.allow_eviction)
        except redis_checks.EvictionRefused as exc:
            return f"refusing to start: {exc}"
        for message in (warning, redis_checks.persistence_warning(self.redis)):
            if message:
                log.warning("%s", message)
        self._restarts = redis_checks.RestartWatch(self.redis)
        return None

    def _watch_restart(self, lifecycle: JobLifecycle, engine: Engine,
                       cache: VisionCache) -> None:
        """A Redis that restarted (run_id changed) may have come back empty: say so for each
        job in flight whose hash is gone, forget those, and register this worker again. A
        Redis restored from AOF or RDB keeps its jobs, and they run on."""
        now = time.monotonic()
        # Every turn while jobs run: a result flushed to the new Redis would be dropped as
        # "deleted" before a slower check said why.
        if self._restarts is None or (not self.scheduler.jobs
                                      and now < self._next_restart_check):
            return
        self._next_restart_check = now + RESTART_CHECK_S
        old = self._restarts.changed()
        if old is None:
            return
        new = self._restarts.run_id
        states = list(self.scheduler.jobs.values())
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
            self._writer.drop(state, "lost with the Redis restart")
        redis_checks.record_restart(self.redis, self.cfg.keys, old, new, self.cfg.name,
                                    [s.job_id for s in lost])
        # The heartbeat may have recreated a partial worker hash: register from scratch.
        self.redis.delete(lifecycle.worker.key)
        lifecycle.register_birth()
        if self.scheduler.jobs:
            lifecycle.worker.set_state(WorkerStatus.BUSY)
        self.stats.publish(self.redis, self.cfg.keys, engine.state, cache,
                           len(self.scheduler), self._in_prep)
        log.info("worker %s registered again after the Redis restart", self.cfg.name)
        problem = self._check_redis()
        if problem:  # the new Redis evicts: stop as a fresh start would refuse to run
            log.error("%s; stopping", problem)
            self.stop_requested = True
            self.deadline = now + self.cfg.grace_s

    def _serve(self, engine: Engine) -> int:
        cfg = self.cfg
        try:
            info = engine.wait_ready()
        except EngineError as exc:
            raise StartupError(str(exc)) from exc
        if not info.cacheable:
            log.warning("vision features of model type %s cannot be cached: "
                        "running every image uncached (%s)", info.model_type,
                        family_of(info.model_type).cache_off)
        disk = cfg.cache_dir if info.cacheable and cfg.cache_disk_bytes > 0 else None
        try:
            cache = VisionCache(cfg.cache_mem_bytes, disk, cfg.cache_disk_bytes)
        except OSError as exc:
            raise StartupError(f"cannot use cache dir {cfg.cache_dir}: {exc}") from exc
        queues = [Queue(q, connection=self.redis, serializer=JSONSerializer) for q in cfg.queues]
        worker = BatchWorker(queues, connection=self.redis, name=cfg.name,
                             heartbeat_ttl=cfg.heartbeat_ttl)
        lifecycle = JobLifecycle(worker, queues, cfg.keys, poison_kills=cfg.poison_kills)
        self._writer = ResultWriter(self.redis, cfg.keys, lifecycle, self.scheduler, self.stats,
                                    on_stored=self._store_in_result_cache)
        try:
            lifecycle.register_birth()
        except ValueError as exc:  # RQ: "There exists an active worker named ..."
            raise StartupError(str(exc)) from exc
        pool = ThreadPoolExecutor(cfg.prep_threads, thread_name_prefix="vlmq-prep")
        renderer = RenderPool(cfg.render_procs or cfg.prep_threads, mem_mb=cfg.render_mem_mb,
                              timeout_s=cfg.render_timeout_s)
        preparer = self._preparer = Preparer(engine, info, cache, self.redis, cfg.keys, pool,
                                             renderer, RiskLog(self.redis, cfg.keys, cfg.name),
                                             stores=cfg.stores)
        self._results = ResultCache(self.redis, cfg.keys, preparer.model_identity,
                                    ttl_s=cfg.result_cache_ttl_s,
                                    max_bytes=cfg.result_cache_bytes)
        self.stats.model = cfg.model
        self.stats.model_type = info.model_type
        self.stats.cache = cache
        try:
            renderer.warm()  # the first PDF page must not wait for a process to start
        except RuntimeError as exc:
            log.warning("%s; PDF pages start their render process when they need one", exc)
        self.stats.renders = renderer
        log.info("worker %s ready: model %s (%s), queues %s, max batch %d, window %d",
                 cfg.name, cfg.model, info.model_type, ",".join(cfg.queues), cfg.max_batch,
                 cfg.prep_window)
        try:
            # Reclaim dead workers' jobs (RQ requeues them while retries are left) before
            # the first look at the queues, so even a --burst worker resumes them.
            lifecycle.maintain()
            self._loop(engine, preparer, lifecycle, cache)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            renderer.close()
            self._shutdown(engine, lifecycle, cache)
        return 0

    def _shutdown(self, engine: Engine, lifecycle: JobLifecycle, cache: VisionCache) -> None:
        """Requeue unfinished jobs (their written items stay) and leave the worker registry."""
        cfg = self.cfg
        try:
            for state in [*self._starting, *self.scheduler.jobs.values()]:
                why = lifecycle.requeue(state)
                if why is None:
                    log.info("job %s requeued with %d/%d items done", state.job_id,
                             state.already_done + state.finished_here, state.total)
                    self.stats.count_job(state.queue.name, "requeued")
                    self.scheduler.jobs.pop(state.job_id, None)
                else:
                    self._writer.drop(state, why)
            self.stats.publish(self.redis, cfg.keys, engine.state, cache, 0, 0)
            self.stats.retire(self.redis, cfg.keys)
            lifecycle.register_death()
        except RedisError as exc:
            if not transient(exc):
                raise
            log.warning("Redis unavailable at shutdown (%s): %d job(s) left STARTED; RQ "
                        "requeues them once this worker's heartbeat expires",
                        exc, len(self.scheduler))
        log.info("worker %s stopped", cfg.name)

    def _loop(self, engine: Engine, preparer: Preparer, lifecycle: JobLifecycle,
              cache: VisionCache) -> None:
        self._queues_empty = False
        self._next_heartbeat = self._next_stats = time.monotonic()
        while True:
            try:
                if self._iterate(engine, preparer, lifecycle, cache):
                    return
            except RedisError as exc:
                if not transient(exc):
                    raise
                # Results stay in memory (the writer holds them) and jobs stay in flight; RQ's
                # registries only need a heartbeat within heartbeat_ttl once Redis is back.
                why = f"{type(exc).__name__}: {exc}"
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    log.warning("Redis unavailable (%s) past the grace period: stopping", why)
                    return
                log.warning("Redis unavailable (%s); retrying in %.0f s", why, REDIS_RETRY_S)
                self._next_restart_check = 0.0  # a restart breaks connections: look first
                time.sleep(REDIS_RETRY_S)

    def _iterate(self, engine: Engine, preparer: Preparer, lifecycle: JobLifecycle,
                 cache: VisionCache) -> bool:
        """One turn of the main loop; True when the worker should stop."""
        cfg = self.cfg
        now = time.monotonic()
        self._watch_restart(lifecycle, engine, cache)
        busy = (self._in_prep > 0 or self._in_fallback > 0 or engine.state.active > 0
                or engine.state.waiting > 0)
        took = 0
        if not self.stop_requested:
            idle = not (busy or self.scheduler.jobs or self._writer.holding or cfg.burst)
            block = IDLE_BLOCK_S if idle and len(cfg.queues) == 1 else 0.0
            took, self._queues_empty = self._pull_jobs(lifecycle, preparer, block_s=block)
            self._schedule(engine, preparer)
        busy = (self._in_prep > 0 or self._in_fallback > 0 or engine.state.active > 0
                or engine.state.waiting > 0)
        if took or self._writer.holding:
            wait = 0.0  # results to write and jobs to end now: no waiting on the engine
        elif busy:
            wait = 0.01
        else:  # idle: the blocking pop waited already; several queues are polled
            wait = 0.0 if len(cfg.queues) == 1 and not cfg.burst else IDLE_POLL_S
        self._collect(engine, lifecycle, timeout=wait)
        if now >= self._next_heartbeat:
            self._heartbeat(lifecycle)
            self._next_heartbeat = now + lifecycle.heartbeat_interval
        if now >= self._next_stats:
            self._drop_taken_away(lifecycle)
            lifecycle.sweep_index()
            self.stats.publish(self.redis, cfg.keys, engine.state, cache, len(self.scheduler),
                               self._in_prep)
            self._next_stats = now + cfg.stats_s
        if self.stop_requested:
            in_flight = (self._in_prep + self._in_fallback + engine.state.active
                         + engine.state.waiting)
            if in_flight == 0:
                self._collect(engine, lifecycle, timeout=0)  # what finished since the last look
                return True
            return self.deadline is not None and now >= self.deadline
        if (cfg.burst and self._queues_empty and not self.scheduler.jobs
                and not self._starting and not self._writer.holding):
            log.info("burst: queues empty and all work done")
            return True
        return False

    def _collect(self, engine: Engine, lifecycle: JobLifecycle, timeout: float) -> None:
        """Write what finished (engine results, prep failures) and finish complete jobs."""
        self._record(engine.get_finished(timeout=timeout), _drain(self._prep_failed))
        for job_id, idx, text, prep_s in _drain(self._from_layer):
            self._writer.record_layer(job_id, idx, text, prep_s)
        for record, layer in _drain(self._fell_back):
            record(layer=layer)
        self._writer.flush()
        self._writer.finish_complete()

    def _pull_jobs(self, lifecycle: JobLifecycle, preparer: Preparer, *,
                   block_s: float = 0.0) -> tuple[int, bool]:
        """Take jobs while there is room, several per round trip; returns how many were
        taken and whether the queues were found empty."""
        if self._starting:  # a Redis error cut their start short: finish it first
            jobs, self._starting = self._starting, []
            self._start_jobs(preparer, jobs)
        room = self.cfg.job_limit - len(self.scheduler)
        if room <= 0:
            return 0, False
        taken, empty = lifecycle.take_many(room, block_s=block_s)
        started: list[Running] = []
        for running in taken:
            if isinstance(running, Refused):
                log.warning("job %s (%s) refused: %s", running.job_id, running.queue,
                            running.reason)
                self.stats.count_job(running.queue, "refused")
            else:
                started.append(running)
                self.stats.count_job(running.queue.name, "taken")
        if started:
            self._start_jobs(preparer, started)
        return len(taken), empty

    def _start_jobs(self, preparer: Preparer, jobs: list[Running]) -> None:
        """Resolve each job's settings, then read what every one needs in one round trip:
        its blobs' lifetimes refreshed (a long wait in the queue must not expire them) and
        the items already done (a resumed job)."""
        ready: list[Running] = []
        for running in jobs:
            try:
                earlier = self.scheduler.jobs.get(running.job_id)
                if earlier is not None:
                    # take() only starts a QUEUED job: it was requeued (by hand, or by RQ's
                    # cleanup after this worker missed its heartbeats), so the earlier
                    # execution is stale.
                    self._writer.drop(earlier, "requeued while running here; its new run "
                                               "resumes")
                settings = preparer.check_job(running.payload)
                if isinstance(settings, str):
                    self._writer.fail(running, settings)
                    continue
                running.settings = settings
                ready.append(running)
            except Exception as exc:  # noqa: BLE001  # handled as one job's failure below
                self._start_failed(running, exc)
        if not ready:
            return
        # Started in Redis but not yet here: a transient error below leaves them for the
        # next turn (and for the requeue at shutdown), not lost until RQ's cleanup.
        self._starting = ready
        with self.redis.pipeline(transaction=False) as pipe:
            for running in ready:
                pipe.hkeys(self.cfg.keys.job_items(running.job_id))
            for running in ready:
                preparer.touch_blobs(running.payload, running.resolved, pipeline=pipe)
            done_of = pipe.execute()[:len(ready)]
        todo_of: list[list[int]] = []
        for running, done_raw in zip(ready, done_of, strict=True):
            n = len(running.payload.items)
            done = {i for i in map(int, done_raw) if i < n}
            running.already_done = len(done)
            todo_of.append([i for i in range(n) if i not in done])
        # A bad reference fails even when its content's text is cached.
        asked = [(running, preparer.readable(running.payload, todo))
                 for running, todo in zip(ready, todo_of, strict=True)]
        hits_of = cached_results_many(self._results, asked)
        self.stats.result_cache_misses += sum(
            len(indexes) - len(hits) for (running, indexes), hits in zip(asked, hits_of,
                                                                         strict=True)
            if self._results.applies(running.resolved))
        self._starting = []
        for running, todo, hits in zip(ready, todo_of, hits_of, strict=True):
            try:
                self._start_job(running, todo, hits)
            except Exception as exc:  # noqa: BLE001  # handled as one job's failure below
                self._start_failed(running, exc)

    def _start_failed(self, running: Running, exc: Exception) -> None:
        """A job that could not start fails alone: never the worker."""
        if isinstance(exc, RedisError):
            if transient(exc):
                raise exc  # the job stays STARTED; RQ reclaims it if we never come back
            log.error("job %s could not be started", running.job_id, exc_info=exc)
            self._writer.fail(running, f"Redis refused a command for this job: {exc}")
            return
        log.error("job %s could not be started", running.job_id, exc_info=exc)
        self._writer.fail(running, f"worker error starting the job: "
                                   f"{type(exc).__name__}: {exc}")

    def _start_job(self, running: Running, todo: list[int],
                   hits: dict[int, ItemResult]) -> None:
        running.pending = deque(i for i in todo if i not in hits)
        done = running.already_done
        log.info("job %s started: %s, %d items%s", running.job_id, running.payload.task,
                 running.total, f" ({done} already done, resuming)" if done else "")
        self.scheduler.add(running)
        self._writer.hold(running.job_id, hits.values())

    def _store_in_result_cache(self, stored: list[tuple[Running, list[ItemResult]]]) -> None:
        """Best effort, once the results count as written (every job's in one go)."""
        self.stats.result_cache_stores += store_results_many(self._results, stored)

    def _drop_taken_away(self, lifecycle: JobLifecycle) -> None:
        """Stop work on jobs canceled, deleted or lost meanwhile, within a stats tick
        (seconds), rather than at the next heartbeat."""
        self._drop(lifecycle.lost(list(self.scheduler.jobs.values())))

    def _drop(self, lost: Iterable[tuple[Running, str]]) -> None:
        for running, why in lost:
            self._writer.drop(running, why)

    def _heartbeat(self, lifecycle: JobLifecycle) -> None:
        """Keep every owned job alive in RQ; drop jobs lost or past their timeout."""
        states = list(self.scheduler.jobs.values())
        self._drop(lifecycle.heartbeat(states))
        if self._preparer.risk is not None:
            self._preparer.risk.flush()  # records a connection reset left behind
        for state in states:
            if state.job_id in self.scheduler.jobs and state.timed_out():
                done = state.already_done + state.finished_here
                self._writer.fail(state, _timeout_message(state, done, state.total))
        lifecycle.maintain()

    def _schedule(self, engine: Engine, preparer: Preparer) -> None:
        """Prepare items while fewer than `window` are prepared-but-not-batched (a small
        job may go max_batch past it: Scheduler.next_item_within)."""
        for job_id, idx in _drain(self._prep_retry):
            self.scheduler.retry_item(job_id, idx)
        window, small = self.cfg.prep_window, self.cfg.max_batch
        while (nxt := self.scheduler.next_item_within(self._in_prep + engine.state.waiting,
                                                      window, small)) is not None:
            state, idx = nxt
            with self._prep_lock:
                self._in_prep += 1
            fut = preparer.submit(state, idx)
            left = len(state.pending) + len(state.outstanding)  # the engine's priority
            fut.add_done_callback(partial(self._prepared, engine, state.job_id, idx, left))
        with self._prep_lock:
            self.stats.observe_waiting(self._in_prep + engine.state.waiting)

    def _prepared(self, engine: Engine, job_id: str, idx: int, left: int,
                  fut: Future[tuple[Prepared, float]]) -> None:
        """Pool callback: hand the request to the engine at once, so MLX never waits on us."""
        moved = False
        try:
            if fut.cancelled():
                return  # shutting down: the item stays unwritten and is redone on resume
            exc = fut.exception()
            if exc is None:
                req, prep_s = fut.result()
                if isinstance(req, FromLayer):
                    self._from_layer.put((job_id, idx, req.text, prep_s))
                    return  # in_prep drops after the put: a stopping loop sees the result
                self._prep_time[(job_id, idx)] = prep_s
                with self._prep_lock:  # from in-prep to waiting in one step, for readers
                    engine.submit(replace(req, priority=left))
                    self._in_prep -= 1
                    moved = True
            elif isinstance(exc, RedisError) and transient(exc):
                self._prep_retry.put((job_id, idx))  # not the item's fault: prepare it again
            elif isinstance(exc, PrepError):
                self._prep_failed.put((job_id, idx, str(exc)))
            else:  # a bug, not bad input: keep the traceback, fail only this item
                log.error("job %s item %d: preparation failed", job_id, idx, exc_info=exc)
                self._prep_failed.put((job_id, idx, f"{type(exc).__name__}: {exc}"))
        except EngineError:
            log.debug("engine closed before job %s item %d was submitted", job_id, idx)
        finally:
            if not moved:
                with self._prep_lock:
                    self._in_prep -= 1

    # --- results -------------------------------------------------------------------------

    def _record(self, finished: Iterable[Finished],
                failures: Iterable[tuple[str, int, str]]) -> None:
        """Hand engine output and prep failures to the writer."""
        for f in finished:
            job_id, idx = cast(tuple[str, int], f.key)
            self._preparer.item_done(job_id, idx)
            prep_s = self._prep_time.pop((job_id, idx), 0.0)
            record = partial(self._writer.record_finished, job_id, idx, f, prep_s)
            if f.error is not None or f.finish_reason in MODEL_FAILED:
                self._fall_back(job_id, idx, record)
            else:
                self._preparer.known_layer(job_id, idx)  # not needed: forget it
                record()
        for job_id, idx, msg in failures:
            self._fall_back(job_id, idx, partial(self._writer.record_failure, job_id, idx, msg))

    def _fall_back(self, job_id: str, idx: int, record: Callable[..., bool]) -> None:
        """Record a page the model failed, with its text layer's text when the job asks for
        it (text_layer fallback or prefer) and it is usable: read on a pool thread, since
        it may wait on a render process (unless the prefer check read it already)."""
        state = self.scheduler.jobs.get(job_id)
        item = state.payload.items[idx] if state is not None else None
        known, text = self._preparer.known_layer(job_id, idx)
        # A page's text is an OCR answer: a caption or an extraction it is not.
        if state is None or item is None or item.kind != "pdf" or (
                state.payload.task != "ocr" or state.resolved.text_layer == "off"):
            record()
            return
        if known:
            record(layer=text)
            return
        with self._prep_lock:
            self._in_fallback += 1  # keeps the loop busy (and a stop waiting) until back
        try:
            fut = self._preparer.pool.submit(self._preparer.fallback_text, item)
        except RuntimeError:  # the pool is shutting down: record the failure as it is
            with self._prep_lock:
                self._in_fallback -= 1
            record()
            return
        fut.add_done_callback(partial(self._layer_read, record))

    def _layer_read(self, record: Callable[..., bool], fut: Future[str | None]) -> None:
        layer = None
        if not fut.cancelled():
            exc = fut.exception()
            if exc is None:
                layer = fut.result()
            else:  # a bug: the item keeps the model's failure alone
                log.error("text layer fallback failed", exc_info=exc)
        self._fell_back.put((record, layer))
        with self._prep_lock:
            self._in_fallback -= 1


def _drain(q: SimpleQueue[T]) -> list[T]:
    """Everything a pool thread has put on `q` so far, without waiting."""
    out: list[T] = []
    while True:
        try:
            out.append(q.get_nowait())
        except Empty:
            return out


def _timeout_message(running: Running, done: int, total: int) -> str:
    limit = running.job.timeout or Queue.DEFAULT_TIMEOUT
    ran = time.monotonic() - running.started
    return (f"job timeout exceeded: the job's limit is {limit} s and it ran {ran:.0f} s here, "
            f"with {done}/{total} items done (their results are kept)")


def run_worker(cfg: WorkerConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # vlmq logs each job's start and finish itself; RQ's per-job lines would repeat them.
    logging.getLogger("rq.worker").setLevel(logging.WARNING)
    service = WorkerService(cfg)
    old = {s: signal.signal(s, service.request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return service.run()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
