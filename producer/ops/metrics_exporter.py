"""`vlmq metrics`: a Prometheus exporter for the figures no single worker owns.

Queue depth, jobs by state per queue, dead letters, the age of the job at the head of
each queue and the live workers are read from RQ's lists and registries and vlmq's own
keys with LLEN, ZCARD, SCARD, LINDEX and one HGET per queue, pipelined: a scrape costs a
fixed number of round trips and O(queues + workers) commands, the same at 100 k jobs as
at 10. (`--queued-items` adds a SORT per queue that reads every queued job hash inside
Redis: off by default.)

A standalone process rather than a page of the dashboard: it needs no Flask and no auth
token, writes nothing, and listens on 127.0.0.1 unless told otherwise. A scrape that
fails on Redis answers 503 with `vlmq_up 0`, so an alert can tell "Redis down" from
"exporter down".
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError

from vlmq.shared import constants as C
from vlmq.shared import job_index
from vlmq.shared.keys import RQ_QUEUES, RQ_REGISTRIES, Keys
from vlmq.shared.redis_text import as_str

log = logging.getLogger("vlmq.metrics")

DEFAULT_PORT = 9479
QUEUED = "queued"
STATES = (QUEUED, *RQ_REGISTRIES)  # queued, started, finished, failed, deferred, ...


@dataclass(frozen=True)
class QueueFigures:
    name: str
    jobs: dict[str, int]  # by state (STATES)
    head_age_s: float  # how long the job next in line has waited; 0 when empty
    workers: int  # RQ workers listening on the queue
    items: int | None = None  # items of the queued jobs (--queued-items), else None


@dataclass(frozen=True)
class Fleet:
    queues: list[QueueFigures] = field(default_factory=list)
    dead_letters: int = 0
    workers: int = 0  # vlmq workers whose stats are fresh (they refresh every few seconds)


def read_fleet(redis: Redis, keys: Keys, *, items: bool = False) -> Fleet:
    """The fleet's figures in three pipelined round trips, O(queues + workers) commands."""
    pipe = redis.pipeline(transaction=False)
    pipe.smembers(RQ_QUEUES)
    pipe.llen(keys.dead)
    pipe.smembers(keys.workers)
    pipe.time()
    queue_keys, dead, worker_names, (secs, micros) = pipe.execute()
    now = int(secs) + int(micros) / 1e6  # Redis's clock, as RQ's timestamps are compared to
    # The default queues always: a queue nobody enqueued to yet shows 0s, not no series.
    queues = sorted({Keys.rq_name(as_str(k)) for k in queue_keys}
                    | set(C.DEFAULT_QUEUE.values()))
    names = sorted(as_str(n) for n in worker_names)
    pipe = redis.pipeline(transaction=False)
    for q in queues:
        pipe.llen(Keys.rq_queue(q))
        for kind in RQ_REGISTRIES:
            pipe.zcard(Keys.rq_registry(kind, q))
        pipe.lindex(Keys.rq_queue(q), 0)
        pipe.scard(Keys.rq_queue_workers(q))
    for name in names:
        pipe.exists(keys.worker_stats(name))
    replies = pipe.execute()
    width = 1 + len(RQ_REGISTRIES) + 2
    heads: list[str | None] = []
    per_queue: list[tuple[dict[str, int], int]] = []
    for i in range(len(queues)):
        row = replies[i * width:(i + 1) * width]
        per_queue.append((dict(zip(STATES, map(int, row[:len(STATES)]), strict=True)),
                          int(row[-1])))
        heads.append(None if row[-2] is None else as_str(row[-2]))
    live = sum(int(n) for n in replies[len(queues) * width:])
    ages = _head_ages(redis, heads, now)
    out = []
    for q, (jobs, workers), age in zip(queues, per_queue, ages, strict=True):
        n_items = job_index.queued_items(redis, keys, q) if items else None
        out.append(QueueFigures(q, jobs, age, workers, n_items))
    return Fleet(out, int(dead), live)


