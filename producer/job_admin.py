"""Managing many jobs: list them, sum a labelled group, cancel, delete, purge blobs.

Jobs are found through vlmq's indexes (shared/job_index.py), written at enqueue by
Python and by enqueue.lua alike, and their state through RQ's own hash and registries:
a listing reads only the rows it shows, never every job. A job's task, labels and items
come from its index summary; a job without one (indexed by `ensure`/`reindex`) is read
leniently from its payload, so an unreadable one is still listed (task "?").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import WatchError
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.executions import Execution
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from vlmq.producer.errors import JobNotFound
from vlmq.shared import constants as C
from vlmq.shared import job_index, results
from vlmq.shared.blobs import BlobStore
from vlmq.shared.enqueue import UNREADABLE_HASH_ERRORS
from vlmq.shared.errors import PayloadError, VlmqError
from vlmq.shared.keys import SHA256_RE, Keys
from vlmq.shared.redis_text import as_str
from vlmq.shared.results import end_job_event, ended_ttl

ENDED = frozenset({"finished", "failed", "stopped", "canceled"})
# Looks a cancel takes at a job that changes under it (it ends, a worker takes it or
# writes its heartbeat) before it gives up: each look is one WATCH, a few ms.
CANCEL_LOOKS = 10


class CannotCancel(VlmqError):
    def __init__(self, job_id: str, status: str) -> None:
        super().__init__(f"job {job_id} is already {status}; nothing to cancel")


class CancelContended(CannotCancel):
    """The job changed under every look: nothing was written; cancel it again."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id, "changing")
        self.args = (f"job {job_id} changed under {CANCEL_LOOKS} tries to cancel it; "
                     "nothing was changed: try again",)


class _ExecutionGone(Exception):
    """RQ's cancel met an execution its registry lists but whose record is gone."""


@dataclass(frozen=True)
class JobRow:
    """One job as `vlmq jobs` lists it."""

    id: str
    queue: str
    task: str
    status: str
    created_at: str
    total: int
    labels: dict[str, str]
    done: int = 0
    failed: int = 0

    def age_s(self, now: datetime | None = None) -> float | None:
        created = job_index.parse_rq_time(self.created_at)
        if created is None:
            return None
        return max(0.0, ((now or datetime.now(UTC)) - created).total_seconds())

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "queue": self.queue, "task": self.task, "status": self.status,
                "created_at": self.created_at, "done": self.done, "failed": self.failed,
                "total": self.total, "labels": self.labels}


def _blobs_of(payload: Mapping[str, Any]) -> frozenset[str]:
    raw_items = payload.get("items")
    items: list[Any] = raw_items if isinstance(raw_items, list) else []
    return frozenset(str(i["blob"]) for i in items
                     if isinstance(i, Mapping) and SHA256_RE.fullmatch(str(i.get("blob", ""))))


def _row(job_id: str, fields: list[Any], meta: job_index.Meta | None) -> JobRow:
    """A row from the job hash's origin, status, created_at (and data, read only when the
    job has no summary: enqueued before the indexes, or by hand)."""
    origin, status, created = fields[:3]
    if meta is None:
        meta = job_index.meta_of(job_index.loose_payload(fields[3] if len(fields) > 3 else None),
                                 as_str(origin or b""), 0)
    return JobRow(id=job_id, queue=as_str(origin or b"") or meta.queue, task=meta.task,
                  status=as_str(status or b"?"), created_at=as_str(created or b""),
                  total=meta.items, labels=meta.labels)


def read_rows(redis: Redis, keys: Keys, ids: Sequence[str],
              stale: list[str] | None = None) -> Iterator[JobRow]:
    """The rows of these jobs, in order, in one pipelined round trip (a second one only
    for jobs without a summary); jobs not in Redis are left out, and added to `stale`."""
    if not ids:
        return
    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(Keys.rq_job(job_id), "origin", "status", "created_at")
    pipe.hmget(keys.jobs_meta, list(ids))
    *hashes, raw_metas = pipe.execute()
    metas = [job_index.Meta.from_json(m) for m in raw_metas]
    bare = [j for j, f, m in zip(ids, hashes, metas, strict=True)
            if m is None and (f[0] is not None or f[1] is not None)]
    datas = dict(zip(bare, _datas(redis, keys, bare), strict=True)) if bare else {}
    for job_id, fields, meta in zip(ids, hashes, metas, strict=True):
        if fields[0] is None and fields[1] is None:  # gone: RQ's TTL, or deleted meanwhile
            if stale is not None:
                stale.append(job_id)
            continue
        yield _row(job_id, [*fields, datas.get(job_id)], meta)


