"""`vlmq metrics`: a Prometheus exporter for the figures no single worker owns.

Queue depth, jobs by state per queue, dead letters, the age of the job at the head of
each queue and the live workers are read from RQ's lists and registries and vlmq's own
keys with LLEN, ZCARD, SCARD, LINDEX and one HGET per queue, pipelined: a scrape costs a
fixed number of round trips and O(queues + workers) commands, the same at 100 k jobs as
at 10. (`--queued-items` adds one HGET of the running counts per queue.)

Series stay bounded whatever queue names Redis holds (20,000 one-job queues made
200,084 series): at most C.MAX_SHOWN_QUEUES queues are exported, the rest summed under
queue="(other)" with their number in vlmq_queues_folded.

The figures are read by producer/fleet.py. A standalone process rather than a page of the
dashboard: it needs no Flask and no auth token, writes nothing, and listens on 127.0.0.1
unless told otherwise. It is served by prometheus_client's own HTTP server. A scrape that
fails on Redis still answers 200, with `vlmq_up 0` alone: Prometheus discards the body of
any other status, so only a 200 lets an alert on `vlmq_up == 0` tell "Redis down" from
"exporter down" (`up == 0`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError

from vlmq.producer.fleet import OTHER_QUEUES, QUEUED, STATES, Fleet, read_fleet
from vlmq.shared import constants as C
from vlmq.shared.keys import Keys

log = logging.getLogger("vlmq.metrics")

DEFAULT_PORT = 9479


class FleetCollector(Collector):
    """Reads the fleet per scrape. A Redis error is no failed scrape: it yields
    `vlmq_up 0` (and the scrape's seconds) alone, which the server sends with a 200."""

    def __init__(self, redis: Redis, keys: Keys, *, items: bool = False) -> None:
        self.redis = redis
        self.keys = keys
        self.items = items
        self.down = False  # the last scrape failed on Redis (said once, not per scrape)

    def collect(self) -> Iterable[Metric]:
        t0 = time.monotonic()
        try:
            fleet = read_fleet(self.redis, self.keys, items=self.items)
        except RedisError as exc:
            if not self.down:
                log.warning("scrape failed on Redis: %s (vlmq_up 0 until it is back)", exc)
            self.down = True
            yield _up(0)
            yield _scrape_seconds(t0)
            return
        if self.down:
            log.info("Redis is back: scrapes read it again")
            self.down = False
        yield from self._figures(fleet)
        yield _up(1)
        yield _scrape_seconds(t0)

    def _figures(self, fleet: Fleet) -> Iterable[Metric]:
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
        for q in [*fleet.queues, *([fleet.other] if fleet.other else [])]:
            for state in STATES:
                jobs.add_metric([q.name, state], q.jobs[state])
            depth.add_metric([q.name], q.jobs[QUEUED])
            if q is not fleet.other:  # an age is one queue's head: none for the fold
                age.add_metric([q.name], q.head_age_s)
            workers.add_metric([q.name], q.workers)
            if q.items is not None:
                items.add_metric([q.name], q.items)
        yield from (jobs, depth, age, workers)
        if self.items:
            yield items
        yield GaugeMetricFamily("vlmq_queues_folded", "Queues summed into the queue=\"" +
                                OTHER_QUEUES + "\" series: past the "
                                f"{C.MAX_SHOWN_QUEUES} shown (those with workers, then the "
                                "default queues, then the most jobs).",
                                value=fleet.other.queues if fleet.other else 0)
        yield GaugeMetricFamily("vlmq_dead_letters", "Queue entries no worker could run, "
                                "kept in the dead-letter list (<prefix>:dead).",
                                value=fleet.dead_letters)
        yield GaugeMetricFamily("vlmq_workers", "Workers whose live stats are fresh.",
                                value=fleet.workers)


def _up(value: int) -> GaugeMetricFamily:
    return GaugeMetricFamily("vlmq_up", "1: this scrape read Redis; 0: it could not (the "
                             "other vlmq_ figures are left out then).", value=value)


def _scrape_seconds(t0: float) -> GaugeMetricFamily:
    return GaugeMetricFamily("vlmq_scrape_seconds", "Seconds this scrape took.",
                             value=time.monotonic() - t0)


def serve(host: str, port: int, registry: CollectorRegistry
          ) -> tuple[WSGIServer, threading.Thread]:
    """prometheus_client's HTTP server for `registry` on host:port (0: a free port),
    serving on a daemon thread; OSError when it cannot listen."""
    return start_http_server(port, addr=host, registry=registry)