def _head_ages(redis: Redis, heads: list[str | None], now: float) -> list[float]:
    """Seconds since each head job was enqueued (RQ's enqueued_at), one round trip."""
    pipe = redis.pipeline(transaction=False)
    for job_id in heads:
        if job_id is not None:
            pipe.hget(Keys.rq_job(job_id), "enqueued_at")
    stamps = iter(pipe.execute() if len(pipe) else [])
    ages = []
    for job_id in heads:
        raw = next(stamps) if job_id is not None else None
        when = job_index.parse_rq_time(as_str(raw)) if raw is not None else None
        ages.append(max(0.0, now - when.timestamp()) if when is not None else 0.0)
    return ages


class FleetCollector(Collector):
    """Reads the fleet per scrape; a Redis error propagates (the handler answers 503)."""

    def __init__(self, redis: Redis, keys: Keys, *, items: bool = False) -> None:
        self.redis = redis
        self.keys = keys
        self.items = items

    def collect(self) -> Iterable[Metric]:
        t0 = time.monotonic()
        fleet = read_fleet(self.redis, self.keys, items=self.items)
        jobs = GaugeMetricFamily("vlmq_queue_jobs", "Jobs per queue and state, as RQ keeps "
                                 "them (its queue list and registries).",
                                 labels=["queue", "state"])
        depth = GaugeMetricFamily("vlmq_queue_depth", "Jobs waiting in each queue.",
                                  labels=["queue"])
        age = GaugeMetricFamily("vlmq_queue_oldest_age_seconds", "Seconds the job next in "
                                "line has waited since it was enqueued (0: queue empty).",
                                labels=["queue"])
        workers = GaugeMetricFamily("vlmq_queue_workers", "RQ workers listening on each "
                                    "queue.", labels=["queue"])
        items = GaugeMetricFamily("vlmq_queue_items", "Items of the jobs waiting in each "
                                  "queue.", labels=["queue"])
        for q in fleet.queues:
            for state in STATES:
                jobs.add_metric([q.name, state], q.jobs[state])
            depth.add_metric([q.name], q.jobs[QUEUED])
            age.add_metric([q.name], q.head_age_s)
            workers.add_metric([q.name], q.workers)
            if q.items is not None:
                items.add_metric([q.name], q.items)
        yield from (jobs, depth, age, workers)
        if self.items:
            yield items
        yield GaugeMetricFamily("vlmq_dead_letters", "Queue entries no worker could run, "
                                "kept in the dead-letter list (vlmq dead).",
                                value=fleet.dead_letters)
        yield GaugeMetricFamily("vlmq_workers", "Workers whose live stats are fresh.",
                                value=fleet.workers)
        yield GaugeMetricFamily("vlmq_up", "1: this scrape read Redis.", value=1)
        yield GaugeMetricFamily("vlmq_scrape_seconds", "Seconds this scrape took.",
                                value=time.monotonic() - t0)


def down_registry() -> CollectorRegistry:
    """What a scrape that failed on Redis answers: vlmq_up 0."""
    reg = CollectorRegistry()
    reg.register(_Down())
    return reg


class _Down(Collector):
    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("vlmq_up", "1: this scrape read Redis.", value=0)


def make_server(host: str, port: int, registry: CollectorRegistry) -> ThreadingHTTPServer:
    """An HTTP server answering /metrics from `registry` (503 + vlmq_up 0 on a Redis
    error); OSError when it cannot listen."""
    down = down_registry()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            path = self.path.split("?", 1)[0]
            if path not in ("/metrics", "/"):
                self._send(404, b"not found; see /metrics\n", "text/plain; charset=utf-8")
                return
            if path == "/":
                self._send(200, b"vlmq fleet metrics: /metrics\n", "text/plain; charset=utf-8")
                return
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            try:
                body = encoder(registry)
            except RedisError as exc:
                log.warning("scrape failed on Redis: %s", exc)
                self._send(503, encoder(down), content_type)
                return
            self._send(200, body, content_type)

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # base's name
            log.debug("%s " + format, self.address_string(), *args)

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    return Server((host, port), Handler)
