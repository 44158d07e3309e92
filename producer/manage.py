"""Managing many jobs: list them, sum a labelled group, cancel, delete, purge blobs.

Jobs are found by scanning RQ's job hashes (`rq:job:*`), so a job enqueued from any
language through enqueue.lua is listed too, and nothing extra has to be kept in step.
A job's task, labels and items are read leniently from its payload: a job whose payload
is unreadable is still listed (task "?") so it can be seen and deleted.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from vlmq.producer.errors import JobNotFound
from vlmq.shared import constants as C
from vlmq.shared import results as R
from vlmq.shared.blobs import BlobStore
from vlmq.shared.errors import PayloadError, VlmqError
from vlmq.shared.jobs import UNREADABLE_HASH_ERRORS
from vlmq.shared.keys import SHA256_RE, Keys
from vlmq.shared.results import end_job_event, ended_ttl
from vlmq.shared.text import as_str

SCAN_COUNT = 1000
ENDED = frozenset({"finished", "failed", "stopped", "canceled"})


class CannotCancel(VlmqError):
    def __init__(self, job_id: str, status: str) -> None:
        super().__init__(f"job {job_id} is already {status}; nothing to cancel")


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
    blobs: frozenset[str] = field(default_factory=frozenset)
    done: int = 0
    failed: int = 0

    def age_s(self, now: datetime | None = None) -> float | None:
        created = parse_rq_time(self.created_at)
        if created is None:
            return None
        return max(0.0, ((now or datetime.now(timezone.utc)) - created).total_seconds())

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "queue": self.queue, "task": self.task, "status": self.status,
                "created_at": self.created_at, "done": self.done, "failed": self.failed,
                "total": self.total, "labels": self.labels}


def parse_rq_time(text: str) -> datetime | None:
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        with contextlib.suppress(ValueError):
            return datetime.strptime(text, fmt).replace(tzinfo=timezone.utc)
    return None


def _loose_payload(data: bytes | None) -> Mapping[str, Any]:
    """The payload dict of a job's `data`, or {}: JSON only, never unpickled."""
    if not data:
        return {}
    with contextlib.suppress(zlib.error):
        data = zlib.decompress(data)
    try:
        decoded = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {}
    if isinstance(decoded, list) and len(decoded) >= 3 and isinstance(decoded[2], list) \
            and decoded[2] and isinstance(decoded[2][0], Mapping):
        return decoded[2][0]
    return {}


def _row(job_id: str, fields: list[Any]) -> JobRow:
    origin, status, created, data = fields
    payload = _loose_payload(data)
    raw_items = payload.get("items")
    items: list[Any] = raw_items if isinstance(raw_items, list) else []
    labels_raw = payload.get("labels")
    labels = ({str(k): str(v) for k, v in labels_raw.items()}
              if isinstance(labels_raw, Mapping) else {})
    blobs = frozenset(str(i["blob"]) for i in items
                      if isinstance(i, Mapping) and SHA256_RE.fullmatch(str(i.get("blob", ""))))
    task = payload.get("task")
    return JobRow(id=job_id, queue=as_str(origin or b""), task=task if isinstance(task, str)
                  else "?", status=as_str(status or b"?"), created_at=as_str(created or b""),
                  total=len(items), labels=labels, blobs=blobs)


def scan_jobs(redis: Redis) -> Iterator[JobRow]:
    """Every RQ job hash in this db, read in pipelined batches."""
    batch: list[str] = []
    for raw in redis.scan_iter(match=Keys.rq_job_glob(), count=SCAN_COUNT, _type="HASH"):
        job_id = Keys.rq_job_id(as_str(raw))
        if job_id is None:
            continue
        batch.append(job_id)
        if len(batch) >= SCAN_COUNT:
            yield from read_rows(redis, batch)
            batch = []
    if batch:
        yield from read_rows(redis, batch)


def read_rows(redis: Redis, ids: list[str]) -> Iterator[JobRow]:
    """The rows of these jobs, in one pipelined round trip; jobs not in Redis are left out."""
    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(Keys.rq_job(job_id), "origin", "status", "created_at", "data")
    for job_id, fields in zip(ids, pipe.execute(), strict=True):
        if fields[1] is not None or fields[0] is not None:  # deleted between SCAN and read
            yield _row(job_id, fields)


