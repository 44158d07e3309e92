"""The worker's Prometheus endpoint (`vlmq worker --metrics-port N`).

Counters and gauges are read at scrape time from what the worker counts anyway
(worker/stats.WorkerStats, the engine's shared counters, the vision cache's stats, the
preprocessing counters), so the worker's loop does no extra work for them. Only the
histograms are observed as items are stored, from the timings each item result carries
anyway (one call per item, WorkerStats.on_item), and as jobs are taken (on_wait).

Every label value known in advance (tasks, outcomes, finish reasons, phases, this
worker's queues and job events) has its series from the first scrape, at 0: a rate() or
an alert over a series that does not exist yet sees nothing, not 0. The `worker` label
stays the same across restarts (--name, else host:port); the process id, new at every
start, is a gauge's value, never a label.

The HTTP server runs on its own thread, on a registry of its own (never the process-wide
default), and reads plain numbers only: it never calls MLX and never touches Redis.
"""

from __future__ import annotations

import errno
import importlib.metadata as md
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from vlmq.shared import constants as C
from vlmq.shared import fair
from vlmq.shared.messages import ItemResult
from vlmq.worker.stats import INTERACTIVE_ENDS, JOB_EVENTS, WorkerStats

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for it read vlmq's:
# its request-latency set for whole items, decode and queue waits (an OCR page takes
# from a fraction of a second to minutes), its time-to-first-token set for the phases
# before the first token, and 1-2-5 steps for token counts.
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5))  # 1..500k
# A decode rate per interactive request: 1-2-5 steps over what one Mac to one GPU does.
RATE_BUCKETS = tuple(float(m * 10 ** e) for e in range(4) for m in (1, 2, 5))  # 1..5000
# The parts of an item's timings before its first token, and after it; from admission
# into the batch to the first token is what vLLM calls prefill.
BEFORE_FIRST_TOKEN = ("preprocess_s", "queue_s", "vision_s", "embed_s", "prefill_s")
AFTER_FIRST_TOKEN = ("generate_s",)
PREFILL = ("vision_s", "embed_s", "prefill_s")
# Label values known in advance: their series exist (at 0) from the first scrape.
OUTCOMES = ("ok", "failed")
# What the engine and the result writer record (ItemResult.finish_reason); "none" stands
# for a result without one.
FINISH_REASONS = ("stop", "length", "repetition", "error")
TOKEN_KINDS = ("prompt", "generated")
PHASES = ("preprocess", "queue", "vision", "embed", "prefill", "generate", "mask")

Labels = TypeVar("Labels", bound=tuple[str, ...])
InFlight = Callable[[], tuple[int, int]]  # (jobs in flight, items in preparation)


class MetricsError(Exception):
    """The metrics endpoint cannot start; the message says why."""


def version() -> str:
    try:
        return md.version("vlmq")
    except md.PackageNotFoundError:
        return "unknown"


