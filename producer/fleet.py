"""The fleet's figures as one bounded read: what `vlmq status`, Client.queues() and the
Prometheus exporter (server/metrics_exporter.py) all show.

Queue depth, jobs by state per queue, dead letters, the age of the job at the head of
each queue and the live workers are read from RQ's lists and registries and vlmq's own
keys with LLEN, ZCARD, SCARD, LINDEX and one HGET per queue, pipelined: a read costs a
fixed number of round trips and O(queues + workers) commands, the same at 100 k jobs as
at 10.

Rows stay bounded whatever queue names Redis holds: at most C.MAX_SHOWN_QUEUES queues are
returned, the rest summed under queue="(other)".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redis import Redis

from vlmq.shared import constants as C
from vlmq.shared import job_index, lua
from vlmq.shared.keys import RQ_QUEUES, RQ_REGISTRIES, Keys
from vlmq.shared.redis_text import as_str

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
   : at most `shown` rows come back, those with workers first, then (with
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
