"""The worker's Prometheus endpoint (`vlmq worker --metrics-port N`).

Counters and gauges are read at scrape time from what the worker counts anyway
(worker/stats.WorkerStats, the engine's shared counters, the vision cache's stats, the
preprocessing counters), so the worker's loop does no extra work for them. Only the
histograms are observed as items are stored: one call per item (WorkerStats.on_item).

The HTTP server runs on its own thread, on a registry of its own (never the process-wide
default), and reads plain numbers only: it never calls MLX and never touches Redis.
"""

from __future__ import annotations

import errno
import importlib.metadata as md
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from vlmq.shared.messages import ItemResult
from vlmq.worker.stats import WorkerStats

# OCR items take from a fraction of a second (a cached page, a tiny model) to minutes (a
# dense page at max_tokens on a large model).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                   300.0, 600.0, 1800.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# The parts of an item's timings before its first token, and after it.
BEFORE_FIRST_TOKEN = ("preprocess_s", "queue_s", "vision_s", "embed_s", "prefill_s")
AFTER_FIRST_TOKEN = ("generate_s",)

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

    def __init__(self, stats: WorkerStats, in_flight: InFlight) -> None:
        self.stats = stats
        self.in_flight = in_flight

    def collect(self) -> Iterable[Metric]:
        s = self.stats
        items_by, tokens_by, phase_s, jobs_by = s.totals()
        yield InfoMetricFamily("vlmq_worker", "The worker's model, BLAS and vlmq version.",
                               value={"name": s.name, "model": s.model,
                                      "model_type": s.model_type, "blas": s.blas,
                                      "version": version()})
        yield _labelled("vlmq_items", "Item results stored, by task and outcome.",
                        ["task", "outcome"], items_by)
        yield _labelled("vlmq_tokens", "Tokens of items the model ran (not result-cache "
                        "hits), by task and kind.", ["task", "kind"], tokens_by)
        yield _labelled("vlmq_item_phase_seconds", "Seconds items spent in each phase "
                        "(preprocess, queue, vision, embed, prefill, generate, ...), summed.",
                        ["phase"], {(name.removesuffix("_s"),): v for name, v in phase_s.items()})
        yield _labelled("vlmq_jobs", "Jobs taken, refused, finished, failed or requeued by "
                        "this worker, by queue.", ["queue", "event"], jobs_by)
        yield from self._caches()
        yield from self._work()
        yield from self._engine()

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
        yield _gauge("vlmq_kv_tokens_in_flight", "Prompt plus max new tokens of the rows in "
                     "the batch (what the KV budget admits by).",
                     e.kv_in_flight if e is not None else 0)
        yield _counter("vlmq_tower_calls", "Vision tower runs (vision-cache misses the model "
                       "computed).", e.tower_calls if e is not None else 0)
        yield _counter("vlmq_repetition_cuts", "Rows stopped by the repetition guard (each "
                       "attempt counts).", e.repetitions if e is not None else 0)
        yield _counter("vlmq_step_isolations", "Failed generator steps whose rows were rerun "
                       "apart to find the one at fault.", e.isolations if e is not None else 0)
        yield _counter("vlmq_mlx_busy_seconds", "Seconds the MLX thread spent in model work.",
                       e.busy_s if e is not None else 0.0)


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

    def __init__(self, stats: WorkerStats, in_flight: InFlight) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(WorkerCollector(stats, in_flight))
        ProcessCollector(registry=self.registry)  # CPU, memory, open files (Linux)
        self.latency = Histogram("vlmq_item_seconds", "Seconds from an item's preparation "
                                 "to its last token, for items the model ran.", ["task"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("vlmq_item_first_token_seconds", "Seconds from an item's "
                              "preparation to its first token.", ["task"],
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self._server: WSGIServer | None = None
        stats.on_item = self.observe

    def observe(self, result: ItemResult, task: str) -> None:
        """Per stored item: only items the model ran have the timings to observe."""
        t = result.timings
        if "prefill_s" not in t:
            return
        first = sum(t.get(k, 0.0) for k in BEFORE_FIRST_TOKEN)
        self.ttft.labels(task).observe(first)
        self.latency.labels(task).observe(first + sum(t.get(k, 0.0)
                                                      for k in AFTER_FIRST_TOKEN))

    def serve(self, host: str, port: int) -> int:
        """Listen on host:port (0 picks a free port); returns the port listened on."""
        try:
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            why = ("the port is in use (another worker, or another exporter, listens "
                   "there): pick another --metrics-port" if exc.errno == errno.EADDRINUSE
                   else str(exc))
            raise MetricsError(f"cannot serve metrics on {host}:{port}: {why}") from exc
        return int(self._server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