def _datas(redis: Redis, keys: Keys, ids: list[str]) -> list[Any]:
    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(Keys.rq_job(job_id), "data")
    return [results.stored_data(redis, keys, job_id, data)  # a finished job's moved payload
            for job_id, data in zip(ids, pipe.execute(), strict=True)]


def with_counts(redis: Redis, keys: Keys, rows: list[JobRow]) -> list[JobRow]:
    """Rows with items done (HLEN of the results hash) and failed (SCARD of the failed
    set) filled in: no result is read."""
    pipe = redis.pipeline(transaction=False)
    for row in rows:
        pipe.hlen(keys.job_items(row.id))
        pipe.scard(keys.job_failed(row.id))
    counts = pipe.execute() if rows else []
    return [replace(row, done=int(counts[2 * i]), failed=int(counts[2 * i + 1]))
            for i, row in enumerate(rows)]


def matches(row: JobRow, *, queue: str | None = None, status: str | None = None,
            labels: Mapping[str, str] | None = None) -> bool:
    return ((queue is None or row.queue == queue)
            and (status is None or row.status == status)
            and all(row.labels.get(k) == v for k, v in (labels or {}).items()))


def _walkers(keys: Keys, *, queue: str | None, status: str | None,
             labels: Mapping[str, str]) -> tuple[list[str], str | None]:
    """The indexes that each hold every match, and the status still to look up in RQ's
    lists (None once a state index stands for it)."""
    walkers = [keys.jobs_queue_index(queue)] if queue else []
    walkers += [keys.jobs_label_index(k, v) for k, v in sorted(labels.items())]
    if status is not None and status != job_index.QUEUED \
            and status not in job_index.REGISTRY_STATES:
        # A state RQ keeps in no registry (stopped...): vlmq's index of the jobs counted
        # in it (PROTOCOL.md 8b) holds every match, so the whole index is never walked.
        walkers.append(keys.jobs_state_index(status))
        status = None
    return walkers or [keys.jobs_index], status


def _pages(redis: Redis, keys: Keys, *, queue: str | None, status: str | None,
           labels: Mapping[str, str], limit: int | None) -> Iterator[list[str]]:
    """Candidate ids, newest first, from the cheapest source that holds every match: the
    smallest of the job index, the queue's, the labels' and (a state RQ keeps nowhere)
    the state's, or for a status RQ's queue list or registries, when reading them whole
    costs less than walking the index until `limit` jobs in that state turn up (as many
    as expected from the two sizes)."""
    walkers, status = _walkers(keys, queue=queue, status=status, labels=labels)
    pipe = redis.pipeline(transaction=False)
    for key in walkers:
        pipe.zcard(key)
    sizes = [int(n) for n in pipe.execute()]
    walker = walkers[sizes.index(min(sizes))]
    if status is not None:
        queues = [queue] if queue else job_index.all_queues(redis)
        in_state = job_index.state_size(redis, status, queues)
        walked = min(sizes) if limit is None else min(
            min(sizes), limit * min(sizes) / max(in_state or 0, 1))
        if in_state is not None and in_state < walked:
            ids = job_index.by_score_desc(redis, keys,
                                          job_index.state_members(redis, status, queues) or [])
            for i in range(0, len(ids), job_index.PAGE):
                yield ids[i:i + job_index.PAGE]
            return
    yield from job_index.newest_first(redis, walker)


def list_jobs(redis: Redis, keys: Keys, *, queue: str | None = None,
              status: str | None = None, labels: Mapping[str, str] | None = None,
              limit: int | None = None, prune: bool = True) -> list[JobRow]:
    """Jobs newest first (by enqueue time), filtered; only the rows shown are read.

    Entries of jobs RQ's TTL deleted are never shown, and removed from the indexes as they
    are met unless `prune` is False (a reader that must not write: the dashboard).
    """
    wanted = dict(labels or {})
    rows: list[JobRow] = []
    for page in _pages(redis, keys, queue=queue, status=status, labels=wanted, limit=limit):
        stale: list[str] = []
        rows += [r for r in read_rows(redis, keys, page, stale)
                 if matches(r, queue=queue, status=status, labels=wanted)]
        if prune:
            job_index.prune(redis, keys, stale)
        if limit is not None and len(rows) >= limit:
            break
    return with_counts(redis, keys, rows[:limit] if limit is not None else rows)