class WorkerCollector(Collector):
    """Everything but the histograms, read from the worker's own counters per scrape."""

    def __init__(self, stats: WorkerStats, in_flight: InFlight,
                 queues: Iterable[str] = ()) -> None:
        self.stats = stats
        self.in_flight = in_flight
        self.queues = tuple(queues)
        self.worker = stats.name  # the stable identity (WorkerMetrics.serve sets it)

    def collect(self) -> Iterable[Metric]:
        s = self.stats
        items_by, tokens_by, phase_s, jobs_by = s.totals()
        yield InfoMetricFamily("vlmq_worker", "The worker's identity (--name, else "
                               "host:metrics port), model, BLAS and vlmq version.",
                               value={"worker": self.worker, "model": s.model,
                                      "model_type": s.model_type, "blas": s.blas,
                                      "version": version()})
        yield _gauge("vlmq_worker_pid", "The process id serving this endpoint (new at "
                     "every start; process_start_time_seconds says when).", os.getpid())
        zero_items = {(t, o, f): 0 for t in C.TASKS for o in OUTCOMES for f in FINISH_REASONS}
        yield _labelled("vlmq_items", "Item results stored, by task, outcome and "
                        "finish_reason (stop, length: cut at max_tokens, repetition: cut by "
                        "the loop guard, error).", ["task", "outcome", "finish_reason"],
                        {**zero_items, **items_by})
        yield _labelled("vlmq_tokens", "Tokens of items the model ran (not result-cache "
                        "hits), by task and kind.", ["task", "kind"],
                        {**{(t, k): 0 for t in C.TASKS for k in TOKEN_KINDS}, **tokens_by})
        phases = {(name.removesuffix("_s"),): v for name, v in phase_s.items()}
        yield _labelled("vlmq_item_phase_seconds", "Seconds items spent in each phase "
                        "(preprocess, queue, vision, embed, prefill, generate, ...), summed.",
                        ["phase"], {**{(p,): 0.0 for p in PHASES}, **phases})
        zero_jobs = {(q, e): 0 for q in self.queues for e in JOB_EVENTS}
        yield _labelled("vlmq_jobs", "Jobs taken, refused, finished, failed or requeued by "
                        "this worker, by queue.", ["queue", "event"], {**zero_jobs, **jobs_by})
        yield from self._caches()
        yield from self._work()
        yield from self._engine()
        yield from self._interactive()

    def _interactive(self) -> Iterable[Metric]:
        s = self.stats
        e = s.engine
        yield _labelled("vlmq_interactive_requests", "Interactive requests (the chat queue) "
                        "answered here, by how they ended (stop, length, cancelled, error).",
                        ["finish_reason"], {**{(r,): 0 for r in INTERACTIVE_ENDS},
                                            **{(r,): n for r, n in
                                               s.interactive_totals().items()}})
        yield _counter("vlmq_bulk_rows_delayed", "Bulk rows that were waiting when an "
                       "interactive row took a row of the batch's limit.",
                       e.bulk_rows_delayed if e is not None else 0)

    def _caches(self) -> Iterable[Metric]:
        s = self.stats
        cs = s.cache.stats() if s.cache is not None else {}
        yield _counter("vlmq_vision_cache_hits", "Vision-feature cache hits.",
                       cs.get("hits", 0))
        yield _counter("vlmq_vision_cache_misses", "Vision-feature cache misses.",
                       cs.get("misses", 0))
        yield _counter("vlmq_vision_cache_evictions", "Vision-feature cache evictions.",
                       cs.get("evictions", 0))
        used = GaugeMetricFamily("vlmq_vision_cache_bytes", "Bytes held by the vision-feature "
                                 "cache, by tier.", labels=["tier"])
        used.add_metric(["memory"], cs.get("mem_bytes", 0))
        used.add_metric(["disk"], cs.get("disk_bytes", 0))
        yield used
        yield _counter("vlmq_result_cache_hits", "Items answered by the shared result cache.",
                       s.result_cache_hits)
        yield _counter("vlmq_result_cache_misses", "Items looked up in the shared result "
                       "cache and not found.", s.result_cache_misses)
        yield _counter("vlmq_result_cache_stores", "Results new to the shared result cache.",
                       s.result_cache_stores)

    def _work(self) -> Iterable[Metric]:
        s = self.stats
        work = s.work_counts()
        yield _counter("vlmq_image_decodes", "Images decoded.", work.get("image_decodes", 0))
        yield _counter("vlmq_pdf_renders", "PDF pages rendered.", work.get("pdf_renders", 0))
        yield _counter("vlmq_pdf_opens", "PDF documents opened (parsed).",
                       work.get("pdf_opens", 0))
        yield _counter("vlmq_pdf_text_extracts", "PDF text layers read.",
                       work.get("text_extracts", 0))
        yield _counter("vlmq_pdf_render_failures", "Items whose page the render process "
                       "could not render (memory or time limit, crash).", s.render_failures)
        yield _counter("vlmq_pdf_render_timeouts", "Items whose page rendering ran past "
                       "--render-timeout.", s.render_timeouts)
        yield _gauge("vlmq_render_processes", "PDF render processes running.",
                     len(s.renders.pids) if s.renders is not None else 0)

    def _engine(self) -> Iterable[Metric]:
        s = self.stats
        e = s.engine
        jobs, in_prep = self.in_flight()
        active = e.active if e is not None else 0
        waiting = e.waiting if e is not None else 0
        yield _gauge("vlmq_batch_active_rows", "Sequences in the batch now.", active)
        yield _gauge("vlmq_batch_max_rows", "The batch's size cap (--max-batch).",
                     s.max_batch)
        yield _gauge("vlmq_batch_limit_rows", "The rows the batch admits now (measured below "
                     "the cap unless --fixed-batch).", e.batch_limit if e is not None else 0)
        yield _gauge("vlmq_items_in_flight", "Items being prepared, waiting for the batch or "
                     "in it.", active + waiting + in_prep)
        yield _gauge("vlmq_items_waiting", "Items prepared or being prepared, not yet in the "
                     "batch.", waiting + in_prep)
        yield _gauge("vlmq_jobs_in_flight", "Jobs this worker runs now.", jobs)
        yield from _shares(s.shares)
        yield _gauge("vlmq_kv_tokens_in_flight", "Prompt plus max new tokens of the rows in "
                     "the batch (what the KV budget admits by).",
                     e.kv_in_flight if e is not None else 0)
        yield _gauge("vlmq_kv_tokens_budget", "The KV budget rows are admitted under "
                     "(--max-kv-tokens, else derived from memory once the model has loaded; "
                     "0 before): saturation is vlmq_kv_tokens_in_flight / this.",
                     e.kv_budget if e is not None else 0)
        yield _counter("vlmq_tower_calls", "Vision tower runs (vision-cache misses the model "
                       "computed).", e.tower_calls if e is not None else 0)
        yield _counter("vlmq_prefix_hits", "Rows that started from a cached prompt prefix "
                       "(an image's K/V prefilled before).", e.prefix_hits if e is not None else 0)
        yield _counter("vlmq_prefix_tokens_skipped", "Prompt tokens cached prefixes spared "
                       "the prefill.", e.prefix_tokens_skipped if e is not None else 0)
        yield _counter("vlmq_prefill_tokens", "Prompt tokens prefilled.",
                       e.prefill_tokens if e is not None else 0)
        yield _gauge("vlmq_prefix_cache_bytes", "Bytes of prompt-prefix K/V held "
                     "(--prefix-cache-mb bounds it).", e.prefix_bytes if e is not None else 0)
        yield _counter("vlmq_repetition_cuts", "Rows stopped by the repetition guard (each "
                       "attempt counts).", e.repetitions if e is not None else 0)
        yield _counter("vlmq_step_isolations", "Failed generator steps whose rows were rerun "
                       "apart to find the one at fault.", e.isolations if e is not None else 0)
        yield _counter("vlmq_matcher_deferrals", "Constrained rows taken out of the batch to "
                       "keep a step's schema matching within the model's time.",
                       e.deferrals if e is not None else 0)
        yield _counter("vlmq_mlx_busy_seconds", "Seconds the MLX thread spent in model work.",
                       e.busy_s if e is not None else 0.0)