def with_counts(redis: Redis, keys: Keys, rows: list[JobRow]) -> list[JobRow]:
    """Rows with items done/failed filled in from their results hashes."""
    pipe = redis.pipeline(transaction=False)
    for row in rows:
        pipe.hvals(keys.job_items(row.id))
    out = []
    for row, values in zip(rows, pipe.execute(), strict=True):
        failed = 0
        for raw in values:
            with contextlib.suppress(ValueError, RecursionError):
                result = json.loads(raw)
                failed += isinstance(result, Mapping) and result.get("error") is not None
        out.append(JobRow(**{**row.__dict__, "done": len(values), "failed": failed}))
    return out


def matches(row: JobRow, *, queue: str | None = None, status: str | None = None,
            labels: Mapping[str, str] | None = None) -> bool:
    return ((queue is None or row.queue == queue)
            and (status is None or row.status == status)
            and all(row.labels.get(k) == v for k, v in (labels or {}).items()))


def list_jobs(redis: Redis, keys: Keys, *, queue: str | None = None,
              status: str | None = None, labels: Mapping[str, str] | None = None,
              limit: int | None = None) -> list[JobRow]:
    """Jobs newest first (RQ's created_at), filtered; item counts read for those shown."""
    rows = [r for r in scan_jobs(redis)
            if matches(r, queue=queue, status=status, labels=labels)]
    rows.sort(key=lambda r: (r.created_at, r.id), reverse=True)
    return with_counts(redis, keys, rows[:limit] if limit is not None else rows)


def group_status(redis: Redis, keys: Keys, labels: Mapping[str, str]) -> dict[str, Any]:
    """Totals over every job carrying all of `labels`: jobs by state, and items."""
    rows = with_counts(redis, keys, [r for r in scan_jobs(redis)
                                     if matches(r, labels=labels)])
    return {"labels": dict(labels), **summarize(rows)}


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
    """
    try:
        job = RQJob.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except NoSuchJobError:
        raise JobNotFound(job_id) from None
    except UNREADABLE_HASH_ERRORS as exc:
        raise PayloadError("", f"RQ cannot read job {job_id}'s hash; delete it instead "
                               f"({type(exc).__name__})") from exc
    status = str(job.get_status(refresh=False) or "")
    if status in ENDED:
        raise CannotCancel(job_id, status)
    pipe = redis.pipeline(transaction=True)
    pipe.multi()
    try:
        job.cancel(pipeline=pipe)
    except InvalidJobOperation as exc:
        raise CannotCancel(job_id, "canceled") from exc
    end_job_event(redis, keys, job_id, "canceled", queue=job.origin,
                  ttl_s=ended_ttl(job.result_ttl, C.RESULT_TTL_S), pipeline=pipe)
    pipe.execute()


def delete(redis: Redis, keys: Keys, job_id: str) -> frozenset[str]:
    """Remove a job, its item results, its events and RQ's results; returns its blobs.

    A job RQ cannot parse is removed key by key (and from its queue), so even garbage a
    foreign producer wrote can be cleaned up.
    """
    fields = redis.hmget(Keys.rq_job(job_id), "origin", "status", "created_at", "data")
    if fields[0] is None and fields[1] is None:
        raise JobNotFound(job_id)
    row = _row(job_id, fields)
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
    pipe.execute()
    BlobStore(redis, keys).release(job_id)  # a failed job's holds (an ended one has none)
    return row.blobs


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
    if status not in R.TERMINAL_EVENTS:
        pipe.hset(Keys.rq_job(job_id), "status", "canceled")
        status = "canceled"
    end_job_event(redis, keys, job_id, status, queue=queue or None, ttl_s=R.ENDED_MIN_TTL_S,
                  pipeline=pipe)


def _drop_keys(pipe: Pipeline, keys: Keys, job_id: str) -> None:
    pipe.delete(Keys.rq_job(job_id), Keys.rq_results(job_id), keys.job_items(job_id),
                keys.job_events(job_id), keys.job_owner(job_id), keys.job_risk(job_id),
                keys.job_kills(job_id), keys.job_batch(job_id))


def referenced_blobs(redis: Redis) -> set[str]:
    """Blobs named by any job still in Redis (whatever its state): those stay."""
    out: set[str] = set()
    for row in scan_jobs(redis):
        out |= row.blobs
    return out


def purge_blobs(redis: Redis, keys: Keys, candidates: set[str]) -> int:
    """Delete those of `candidates` that no remaining job refers to; returns how many went."""
    orphans = sorted(candidates - referenced_blobs(redis))
    if not orphans:
        return 0
    gone = int(redis.delete(*(keys.blob(sha) for sha in orphans)))
    redis.delete(*(keys.blob_jobs(sha) for sha in orphans))
    return gone
