"""The worker's main loop, by phase: jobs taken -> prep -> engine -> results.

Each turn takes jobs while there is room (worker/job_start.py over worker/jobs/taking.py),
feeds the prep window (worker/prep/stage.py), collects what came back (worker/collect.py:
engine answers and the pool threads' events, one typed queue, one dispatch, the text-layer
fallback beside it in worker/prep/fallback.py), and keeps the clock's duties (worker/upkeep.py).

Threads: this (main) thread owns Redis and RQ bookkeeping; a small CPU pool fetches,
decodes, renders and tokenizes; the engine's thread owns every MLX call. The main
thread never touches MLX and the MLX thread never touches Redis. With --metrics-port, an
HTTP thread (worker/metrics.py) reads counters, and touches neither.

The phases are layers, imported in one direction only, top to bottom
(tests/worker/test_phase_layers.py holds the table and fails on any import against it):
  orchestration  loop, collect, upkeep, metrics, job_start, redis_server: they join the
                 phases, so they may import all of them.
  results/       the writer and the result cache. Writing a job's last result ends the job
                 (through jobs/), and a cache key names the preprocessing (prep/).
  prep/          turns a job's items into engine requests: it reads the job's in-memory
                 state and poison records (jobs/) and builds requests for the engine.
  jobs/          the RQ lifecycle, start to end: taking, running, fencing, heartbeats,
                 queue guard, poison, job_end. It knows RQ and Redis, never how an item is
                 prepared or answered, so every phase above may hold a Running.
  common         beside this file: config, options, events, stats, task, default_dirs,
                 job_settings, item_order. What every phase reads; built on the engine's
                 types (Finished, EngineState, the repetition guard, the batch floor) and
                 the model's defaults, and on nothing above.
  engine/        the MLX thread's batcher and `vlmq model check`: it takes requests and
                 gives back tokens, knowing nothing of jobs or Redis.
  model/         the bottom: mlx-vlm calls, the families, BLAS, defaults, the tiny builder,
                 the reader. It imports no other worker module.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from vlmq.shared import redis_checks
from vlmq.shared.connection import connect, transient
from vlmq.shared.keys import Keys
from vlmq.shared.logs import job_fields
from vlmq.shared.messages import ItemResult
from vlmq.shared.urls import redact_url
from vlmq.stores.api_store import with_api_store
from vlmq.worker.collect import Collector
from vlmq.worker.config import WorkerConfig
from vlmq.worker.engine.batcher import Engine, EngineError, EngineInfo
from vlmq.worker.events import EventQueue
from vlmq.worker.item_order import ItemOrder
from vlmq.worker.job_start import JobStarter
from vlmq.worker.jobs.poison import RiskLog
from vlmq.worker.jobs.rq_jobs import BatchWorker, JobLifecycle, Running
from vlmq.worker.metrics import MetricsError, WorkerMetrics
from vlmq.worker.model import blas
from vlmq.worker.model.mlx_adapter import (
    ModelLoadError,
    check_local,
    family_of,
)
from vlmq.worker.options import default_name
from vlmq.worker.prep.fallback import Fallback
from vlmq.worker.prep.preparer import Preparer
from vlmq.worker.prep.render_pool import RenderPool
from vlmq.worker.prep.stage import PrepStage
from vlmq.worker.prep.vision_cache import VisionCache
from vlmq.worker.results.cache import ResultCache, store_results_many
from vlmq.worker.results.tokens import TokenStreams, end_of
from vlmq.worker.results.writer import ResultWriter
from vlmq.worker.stats import WorkerStats
from vlmq.worker.upkeep import Upkeep, check_redis

__all__ = ["EXIT_CONFIG", "EXIT_FAILED", "EXIT_UNAVAILABLE", "StartupError", "WorkerConfig",
           "WorkerLoop", "run_worker"]

log = logging.getLogger("vlmq.worker")

REDIS_RETRY_S = 1.0
# An idle worker on one queue waits for a job in a blocking BLMOVE this long at most (a
# stop signal is seen when it returns; Redis times blocked commands in 0.1 s steps).
IDLE_BLOCK_S = 0.5
# An idle worker on several queues looks at them all this often (no blocking pop keeps
# both their priority order and RQ's intermediate list).
IDLE_POLL_S = 0.01
BUSY_WAIT_S = 0.01  # how long a busy turn waits on the engine's first answer
STOP_DUMP_AFTER_S = 10.0

# Exit statuses at start (sysexits.h), so that a service manager restarts a worker only
# when a restart can help (cli/units.py: RestartPreventExitStatus=, the plist's wrapper).
# A configuration error (the model, --blas, the cache dir, the metrics port, a Redis that
# evicts) stays until someone fixes it; Redis or the hub out of reach may come back; any
# other failure (a worker of that name still registered) is retried too.
EXIT_CONFIG = os.EX_CONFIG  # 78
EXIT_UNAVAILABLE = os.EX_UNAVAILABLE  # 69
EXIT_FAILED = 1


class StartupError(Exception):
    """The worker cannot start; the message says why (no traceback needed), `code` which
    exit status tells a service manager whether restarting can help."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def _load_failure(exc: EngineError) -> StartupError:
    cause = exc.__cause__
    if isinstance(cause, ModelLoadError):
        return StartupError(str(exc), EXIT_UNAVAILABLE if cause.network else EXIT_CONFIG)
    return StartupError(str(exc))