def group_status(redis: Redis, keys: Keys, labels: Mapping[str, str]) -> dict[str, Any]:
    """Totals over every job carrying all of `labels`: jobs by state, and items.

    One label is one HGETALL of its running counts (PROTOCOL.md 8b), whatever its size.
    Several labels have no count of their own (one per combination would cost every
    enqueue a hash per subset): the jobs of the smallest of their indexes are read.
    """
    if len(labels) == 1:
        ((key, value),) = labels.items()
        counts = job_index.read_counts(redis, keys.counts_label(key, value))
        return {"labels": dict(labels), **counts.summary()}
    return {"labels": dict(labels), **summarize(list_jobs(redis, keys, labels=labels))}


def summarize(rows: list[JobRow]) -> dict[str, Any]:
    """Jobs by state and items done/failed/total, summed over `rows` (with counts)."""
    by_state: dict[str, int] = {}
    for row in rows:
        by_state[row.status] = by_state.get(row.status, 0) + 1
    return {"jobs": len(rows), "by_status": dict(sorted(by_state.items())),
            "items": {"done": sum(r.done for r in rows), "failed": sum(r.failed for r in rows),
                      "total": sum(r.total for r in rows)}}


def cancel(redis: Redis, keys: Keys, job_id: str) -> None:
    """Cancel a job and write its terminal `canceled` event in the same transaction.

    A queued job leaves its queue; a running one is dropped by its worker at the next
    ownership check (its heartbeat). Items already done stay readable.

    A cancel can race the job's end: the job hash is WATCHed from the status read to the
    EXEC, so a job that ends meanwhile is never turned `canceled`; the cancel looks again
    and answers CannotCancel (it ended), or cancels it (a worker only took it). An
    execution RQ's registry still lists after its record went (the end of that run, or
    its record's TTL) is dropped from the registries on the next look, so RQ's cancel
    never stops on it.
    """
    with redis.pipeline(transaction=True) as pipe:
        for look in range(CANCEL_LOOKS):
            try:
                _cancel_once(redis, keys, pipe, job_id, repair=look > 0)
                return
            except (WatchError, _ExecutionGone):
                continue
            finally:
                pipe.reset()
    raise CancelContended(job_id)


def _cancel_once(redis: Redis, keys: Keys, pipe: Pipeline, job_id: str, *,
                 repair: bool) -> None:
    pipe.watch(Keys.rq_job(job_id))  # type: ignore[no-untyped-call]
    job = _fetch_job(redis, job_id)
    # The hash's own text: str() of RQ's JobStatus would be "JobStatus.FINISHED".
    status = as_str(redis.hget(Keys.rq_job(job_id), "status") or b"")
    if status in ENDED:
        raise CannotCancel(job_id, status)
    if repair:
        _forget_lost_executions(redis, job)
    pipe.multi()
    try:
        job.cancel(pipeline=pipe)
    except InvalidJobOperation as exc:
        raise CannotCancel(job_id, "canceled") from exc
    except ValueError as exc:  # rq.executions: "Execution ... not found in Redis"
        raise _ExecutionGone(str(exc)) from exc
    end_job_event(redis, keys, job_id, "canceled", queue=job.origin,
                  ttl_s=ended_ttl(job.result_ttl, C.RESULT_TTL_S), pipeline=pipe)
    pipe.execute()


def _fetch_job(redis: Redis, job_id: str) -> RQJob:
    try:
        return RQJob.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except NoSuchJobError:
        raise JobNotFound(job_id) from None
    except UNREADABLE_HASH_ERRORS as exc:
        raise PayloadError("", f"RQ cannot read job {job_id}'s hash; delete it instead "
                               f"({type(exc).__name__})") from exc