def _shares(shares: Iterable[fair.Share]) -> Iterable[Metric]:
    """The jobs in hand by batch: the share each batch (an API key's batch too) has of
    this worker now. Series come and go with the batches, at most shares_of's limit + 1."""
    jobs = GaugeMetricFamily("vlmq_share_jobs", "Jobs this worker runs now, by batch ("
                             f"{fair.LOOSE_NAME!r}: jobs without one).", labels=["batch"])
    items = GaugeMetricFamily("vlmq_share_items", "Items not yet done of the jobs this "
                              "worker runs now, by batch.", labels=["batch"])
    for share in shares:
        jobs.add_metric([fair.shown(share.batch)], share.jobs)
        items.add_metric([fair.shown(share.batch)], share.items)
    yield jobs
    yield items


def _labelled(name: str, doc: str, labels: list[str],
              values: Mapping[Labels, float]) -> CounterMetricFamily:
    """A counter with one sample per label tuple, in label order."""
    out = CounterMetricFamily(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        out.add_metric(list(key), value)
    return out


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class WorkerMetrics:
    """The registry, the histograms and (once started) the HTTP server of one worker."""

    def __init__(self, stats: WorkerStats, in_flight: InFlight, *,
                 queues: Iterable[str] = (), named: bool = True) -> None:
        """`queues`: this worker's, for the jobs counter's series at 0; `named`: the
        worker's name was given (--name), so it is its identity, else host:port is."""
        self.registry = CollectorRegistry()
        self.collector = WorkerCollector(stats, in_flight, queues)
        self.named = named
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)  # CPU, memory, open files (Linux)

        def histogram(name: str, doc: str, buckets: tuple[float, ...],
                      labels: tuple[str, ...] = ("task",)) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.latency = histogram("vlmq_item_seconds", "Seconds from an item's preparation "
                                 "to its last token, for items the model ran.",
                                 REQUEST_BUCKETS)
        self.ttft = histogram("vlmq_item_first_token_seconds", "Seconds from an item's "
                              "preparation to its first token.", TTFT_BUCKETS)
        self.queue = histogram("vlmq_item_queue_seconds", "Seconds a prepared item waited "
                               "for a row in the batch.", TTFT_BUCKETS)
        self.prefill = histogram("vlmq_item_prefill_seconds", "Seconds from an item's "
                                 "admission into the batch to its first token (vision "
                                 "tower, embedding, prefill).", TTFT_BUCKETS)
        self.decode = histogram("vlmq_item_decode_seconds", "Seconds from an item's first "
                                "token to its last.", REQUEST_BUCKETS)
        self.prompt_tokens = histogram("vlmq_item_prompt_tokens", "Prompt tokens per item "
                                       "the model ran (image tokens included).",
                                       TOKEN_BUCKETS)
        self.generated_tokens = histogram("vlmq_item_generated_tokens", "Tokens generated "
                                          "per item the model ran.", TOKEN_BUCKETS)
        self.job_wait = histogram("vlmq_job_queue_wait_seconds", "Seconds from a job's "
                                  "enqueue (or requeue) to this worker taking it, by queue.",
                                  REQUEST_BUCKETS, ("queue",))
        per_task = (self.latency, self.ttft, self.queue, self.prefill, self.decode,
                    self.prompt_tokens, self.generated_tokens)
        for task in C.TASKS:  # every series from the first scrape, at 0
            for h in per_task:
                h.labels(task)
        for q in self.collector.queues:
            self.job_wait.labels(q)
        self.interactive_ttft = histogram(
            "vlmq_interactive_ttft_seconds", "Seconds from an interactive request's take "
            "by this worker to its first token.", TTFT_BUCKETS, ())
        self.interactive_rate = histogram(
            "vlmq_interactive_tokens_per_second", "Tokens per second an interactive "
            "request decoded at, first token to last.", RATE_BUCKETS, ())
        self._server: WSGIServer | None = None
        stats.on_item = self.observe
        stats.on_wait = self.observe_wait
        stats.on_interactive = self.observe_interactive

    def observe(self, result: ItemResult, task: str) -> None:
        """Per stored item: only items the model ran have the timings to observe."""
        t = result.timings
        if "prefill_s" not in t:
            return
        first = sum(t.get(k, 0.0) for k in BEFORE_FIRST_TOKEN)
        self.ttft.labels(task).observe(first)
        self.latency.labels(task).observe(first + sum(t.get(k, 0.0)
                                                      for k in AFTER_FIRST_TOKEN))
        self.queue.labels(task).observe(t.get("queue_s", 0.0))
        self.prefill.labels(task).observe(sum(t.get(k, 0.0) for k in PREFILL))
        self.decode.labels(task).observe(t.get("generate_s", 0.0))
        self.prompt_tokens.labels(task).observe(result.prompt_tokens)
        self.generated_tokens.labels(task).observe(result.completion_tokens)

    def observe_interactive(self, what: str, value: float) -> None:
        """WorkerStats.on_interactive: "ttft" seconds or "tokens_per_s"."""
        (self.interactive_ttft if what == "ttft" else self.interactive_rate).observe(value)

    def observe_wait(self, queue: str, seconds: float) -> None:
        self.job_wait.labels(queue).observe(seconds)

    def serve(self, host: str, port: int) -> int:
        """Listen on host:port (0 picks a free port); returns the port listened on."""
        try:
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            why = ("the port is in use (another worker, or another exporter, listens "
                   "there): pick another --metrics-port" if exc.errno == errno.EADDRINUSE
                   else str(exc))
            raise MetricsError(f"cannot serve metrics on {host}:{port}: {why}") from exc
        served = int(self._server.server_address[1])
        if not self.named:
            self.collector.worker = f"{socket.gethostname()}:{served}"
        return served

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