@dataclass(frozen=True, eq=False)
class Phases:
    """The parts of one serving run, as the loop's turns use them."""

    engine: Engine
    lifecycle: JobLifecycle
    starter: JobStarter
    prep: PrepStage
    collector: Collector
    upkeep: Upkeep
    writer: ResultWriter
    tokens: TokenStreams


class WorkerLoop:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.redis = connect(cfg.redis_url)
        self.order: ItemOrder[Running] = ItemOrder()
        # Everything the pool threads hand the main loop, and how much is still out.
        self.events = EventQueue()
        self.stop_requested = False
        self.deadline: float | None = None
        self.stats = WorkerStats(cfg.name, cfg.max_batch, cfg.window)
        self._restarts: redis_checks.RestartWatch | None = None

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

    # --- start ---------------------------------------------------------------------------

    def run(self) -> int:
        cfg = self.cfg
        try:
            chosen = blas.select(cfg.blas, threads=blas.worker_threads(cfg.prep_threads))
        except blas.BlasError as exc:
            log.error("%s", exc)
            return EXIT_CONFIG
        log.info("BLAS: %s", chosen.describe())
        backends = blas.mlx_backends()
        if len(backends) > 1:
            log.warning("several MLX backends are installed (%s): they overwrite each other's "
                        "libmlx.so; keep one (pip uninstall mlx-cpu for CUDA, then pip "
                        "install --force-reinstall --no-deps mlx-cuda-12)", ", ".join(backends))
        self.stats.blas = chosen.describe()
        self.stats.blas_library = chosen.path or ""
        try:
            self._preflight()
        except StartupError as exc:
            log.error("%s", exc)
            return exc.code
        metrics = self._serve_metrics()  # before the model load: a busy port fails fast
        if isinstance(metrics, str):
            log.error("%s", metrics)
            return EXIT_CONFIG
        log.info("loading model %s", cfg.model)
        engine = Engine(cfg.model, max_batch=cfg.max_batch, repetition=cfg.repetition,
                        max_kv_tokens=cfg.max_kv_tokens, auto_batch=cfg.auto_batch,
                        prefix_cache_bytes=cfg.prefix_cache_bytes)
        self.stats.engine = engine.state  # plain counters: the metrics thread reads them
        try:
            return self._serve(engine)
        except StartupError as exc:
            log.error("%s", exc)
            return exc.code
        finally:
            engine.close(timeout=10)
            if metrics is not None:
                metrics.close()

    def _serve_metrics(self) -> WorkerMetrics | str | None:
        """The /metrics endpoint when asked for (else None), or why it cannot start."""
        cfg = self.cfg
        if not cfg.metrics_port:
            return None
        metrics = WorkerMetrics(self.stats,
                                lambda: (len(self.order), self.events.flight.preparing),
                                queues=cfg.queues, named=cfg.name != default_name())
        try:
            port = metrics.serve(cfg.metrics_host, cfg.metrics_port)
        except MetricsError as exc:
            return str(exc)
        log.info("metrics: http://%s:%d/metrics", cfg.metrics_host, port)
        return metrics

    def _preflight(self) -> None:
        """Problems worth reporting before a model load that can take minutes, as a
        StartupError whose code says whether a restart can help."""
        try:
            check_local(self.cfg.model)
        except ModelLoadError as exc:
            raise StartupError(str(exc), EXIT_CONFIG) from exc
        if self.cfg.cache_dir is not None and self.cfg.cache_disk_bytes > 0:
            try:
                self.cfg.cache_dir.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=self.cfg.cache_dir):
                    pass
            except OSError as exc:
                raise StartupError(f"cannot write to cache dir {self.cfg.cache_dir}: {exc}",
                                   EXIT_CONFIG) from exc
        try:
            self.redis.ping()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise StartupError(f"cannot reach Redis at {redact_url(self.cfg.redis_url)}: "
                               f"{exc}", EXIT_UNAVAILABLE) from exc
        problem = self._check_redis()
        if problem:
            raise StartupError(problem, EXIT_CONFIG)
        key = Keys.rq_worker(self.cfg.name)
        if self.redis.exists(key) and not self.redis.hexists(key, "death"):
            raise StartupError(
                f"a worker named {self.cfg.name!r} is already registered in Redis; pick "
                "another --name (the name of a worker that was killed frees up once its "
                "heartbeat expires, within 8 minutes)")

    def _check_redis(self) -> str | None:
        """Eviction refused (unless allowed), persistence warned about, run_id noted."""
        problem = check_redis(self.redis, self.cfg.allow_eviction)
        if problem is None:
            self._restarts = redis_checks.RestartWatch(self.redis)
        return problem

    def _serve(self, engine: Engine) -> int:
        cfg = self.cfg
        try:
            info = engine.wait_ready()
        except EngineError as exc:
            raise _load_failure(exc) from exc
        cache = self._vision_cache(info)
        queues = [Queue(q, connection=self.redis, serializer=JSONSerializer) for q in cfg.queues]
        worker = BatchWorker(queues, connection=self.redis, name=cfg.name,
                             heartbeat_ttl=cfg.heartbeat_ttl)
        lifecycle = JobLifecycle(worker, queues, cfg.keys, poison_kills=cfg.poison_kills)
        try:
            lifecycle.register_birth()
        except ValueError as exc:  # RQ: "There exists an active worker named ..."
            raise StartupError(str(exc)) from exc
        pool = ThreadPoolExecutor(cfg.prep_threads, thread_name_prefix="vlmq-prep")
        # Interactive items never queue behind the bulk items submitted to `pool`.
        urgent = ThreadPoolExecutor(1, thread_name_prefix="vlmq-prep-chat")
        renderer = RenderPool(cfg.render_procs or cfg.prep_threads, mem_mb=cfg.render_mem_mb,
                              timeout_s=cfg.render_timeout_s)
        # Store vlmq-api by default: `vlmq api` on this machine needs no flag (api_store).
        stores = with_api_store(cfg.stores)
        log.info("stores: %s", stores.describe())
        preparer = Preparer(engine, info, cache, self.redis, cfg.keys, pool, renderer,
                            RiskLog(self.redis, cfg.keys, cfg.name), stores=stores,
                            urgent=urgent)
        self.stats.model = cfg.model
        self.stats.model_type = info.model_type
        self.stats.cache = cache
        try:
            renderer.warm()  # the first PDF page must not wait for a process to start
        except RuntimeError as exc:
            log.warning("%s; PDF pages start their render process when they need one", exc)
        self.stats.renders = renderer
        phases = self._phases(engine, lifecycle, preparer, cache)
        limit = engine.state.batch_limit
        log.info("worker %s ready: model %s (%s), queues %s, batch %s, window %s",
                 cfg.name, cfg.model, info.model_type, ",".join(cfg.queues),
                 f"{limit} rows, measured up to {cfg.max_batch}" if limit < cfg.max_batch
                 else f"{cfg.max_batch} rows", cfg.window or "2 x the next batch limit")
        try:
            # Reclaim dead workers' jobs (RQ requeues them while retries are left) before
            # the first look at the queues, so even a --burst worker resumes them.
            lifecycle.maintain()
            self._loop(phases)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            urgent.shutdown(wait=True, cancel_futures=True)
            renderer.close()
            self._shutdown(phases)
        return 0

    def _vision_cache(self, info: EngineInfo) -> VisionCache:
        cfg = self.cfg
        if not info.cacheable:
            log.warning("vision features of model type %s cannot be cached: "
                        "running every image uncached (%s)", info.model_type,
                        family_of(info.model_type).cache_off)
        disk = cfg.cache_dir if info.cacheable and cfg.cache_disk_bytes > 0 else None
        try:
            return VisionCache(cfg.cache_mem_bytes, disk, cfg.cache_disk_bytes)
        except OSError as exc:
            raise StartupError(f"cannot use cache dir {cfg.cache_dir}: {exc}",
                               EXIT_CONFIG) from exc

    def _phases(self, engine: Engine, lifecycle: JobLifecycle, preparer: Preparer,
                cache: VisionCache) -> Phases:
        """Wire the phases: each gets the few parts it uses."""
        cfg, redis, stats, events = self.cfg, self.redis, self.stats, self.events
        results = ResultCache(redis, cfg.keys, preparer.model_identity,
                              ttl_s=cfg.result_cache_ttl_s, max_bytes=cfg.result_cache_bytes)

        tokens = TokenStreams(redis, cfg.keys, running_ttl_s=lifecycle.worker.heartbeat_ttl)

        def stored(done: list[tuple[Running, list[ItemResult]]]) -> None:
            """Once the results count as written (every job's in one go): interactive
            answers end their token streams, then the result cache (best effort)."""
            for state, written in done:
                tokens.ended(state, written)
                if state.interactive:
                    _interactive_done(stats, state, written)
            stats.result_cache_stores += store_results_many(results, done)

        writer = ResultWriter(redis, cfg.keys, lifecycle, self.order, stats,
                              on_stored=stored, on_failed=tokens.failed)
        prep = PrepStage(preparer, engine, self.order, events, window=cfg.prep_window)
        fallback = Fallback(preparer, preparer.pool, self.order.jobs, events)
        return Phases(
            engine=engine, lifecycle=lifecycle, writer=writer, prep=prep,
            starter=JobStarter(redis, cfg.keys, lifecycle, preparer, results, writer,
                               self.order, stats,
                               job_limit=lambda: cfg.job_limit(engine.state.batch_limit)),
            collector=Collector(engine, events, prep, fallback, writer, self.order,
                                tokens=tokens, stats=stats),
            tokens=tokens,
            upkeep=Upkeep(redis, cfg.keys, cfg.name, lifecycle, self.order, writer, stats,
                          engine.state, cache, events.flight, risk=preparer.risk,
                          stats_s=cfg.stats_s, restarts=self._restarts,
                          allow_eviction=cfg.allow_eviction))

    # --- stop ----------------------------------------------------------------------------

    def _shutdown(self, p: Phases) -> None:
        """Requeue unfinished jobs (their written items stay) and leave the worker registry."""
        cfg = self.cfg
        try:
            for state in [*p.starter.starting, *self.order.jobs.values()]:
                why = p.lifecycle.requeue(state)
                if why is None:
                    log.info("job %s requeued with %d/%d items done", state.job_id,
                             state.already_done + state.finished_here, state.total,
                             extra=job_fields(state.job_id))
                    self.stats.count_job(state.queue.name, "requeued")
                    self.order.jobs.pop(state.job_id, None)
                else:
                    p.writer.drop(state, why)
            p.upkeep.publish(stopped=True)
            self.stats.retire(self.redis, cfg.keys)
            p.lifecycle.register_death()
        except RedisError as exc:
            if not transient(exc):
                raise
            log.warning("Redis unavailable at shutdown (%s): %d job(s) left STARTED; RQ "
                        "requeues them once this worker's heartbeat expires",
                        exc, len(self.order))
        log.info("worker %s stopped", cfg.name)

    # --- main loop -----------------------------------------------------------------------

    def _loop(self, p: Phases) -> None:
        while True:
            try:
                if self._iterate(p):
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
                p.upkeep.look_soon()
                time.sleep(REDIS_RETRY_S)

    def _iterate(self, p: Phases) -> bool:
        """One turn of the main loop; True when the worker should stop."""
        now = time.monotonic()
        self._stop_if(p.upkeep.watch_restart(), now)
        took = 0 if self.stop_requested else self._intake_and_prep(p)
        self._watch_interactive(p)
        p.collector.collect(timeout=self._engine_wait(p, took))
        p.upkeep.tick(now)
        return self._stopped(p, now) if self.stop_requested else self._burst_done(p)

    def _intake_and_prep(self, p: Phases) -> int:
        """Take jobs (waiting in a blocking pop when idle on one queue), then fill the
        prep window; returns how many jobs were taken."""
        cfg = self.cfg
        idle = not (self._busy(p) or self.order.jobs or p.writer.holding or cfg.burst)
        took = p.starter.pull(block_s=IDLE_BLOCK_S if idle and len(cfg.queues) == 1 else 0.0)
        self.stats.observe_waiting(p.prep.fill())
        return took

    def _watch_interactive(self, p: Phases) -> None:
        """Every turn, one round trip while interactive jobs run: one cancelled (its
        client went away) or lost leaves the batch before the engine's next step, and a
        cancelled one's token stream ends "cancelled"."""
        states = [s for s in self.order.jobs.values() if s.interactive]
        for running, why in p.lifecycle.lost(states):
            p.engine.cancel((running.job_id, idx) for idx in running.outstanding)
            if why in (JobStatus.CANCELED.value, "deleted"):
                p.tokens.cancelled(running)
                self.stats.interactive_done(running.job_id, "cancelled")
            else:
                p.tokens.forget(running.job_id)
            p.writer.drop(running, why)
        p.tokens.flush()

    def _engine_wait(self, p: Phases, took: int) -> float:
        """How long this turn waits on the engine's first answer."""
        if took or p.writer.holding:
            return 0.0  # results to write and jobs to end now: no waiting on the engine
        if self._busy(p):
            return BUSY_WAIT_S
        # Idle: the blocking pop waited already; several queues are polled.
        return 0.0 if len(self.cfg.queues) == 1 and not self.cfg.burst else IDLE_POLL_S

    def _busy(self, p: Phases) -> bool:
        return self.events.flight.total(p.engine.state) > 0

    def _stopped(self, p: Phases, now: float) -> bool:
        """A stop was asked for: done once nothing is out any more, or at the deadline."""
        if not self._busy(p):
            p.collector.collect(timeout=0)  # what finished since the last look
            # A failure collected just now may have sent its page to the fallback.
            return not self._busy(p)
        return self.deadline is not None and now >= self.deadline

    def _burst_done(self, p: Phases) -> bool:
        done = (self.cfg.burst and p.starter.queues_empty and not self.order.jobs
                and not p.starter.starting and not p.writer.holding)
        if done:
            log.info("burst: queues empty and all work done")
        return done

    def _stop_if(self, problem: str | None, now: float) -> None:
        """A new Redis that evicts: stop as a fresh start would refuse to run."""
        if problem:
            log.error("%s; stopping", problem)
            self.stop_requested = True
            self.deadline = now + self.cfg.grace_s


def _interactive_done(stats: WorkerStats, state: Running, written: list[ItemResult]) -> None:
    """Count an interactive request's answer: how it ended, its time to first token (when
    no streamed text counted it) and its decode rate."""
    for res in written:
        t = res.timings
        generate_s = t.get("generate_s", 0.0)
        first = (time.monotonic() - state.started - generate_s) if "prefill_s" in t else None
        stats.interactive_done(state.job_id, end_of(res).finish_reason, first_token_s=first,
                               tokens=res.completion_tokens, generate_s=generate_s)


def run_worker(cfg: WorkerConfig) -> int:
    """Serve until stopped. Where lines go and how they look is the caller's choice (the
    CLI's cli/logs.py), as for any library."""
    # vlmq logs each job's start and finish itself; RQ's per-job lines would repeat them.
    logging.getLogger("rq.worker").setLevel(logging.WARNING)
    service = WorkerLoop(cfg)
    old = {s: signal.signal(s, service.request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return service.run()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