def _forget_lost_executions(redis: Redis, job: RQJob) -> None:
    """Drop the executions the job's registries list whose records are gone: pointers to
    nothing, which RQ's cancel cannot read."""
    registry = job.execution_registry.key
    members: Any = redis.zrange(registry, 0, -1)
    ids = [as_str(e) for e in members]
    if not ids:
        return
    pipe = redis.pipeline(transaction=False)
    for execution_id in ids:
        pipe.exists(Execution(execution_id, job.id, connection=redis).key)
    gone = [e for e, there in zip(ids, pipe.execute(), strict=True) if not there]
    if gone:
        redis.zrem(registry, *gone)
        redis.zrem(job.started_job_registry.key, *(f"{job.id}:{e}" for e in gone))


def delete(redis: Redis, keys: Keys, job_id: str) -> frozenset[str]:
    """Remove a job, its item results, its events, RQ's results and its index entries;
    returns its blobs.

    A job RQ cannot parse is removed key by key (and from its queue), so even garbage a
    foreign producer wrote can be cleaned up.
    """
    fields = redis.hmget(Keys.rq_job(job_id), "origin", "status", "created_at", "data")
    if fields[0] is None and fields[1] is None:
        raise JobNotFound(job_id)
    meta = job_index.read_meta(redis, keys, [job_id])[0]
    row = _row(job_id, fields, meta)
    data = results.stored_data(redis, keys, job_id, fields[3])  # a finished job's moved payload
    try:
        job = RQJob.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except UNREADABLE_HASH_ERRORS:
        job = None
    pipe = redis.pipeline(transaction=True)
    _end_now(redis, keys, pipe, job_id, row.status, row.queue)
    if job is not None:
        job.delete(pipeline=pipe)
    elif row.queue:
        pipe.lrem(Keys.rq_queue(row.queue), 0, job_id)
    _drop_keys(pipe, keys, job_id)
    job_index.remove(redis, keys, job_id, meta, queue=row.queue, pipeline=pipe)
    pipe.execute()
    BlobStore(redis, keys).release(job_id)  # a failed job's holds (an ended one has none)
    return _blobs_of(job_index.loose_payload(data))


def abandon(redis: Redis, keys: Keys, job_id: str) -> None:
    """Count out a batch's job that was never enqueued (its producer stopped first), as a
    deleted one is, so the batch can still end."""
    pipe = redis.pipeline(transaction=True)
    _end_now(redis, keys, pipe, job_id, "", None)
    _drop_keys(pipe, keys, job_id)
    pipe.execute()


def _end_now(redis: Redis, keys: Keys, pipe: Pipeline, job_id: str, status: str,
             queue: str | None) -> None:
    """Queue the end of a job about to be deleted: one that has not ended becomes
    `canceled` first. Its end then goes through end_job.lua like any other (a no-op for a
    job whose end was written), so its batch counts it and waiters hear of it."""
    if status not in results.TERMINAL_EVENTS:
        pipe.hset(Keys.rq_job(job_id), "status", "canceled")
        status = "canceled"
    end_job_event(redis, keys, job_id, status, queue=queue or None, ttl_s=results.ENDED_MIN_TTL_S,
                  pipeline=pipe)


def _drop_keys(pipe: Pipeline, keys: Keys, job_id: str) -> None:
    pipe.delete(Keys.rq_job(job_id), Keys.rq_results(job_id), keys.job_items(job_id),
                keys.job_events(job_id), keys.job_owner(job_id), keys.job_risk(job_id),
                keys.job_kills(job_id), keys.job_batch(job_id), keys.job_end(job_id))


def purge_blobs(redis: Redis, keys: Keys, candidates: set[str]) -> int:
    """Delete those of `candidates` that no job holds any more; returns how many went.

    A blob's holders are its `<prefix>:blob-jobs:<sha>` zset (shared/blobs.py): a queued
    or running job holds it (score inf), a failed one until its record expires. No job
    is read.
    """
    wanted = sorted(candidates)
    if not wanted:
        return 0
    secs, micros = redis.time()
    now_ms = secs * 1000 + micros // 1000
    pipe = redis.pipeline(transaction=False)
    for sha in wanted:
        pipe.zrangebyscore(keys.blob_jobs(sha), now_ms, "+inf", start=0, num=1)
    orphans = [sha for sha, live in zip(wanted, pipe.execute(), strict=True) if not live]
    if not orphans:
        return 0
    gone = int(redis.delete(*(keys.blob(sha) for sha in orphans)))
    redis.delete(*(keys.blob_jobs(sha) for sha in orphans))
    return gone
