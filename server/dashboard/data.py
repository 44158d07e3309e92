"""What the dashboard shows, read from Redis with plain reads only.

RQ's own helpers (Queue.count, registry counts, Worker.all) clean up stale entries as
they read, i.e. they write; the dashboard is read-only, so it reads RQ's keys directly.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from redis import Redis

from vlmq.shared import job_index
from vlmq.shared.keys import RQ_REGISTRIES, RQ_WORKERS, Keys
from vlmq.shared.redis_text import as_str

HISTORY_S = 600.0
SAMPLE_EVERY_S = 2.0


@dataclass(frozen=True)
class QueueRow:
    name: str
    queued: int
    registries: dict[str, int]


@dataclass(frozen=True)
class WorkerRow:
    name: str
    state: str
    queues: str
    stats: dict[str, str] = field(default_factory=dict)

    def stat(self, name: str, default: str = "-") -> str:
        return self.stats.get(name, default)


def queues(redis: Redis) -> list[QueueRow]:
    names = job_index.all_queues(redis)
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.llen(Keys.rq_queue(name))
        for kind in RQ_REGISTRIES:
            pipe.zcard(Keys.rq_registry(kind, name))
    counts = pipe.execute()
    width = 1 + len(RQ_REGISTRIES)
    out = []
    for i, name in enumerate(names):
        row = counts[i * width:(i + 1) * width]
        counted = dict(zip(RQ_REGISTRIES, map(int, row[1:]), strict=True))
        out.append(QueueRow(name=name, queued=int(row[0]), registries=counted))
    return out


def workers(redis: Redis, keys: Keys) -> list[WorkerRow]:
    """RQ's live workers merged by name with vlmq's stats hashes (either may be missing)."""
    names = {Keys.rq_name(as_str(k)) for k in redis.smembers(RQ_WORKERS)}
    names |= {as_str(n) for n in redis.smembers(keys.workers)}
    ordered = sorted(names)
    pipe = redis.pipeline(transaction=False)
    for name in ordered:
        pipe.hmget(Keys.rq_worker(name), "state", "queues")
        pipe.hgetall(keys.worker_stats(name))
    replies = pipe.execute()
    out = []
    for i, name in enumerate(ordered):
        state, queue_names = replies[2 * i]
        stats = {as_str(k): as_str(v) for k, v in replies[2 * i + 1].items()}
        if state is None and not stats:
            continue  # gone: no RQ hash and its stats expired
        out.append(WorkerRow(name=name, state=as_str(state or b"gone"),
                             queues=as_str(queue_names or b""), stats=stats))
    return out


def jobs_by_state(rows: list[QueueRow]) -> dict[str, int]:
    """Jobs by state over every queue, counted as `rq info` counts them (queue lengths
    and registry sizes), so a refresh costs the same at 100 k jobs as at 100."""
    out = {"queued": sum(q.queued for q in rows)}
    for kind in RQ_REGISTRIES:
        out[kind] = sum(q.registries[kind] for q in rows)
    return {state: n for state, n in sorted(out.items()) if n}


def item_results(redis: Redis, keys: Keys, job_id: str) -> dict[int, dict[str, Any]]:
    """Item results by index, read leniently: one unreadable entry is shown, not fatal."""
    out: dict[int, dict[str, Any]] = {}
    for raw_index, raw in redis.hgetall(keys.job_items(job_id)).items():
        with contextlib.suppress(ValueError):
            index = int(raw_index)
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):
                value = None
            out[index] = (dict(value) if isinstance(value, Mapping)
                          else {"error": "unreadable result entry"})
    return out


class History:
    """Each worker's throughput over the last minutes, sampled from its stats hash.

    The stats hash holds only current rates, so the dashboard keeps the series itself:
    sampled by a background thread while it runs, and on every overview request.
    """

    def __init__(self, horizon_s: float = HISTORY_S, every_s: float = SAMPLE_EVERY_S) -> None:
        self.horizon_s = horizon_s
        self.every_s = every_s
        self._series: dict[str, deque[tuple[float, float, float]]] = {}
        self._last = 0.0
        self._lock = threading.Lock()

    def sample(self, rows: list[WorkerRow], now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            if now - self._last < self.every_s:
                return
            self._last = now
            for row in rows:
                series = self._series.setdefault(row.name, deque())
                series.append((now, _float(row.stats.get("tokens_per_s")),
                               _float(row.stats.get("items_per_s"))))
                while series and now - series[0][0] > self.horizon_s:
                    series.popleft()

    def series(self, name: str) -> list[tuple[float, float, float]]:
        with self._lock:
            return list(self._series.get(name, ()))


def _float(text: str | None) -> float:
    try:
        return float(text or 0)
    except ValueError:
        return 0.0


def sparkline(points: list[tuple[float, float]], width: int = 240, height: int = 48) -> str:
    """SVG polyline points for (t, value) samples, scaled to the box; '' when too few."""
    if len(points) < 2:
        return ""
    t0, t1 = points[0][0], points[-1][0]
    top = max(v for _, v in points) or 1.0
    span = (t1 - t0) or 1.0
    return " ".join(f"{(t - t0) / span * width:.1f},{height - v / top * (height - 2):.1f}"
                    for t, v in points)
