"""vlmq's own job indexes: what listings and counts read instead of scanning job hashes.

RQ keeps each job's state (its queue list and registries) but nothing to list jobs by
time or label, so every job also has (shared/keys.py; PROTOCOL.md "Job indexes"):
- an entry in `<prefix>:jobs` and in `<prefix>:jobs:queue:<queue>`, scored by enqueue
  time (epoch µs), and one in the zset of each of its labels;
- a summary in `<prefix>:jobs:meta` (task, items, queue, labels, created), so a listing
  never inflates a payload, and so an entry whose job hash RQ's TTL deleted can be
  removed from every index (the summary names them all).

They are written with the job: in the MULTI of shared/enqueue.enqueue, and by enqueue.lua.
RQ deletes expired job hashes without telling anyone, so readers prune the stale entries
they meet and `sweep` walks the rest. This is the only module that reads or writes them.

Running counts (PROTOCOL.md 8b; shared/tally_lib.lua): each queue, label and batch has a
hash of its jobs by state and of their items, moved by the same script or MULTI that
changes a job (enqueue, start, item writes, end, requeue, delete), so status reads a
count instead of every job. A job is counted where its hash's status says, and counted
out when its hash is deleted or found gone: RQ's TTL expiry is noticed by whoever meets
the entry (a listing's prune, the sweep), which also re-syncs jobs RQ itself moved (its
cleanup requeueing a dead worker's job) and that no vlmq script saw.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from redis import Redis, WatchError
from redis.client import Pipeline

from vlmq.shared import bounded_reads, lua, results
from vlmq.shared import constants as C
from vlmq.shared.keys import RQ_QUEUES, RQ_REGISTRIES, Keys
from vlmq.shared.messages import JobPayload
from vlmq.shared.redis_text import as_str

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
PAGE = 200  # entries read per round trip while walking an index
SCAN_COUNT = 1000
# A job's state, as RQ records it (its hash's `status`), and where RQ keeps jobs in it.
QUEUED = "queued"
REGISTRY_STATES = frozenset(RQ_REGISTRIES)
ITEMS_FIELD = C.ITEMS_FIELD  # the job hash's item count
# The states the running counts name (tally_lib.lua's TALLY.STATES, and "other" for any
# status a hand-written hash holds); the first three are ends end_job.lua writes.
ENDS = C.JOB_ENDS
TALLY_STATES = (*C.JOB_STATES, "other")
# The states with an index <prefix>:by-state:<state> (tally_lib.lua's TALLY.INDEXED):
# those RQ keeps no list or registry of; a listing by another state reads RQ's.
STATE_INDEXED = frozenset(s for s in TALLY_STATES if s != QUEUED and s not in REGISTRY_STATES)
SYNC_CHUNK = 100  # job ids synced per script call: each call stays well under a ms


@dataclass(frozen=True)
class Meta:
    """A job's listing summary, as stored in `<prefix>:jobs:meta`."""

    task: str
    items: int
    queue: str
    labels: dict[str, str] = field(default_factory=dict)
    # Enqueue time in epoch µs (RQ's created_at, exactly: jobs enqueued in one ms keep
    # their order), the job's score in every index; below 2**53, so exact as a score.
    created: int = 0
    # The batch the job is in: counted in the batch's counts; not part of the summary.
    batch: str | None = field(default=None, compare=False)

    def to_json(self) -> str:
        return json.dumps({"task": self.task, "items": self.items, "queue": self.queue,
                           "labels": self.labels, "created": self.created},
                          separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> Meta | None:
        """The summary, or None when missing or unreadable (a foreign writer's)."""
        if raw is None:
            return None
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        if not isinstance(d, Mapping):
            return None
        labels = d.get("labels")
        try:
            return cls(task=str(d.get("task", "?")), items=int(d.get("items", 0)),
                       queue=str(d.get("queue", "")),
                       labels={str(k): str(v) for k, v in labels.items()}
                       if isinstance(labels, Mapping) else {},
                       created=int(d.get("created", 0)))
        except (TypeError, ValueError, OverflowError):  # int() of 1e999 overflows
            return None


def meta_of(payload: JobPayload | Mapping[str, Any], queue: str, created_us: int) -> Meta:
    """The summary of a parsed payload, or of a payload dict read leniently."""
    if isinstance(payload, JobPayload):
        return Meta(task=payload.task, items=len(payload.items), queue=queue,
                    labels=dict(payload.labels), created=created_us, batch=batch_of(payload))
    items = payload.get("items")
    labels = payload.get("labels")
    task = payload.get("task")
    return Meta(task=task if isinstance(task, str) else "?",
                items=len(items) if isinstance(items, list) else 0, queue=queue,
                labels={str(k): str(v) for k, v in labels.items()}
                if isinstance(labels, Mapping) else {}, created=created_us,
                batch=batch_of(payload))


def batch_of(payload: JobPayload | Mapping[str, Any]) -> str | None:
    """The payload's batch id, or None."""
    batch = payload.get("batch")
    return batch if isinstance(batch, str) and batch else None


def us_of(when: datetime) -> int:
    """Epoch microseconds of a datetime (RQ's are naive UTC), exactly."""
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return (when - EPOCH) // timedelta(microseconds=1)


def parse_rq_time(text: str) -> datetime | None:
    """RQ's `%Y-%m-%dT%H:%M:%S.%fZ` (or without fraction) as an aware UTC time, else None."""
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        with contextlib.suppress(ValueError):
            return datetime.strptime(text, fmt).replace(tzinfo=UTC)
    return None


def us_of_rq_time(text: str) -> int | None:
    """Epoch µs of an RQ time (parse_rq_time), else None."""
    when = parse_rq_time(text)
    return None if when is None else us_of(when)


def count_keys(keys: Keys, meta: Meta) -> list[str]:
    """The running-count hashes a job is in (as enqueue.lua lists them)."""
    return [keys.counts_queue(meta.queue),
            *(keys.counts_label(k, v) for k, v in sorted(meta.labels.items())),
            *([keys.batch_counts(meta.batch)] if meta.batch else [])]


def tally_ensure(redis: Redis, keys: Keys, job_id: str, meta: Meta, *,
                 pipeline: Pipeline | Redis) -> None:
    """Count a job that is not yet (in the state its hash says); sync one that is."""
    lua.script(redis, lua.TALLY)(
        keys=[keys.jobs_tally],
        args=["ensure", job_id, meta.items, meta.created, *count_keys(keys, meta)],
        client=pipeline)


def tally_sync(redis: Redis, keys: Keys, job_ids: Sequence[str], *,
               pipeline: Pipeline | None = None) -> None:
    """Count each job where its hash says, or out when its hash is gone; queue it after
    the change on the change's MULTI (`pipeline`), else a round trip of its own."""
    if not job_ids:
        return
    pipe = pipeline if pipeline is not None else redis.pipeline(transaction=False)
    for i in range(0, len(job_ids), SYNC_CHUNK):
        lua.script(redis, lua.TALLY)(keys=[keys.jobs_tally],
                                     args=["sync", *job_ids[i:i + SYNC_CHUNK]], client=pipe)
    if pipeline is None:
        pipe.execute()


def index_keys(keys: Keys, meta: Meta) -> list[str]:
    """Every zset a job with this summary is in."""
    return [keys.jobs_index, keys.jobs_queue_index(meta.queue),
            *(keys.jobs_label_index(k, v) for k, v in sorted(meta.labels.items()))]


# --- writes ---------------------------------------------------------------------------------


def add(redis: Redis, keys: Keys, job_id: str, meta: Meta, *,
        pipeline: Pipeline | None = None) -> None:
    """Index a new job (queued on `pipeline`, the enqueue's MULTI, when given), write its
    item count into its RQ hash (ITEMS_FIELD), and count it (its queue's, labels' and
    batch's counts) in the state the MULTI leaves its hash in."""
    pipe = pipeline if pipeline is not None else redis.pipeline(transaction=True)
    for key in index_keys(keys, meta):
        pipe.zadd(key, {job_id: meta.created})
    pipe.hset(keys.jobs_meta, job_id, meta.to_json())
    pipe.hset(Keys.rq_job(job_id), ITEMS_FIELD, meta.items)
    tally_ensure(redis, keys, job_id, meta, pipeline=pipe)
    if pipeline is None:
        pipe.execute()


def ensure(redis: Redis, keys: Keys, job_id: str, payload: JobPayload | Mapping[str, Any],
           queue: str, created_us: int, *, pipeline: Pipeline | None = None) -> None:
    """Index a job that may not be (a producer wrote RQ's hash by hand, or it predates the
    indexes), as a worker does when it starts a job. Writes only (ZADD NX, HSETNX: an entry
    or summary already there is left as it is), so on the worker's `pipeline` it costs no
    round trip of its own. The job's counts are synced to its status (started, when a
    worker calls it), or it is counted from now on when it never was."""
    meta = meta_of(payload, queue, created_us)
    pipe = pipeline if pipeline is not None else redis.pipeline(transaction=True)
    for key in index_keys(keys, meta):
        pipe.zadd(key, {job_id: meta.created}, nx=True)
    pipe.hsetnx(keys.jobs_meta, job_id, meta.to_json())
    tally_ensure(redis, keys, job_id, meta, pipeline=pipe)
    if pipeline is None:
        pipe.execute()


def remove(redis: Redis, keys: Keys, job_id: str, meta: Meta | None, *,
           queue: str | None = None, pipeline: Pipeline | None = None) -> None:
    """Take a job out of every index (those its summary names, and `queue`'s), and out of
    its counts once its hash is gone (queue this after the hash's deletion)."""
    pipe = pipeline if pipeline is not None else redis.pipeline(transaction=True)
    zsets = {keys.jobs_index}
    if meta is not None:
        zsets.update(index_keys(keys, meta))
    if queue:
        zsets.add(keys.jobs_queue_index(queue))
    for key in sorted(zsets):
        pipe.zrem(key, job_id)
    pipe.hdel(keys.jobs_meta, job_id)
    pipe.delete(keys.job_failed(job_id))
    tally_sync(redis, keys, [job_id], pipeline=pipe)
    if pipeline is None:
        pipe.execute()


def prune(redis: Redis, keys: Keys, job_ids: Sequence[str]) -> int:
    """Remove entries whose job hash is gone (RQ's TTL expiry); returns how many.

    `job_ids` are those the caller found gone. Their hashes are WATCHed from a second
    check to the removal, so a job re-enqueued under the same id meanwhile keeps its
    entries (a lost race is simply left for the next reader or sweep).
    """
    if not job_ids:
        return 0
    with redis.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(*(Keys.rq_job(j) for j in job_ids))  # type: ignore[no-untyped-call]
            gone = list(job_ids)
            if pipe.exists(*(Keys.rq_job(j) for j in gone)):
                gone = [j for j, e in zip(gone, exist(redis, gone), strict=True) if not e]
            metas = read_meta(pipe, keys, gone)
            pipe.multi()
            for job_id, meta in zip(gone, metas, strict=True):
                remove(redis, keys, job_id, meta, pipeline=pipe)
            pipe.execute()
        except WatchError:
            return 0
    return len(gone)


def exist(redis: Redis, job_ids: Sequence[str]) -> list[bool]:
    """Whether each job's hash is there, in one round trip."""
    reads = redis.pipeline(transaction=False)
    for job_id in job_ids:
        reads.exists(Keys.rq_job(job_id))
    return [bool(x) for x in reads.execute()] if job_ids else []


def sweep(redis: Redis, keys: Keys, *, limit: int = 1000) -> int:
    """One step of the walk over `<prefix>:jobs` that removes jobs RQ's TTL deleted.

    Each call checks `limit` entries from where the last one stopped (a rank kept in
    `<prefix>:jobs:sweep`), oldest first, and starts over past the newest; so every entry
    is met within a lap however long the oldest jobs live. Returns how many went.
    """
    start = int(redis.get(keys.jobs_sweep) or 0)
    members: Any = redis.zrange(keys.jobs_index, start, start + limit - 1)
    if not members and start:
        start = 0
        members = redis.zrange(keys.jobs_index, 0, limit - 1)
    ids = [as_str(m) for m in members]
    exists = exist(redis, ids)
    gone = prune(redis, keys, [j for j, e in zip(ids, exists, strict=True) if not e])
    # Jobs RQ moved without a vlmq script (its cleanup requeueing a dead worker's job, its
    # stop command) are counted where their hashes say, a lap later at most.
    tally_sync(redis, keys, [j for j, e in zip(ids, exists, strict=True) if e])
    following = start + len(ids) - gone if len(ids) == limit else 0
    redis.set(keys.jobs_sweep, following)
    return gone


def reindex(redis: Redis, keys: Keys) -> int:
    """Index every job hash in this db that is not yet (a Redis holding jobs from before
    the indexes); a SCAN, for upgrades only. Returns how many job hashes were seen."""
    seen = 0
    batch: list[str] = []
    for raw in redis.scan_iter(match=Keys.rq_job_glob(), count=SCAN_COUNT, _type="HASH"):
        job_id = Keys.rq_job_id(as_str(raw))
        if job_id is not None:
            batch.append(job_id)
        if len(batch) >= SCAN_COUNT:
            seen += _reindex(redis, keys, batch)
            batch = []
    return seen + (_reindex(redis, keys, batch) if batch else 0)


def _reindex(redis: Redis, keys: Keys, ids: list[str]) -> int:
    reads = redis.pipeline(transaction=False)
    for job_id in ids:
        reads.hmget(Keys.rq_job(job_id), "origin", "created_at", "data")
    rows = reads.execute()
    known = redis.hmget(keys.jobs_meta, ids)
    pipe = redis.pipeline(transaction=False)
    for job_id, (origin, created, data), meta in zip(ids, rows, known, strict=True):
        data = results.stored_data(redis, keys, job_id, data)  # a finished job's moved payload
        meta_new = meta_of(loose_payload(data), as_str(origin or b""),
                           us_of_rq_time(as_str(created or b"")) or 0)
        if meta is None:
            for key in index_keys(keys, meta_new):
                pipe.zadd(key, {job_id: meta_new.created}, nx=True)
            pipe.hsetnx(keys.jobs_meta, job_id, meta_new.to_json())
        # Counted (jobs from before the counts), or synced when they are already.
        tally_ensure(redis, keys, job_id, meta_new, pipeline=pipe)
    pipe.execute()
    return len(ids)


def loose_payload(data: bytes | str | None) -> Mapping[str, Any]:
    """The payload dict of a job's `data`, or {}: JSON only, never unpickled, and read
    within shared/bounded_reads.py's bounds (a foreign writer's data may be a zlib bomb or
    hold an integer Python refuses to convert)."""
    if not data:
        return {}
    raw = data.encode() if isinstance(data, str) else data
    try:
        decoded = bounded_reads.loads(bounded_reads.inflate(raw, what="job data"), what="job data")
    except (bounded_reads.BoundError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if isinstance(decoded, list) and len(decoded) >= 3 and isinstance(decoded[2], list) \
            and decoded[2] and isinstance(decoded[2][0], Mapping):
        return decoded[2][0]
    return {}


# --- reads ----------------------------------------------------------------------------------


def read_meta(conn: Redis | Pipeline, keys: Keys, job_ids: Sequence[str]) -> list[Meta | None]:
    if not job_ids:
        return []
    return [Meta.from_json(raw) for raw in conn.hmget(keys.jobs_meta, list(job_ids))]


def newest_first(redis: Redis, key: str, *, page: int = PAGE) -> Iterator[list[str]]:
    """The members of one index zset, newest first, a page per round trip.

    Pages are taken by score, not rank, so entries pruned while walking shift nothing.
    """
    top: str = "+inf"
    skip: set[str] = set()  # entries at the boundary score already given
    while True:
        rows: Any = redis.zrevrangebyscore(key, top, "-inf", start=0, num=page + len(skip),
                                           withscores=True)
        fresh = [(as_str(m), s) for m, s in rows if as_str(m) not in skip]
        if not fresh:
            return
        yield [m for m, _ in fresh]
        if len(rows) < page + len(skip):
            return
        low = fresh[-1][1]
        skip = {m for m, s in fresh if s == low} | (skip if str(low) == top else set())
        top = repr(low)


def state_members(redis: Redis, state: str, queues: Iterable[str]) -> list[str] | None:
    """The job ids RQ keeps in `state` over `queues` (its queue list for queued, its
    registry otherwise), or None for a state RQ keeps nowhere (stopped, anything else)."""
    if state != QUEUED and state not in REGISTRY_STATES:
        return None
    pipe = redis.pipeline(transaction=False)
    for q in queues:
        if state == QUEUED:
            pipe.lrange(Keys.rq_queue(q), 0, -1)
        else:
            pipe.zrange(Keys.rq_registry(state, q), 0, -1)
    out: list[str] = []
    for members in pipe.execute():
        out += [as_str(m).split(":", 1)[0] for m in members]  # wip: <job>:<execution>
    return list(dict.fromkeys(out))


def state_size(redis: Redis, state: str, queues: Iterable[str]) -> int | None:
    """How many entries state_members would read, or None as there."""
    if state != QUEUED and state not in REGISTRY_STATES:
        return None
    pipe = redis.pipeline(transaction=False)
    for q in queues:
        if state == QUEUED:
            pipe.llen(Keys.rq_queue(q))
        else:
            pipe.zcard(Keys.rq_registry(state, q))
    return sum(int(n) for n in pipe.execute())


def all_queues(redis: Redis) -> list[str]:
    return sorted(Keys.rq_name(as_str(k)) for k in redis.smembers(RQ_QUEUES))


def by_score_desc(redis: Redis, keys: Keys, job_ids: Sequence[str]) -> list[str]:
    """Indexed ones of `job_ids`, newest first (jobs not indexed are left out)."""
    if not job_ids:
        return []
    scores = redis.zmscore(keys.jobs_index, list(job_ids))
    ranked = [(s, j) for j, s in zip(job_ids, scores, strict=True) if s is not None]
    ranked.sort(reverse=True)
    return [j for _, j in ranked]


def queued_items(redis: Redis, keys: Keys, queue: str) -> int:
    """Items of the jobs counted queued in `queue`: one HGET of its running counts,
    whatever the queue's length (a job written by hand, with no count record, is counted
    once a worker starts it or `vlmq reindex` indexes it)."""
    return int(redis.hget(keys.counts_queue(queue), "queued_items") or 0)


@dataclass(frozen=True)
class Counts:
    """One running-counts hash: jobs by state and their items (PROTOCOL.md 8b)."""

    jobs: int = 0
    items: int = 0
    done: int = 0
    failed: int = 0
    by_state: dict[str, int] = field(default_factory=dict)
    items_by_state: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, raw: Mapping[Any, Any]) -> Counts:
        """From HGETALL's reply (states with no job left out)."""
        d = {as_str(k): int(v) for k, v in raw.items()}
        return cls(jobs=d.get("jobs", 0), items=d.get("items", 0),
                   done=d.get("items_done", 0), failed=d.get("items_failed", 0),
                   by_state={s: d[s] for s in sorted(TALLY_STATES) if d.get(s)},
                   items_by_state={s: d[f"{s}_items"] for s in sorted(TALLY_STATES)
                                   if d.get(f"{s}_items")})

    @property
    def live(self) -> int:
        """Jobs in a state no end was written for (queued, started, ...)."""
        return sum(n for s, n in self.by_state.items() if s not in ENDS)

    def summary(self) -> dict[str, Any]:
        """As job_admin.summarize gives it: jobs, by_status, items done/failed/total."""
        return {"jobs": self.jobs, "by_status": dict(self.by_state),
                "items": {"done": self.done, "failed": self.failed, "total": self.items}}


def read_counts(conn: Redis | Pipeline, key: str) -> Any:
    """One running-counts hash (Counts.of the reply; on a pipeline, queued)."""
    raw = conn.hgetall(key)
    return Counts.of(raw) if isinstance(raw, Mapping) else raw
