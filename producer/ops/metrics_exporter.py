"""`vlmq metrics`: a Prometheus exporter for the figures no single worker owns.

Queue depth, jobs by state per queue, dead letters, the age of the job at the head of
each queue and the live workers are read from RQ's lists and registries and vlmq's own
keys with LLEN, ZCARD, SCARD, LINDEX and one HGET per queue, pipelined: a scrape costs a
fixed number of round trips and O(queues + workers) commands, the same at 100 k jobs as
at 10. (`--queued-items` adds one HGET of the running counts per queue.)

Series stay bounded whatever queue names Redis holds (issue 29: 20,000 one-job queues made
200,084 series): at most C.MAX_SHOWN_QUEUES queues are exported, the rest summed under
queue="(other)" with their number in vlmq_queues_folded.

A standalone process rather than a page of the dashboard: it needs no Flask and no auth
token, writes nothing, and listens on 127.0.0.1 unless told otherwise. It is served by
prometheus_client's own HTTP server. A scrape that fails on Redis still answers 200,
with `vlmq_up 0` alone: Prometheus discards the body of any other status, so only a 200
lets an alert on `vlmq_up == 0` tell "Redis down" from "exporter down" (`up == 0`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from redis import Redis
from redis.exceptions import RedisError

from vlmq.shared import constants as C
from vlmq.shared import job_index, lua
from vlmq.shared.keys import RQ_QUEUES, RQ_REGISTRIES, Keys
from vlmq.shared.redis_text import as_str

log = logging.getLogger("vlmq.metrics")

DEFAULT_PORT = 9479
QUEUED = "queued"
STATES = (QUEUED, *RQ_REGISTRIES)  # queued, started, finished, failed, deferred, ...


# The one row that stands for every queue not shown: not a valid queue name
# (QUEUE_NAME_RE has no parentheses), so it cannot collide with a real one.
OTHER_QUEUES = "(other)"


@dataclass(frozen=True)
class QueueFigures:
    name: str
    jobs: dict[str, int]  # by state (STATES)
    head_age_s: float  # how long the job next in line has waited; 0 when empty
    workers: int  # RQ workers listening on the queue
    items: int | None = None  # items of the queued jobs (--queued-items), else None
    queues: int = 1  # how many queues the row stands for (OTHER_QUEUES: all it folds)


@dataclass(frozen=True)
class Fleet:
    queues: list[QueueFigures] = field(default_factory=list)
    dead_letters: int = 0
    workers: int = 0  # vlmq workers whose stats are fresh (they refresh every few seconds)
    other: QueueFigures | None = None  # the queues not shown, summed (None: all shown)


def read_fleet(redis: Redis, keys: Keys, *, items: bool = False,
               shown: int = C.MAX_SHOWN_QUEUES, defaults: bool = True,
               ages: bool = True) -> Fleet:
    """The fleet's figures in four pipelined round trips, O(queues + workers) commands.

    Queue names are whoever enqueued's choice and an old Redis may hold thousands
    (issue 29): at most `shown` rows come back, those with workers first, then (with
    `defaults`, which also adds them when absent) the default queues, then the most jobs;
    the rest are summed into `other`, so what a reader prints or exports is bounded.
    Without `ages` the head jobs are not read (every head_age_s is 0): `vlmq status`
    shows none, and reads a queue's list with LLEN only.
    """
    pipe = redis.pipeline(transaction=False)
    pipe.smembers(RQ_QUEUES)
    pipe.llen(keys.dead)
    pipe.smembers(keys.workers)
    pipe.time()
    queue_keys, dead, worker_names, (secs, micros) = pipe.execute()
    now = int(secs) + int(micros) / 1e6  # Redis's clock, as RQ's timestamps are compared to
    # The default queues always: a queue nobody enqueued to yet shows 0s, not no series.
    firsts = set(C.DEFAULT_QUEUE.values()) if defaults else set()
    queues = sorted({Keys.rq_name(as_str(k)) for k in queue_keys} | firsts)
    names = sorted(as_str(n) for n in worker_names)
    figures, keyed = _counts(redis, keys, queues, items)
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.exists(keys.worker_stats(name))
    live = sum(int(n) for n in pipe.execute()) if names else 0
    order = sorted(queues, key=lambda q: (figures[q][1] == 0, q not in firsts,
                                          -sum(figures[q][0].values()),
                                          q not in keyed, q))
    kept = sorted(order if len(order) <= shown else order[:max(shown - 1, 0)])
    folded = order[len(kept):]
    heads = _head_ages(redis, kept, now) if ages else [0.0] * len(kept)
    out = [QueueFigures(q, figures[q][0], age, figures[q][1], figures[q][2])
           for q, age in zip(kept, heads, strict=True)]
    return Fleet(out, int(dead), live, _fold(folded, figures, items))


Counted = tuple[dict[str, int], int, int | None]  # jobs by state, workers, queued items


def _counts(redis: Redis, keys: Keys, queues: list[str],
            items: bool) -> tuple[dict[str, Counted], set[str]]:
    """Each queue's jobs by state, workers and (with `items`) queued items.

    rq:queues may hold thousands of names with no key behind them (anyone can SADD), so
    one script finds the queues that have keys and only those are counted; the others
    are all zero, and come last among the queues without workers.
    """
    live = {Keys.rq_name(as_str(m))
            for m in lua.script(redis, lua.QUEUE_CENSUS)(keys=[RQ_QUEUES], args=[keys.prefix])}
    empty: Counted = (dict.fromkeys(STATES, 0), 0, 0 if items else None)
    out = dict.fromkeys(queues, empty)
    out.update(_full_counts(redis, keys, [q for q in queues if q in live], items))
    return out, live


def _full_counts(redis: Redis, keys: Keys, queues: list[str],
                 items: bool) -> dict[str, Counted]:
    pipe = redis.pipeline(transaction=False)
    for q in queues:
        pipe.llen(Keys.rq_queue(q))
        for kind in RQ_REGISTRIES:
            pipe.zcard(Keys.rq_registry(kind, q))
        pipe.scard(Keys.rq_queue_workers(q))
        if items:
            pipe.hget(keys.counts_queue(q), "queued_items")  # as job_index.queued_items
    replies = pipe.execute() if queues else []
    width = len(STATES) + 1 + int(items)
    out: dict[str, Counted] = {}
    for i, q in enumerate(queues):
        row = replies[i * width:(i + 1) * width]
        out[q] = (dict(zip(STATES, map(int, row[:len(STATES)]), strict=True)),
                  int(row[len(STATES)]), int(row[-1] or 0) if items else None)
    return out


def _fold(folded: list[str], figures: dict[str, Counted], items: bool) -> QueueFigures | None:
    """The queues not shown as one row: their jobs, workers and items summed."""
    if not folded:
        return None
    jobs = {state: sum(figures[q][0][state] for q in folded) for state in STATES}
    return QueueFigures(OTHER_QUEUES, jobs, 0.0, sum(figures[q][1] for q in folded),
                        sum(figures[q][2] or 0 for q in folded) if items else None,
                        queues=len(folded))


def _head_ages(redis: Redis, queues: list[str], now: float) -> list[float]:
    """Seconds since each queue's head job was enqueued (RQ's enqueued_at), two round
    trips."""
    pipe = redis.pipeline(transaction=False)
    for q in queues:
        pipe.lindex(Keys.rq_queue(q), 0)
    heads = [None if h is None else as_str(h) for h in (pipe.execute() if queues else [])]
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
