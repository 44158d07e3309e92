"""Sets of any size: a set larger than one job becomes several jobs under one batch.

Why jobs of JOB_ITEMS (500) items, not the 10,000 a job may hold: a worker takes up to
`max(4, max_batch)` jobs at once (worker/loop.py) and works shortest-remaining-first
(worker/item_order.py), so it finishes its jobs one after another while the others it took
wait on it. With 10,000-item jobs one worker could sit on 80,000 items while the next
worker idles; with 500, what one worker holds back is a few thousand items, a free job
slot comes round every 500 items, and a small job from another producer waits for that
(minutes), not for a 10,000-page job. A job that fails for good (a poison page, spent
crash retries) takes 500 items with it, not 10,000. The cost is one RQ job and a few
small keys per 500 items: 2,000 jobs for a million pages.

A job's items of one file stay together: files are packed whole into jobs, and only a file
with more pages than a job holds is cut, into runs of JOB_ITEMS pages in order.

The batch record (shared/keys.py: batch, batch_jobs, batch_pending, and each job's
job_batch) is written in one transaction before the first job is enqueued, with every
job id the batch will have, so the batch cannot end until its last job has been enqueued
and has ended. end_job.lua counts each job's end once and writes the batch's terminal
event; a job that never got enqueued (the producer stopped) stays pending until the batch
is canceled or deleted, which counts it out (job_admin.abandon).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vlmq.producer import defaults, job_admin
from vlmq.producer.errors import JobNotFound
from vlmq.producer.options import JobOptions
from vlmq.shared import constants as C
from vlmq.shared import job_index
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.keys import BATCH_ID_PREFIX, Keys
from vlmq.shared.messages import Item, ItemResult, utc_now_iso
from vlmq.shared.redis_text import as_str

if TYPE_CHECKING:
    from vlmq.producer.client import Client, Job
    from vlmq.producer.inputs import Prepared  # (file checks: imported where sets are split)
    from vlmq.producer.progress import ShowProgress

JOB_ITEMS = defaults.JOB_ITEMS  # defined where the CLI's help reads it cheaply


class BatchNotFound(JobNotFound):
    """No batch record with this id: never made here, deleted, or expired."""

    def __init__(self, batch_id: str) -> None:
        super().__init__(batch_id)
        self.args = (f"batch {batch_id} not found (wrong id or Redis db, or it expired)",)


@dataclass(frozen=True)
class Part:
    """One job of a set: its task, its items and its options."""

    task: str
    prepared: Prepared
    options: JobOptions


def new_set_id() -> str:
    return BATCH_ID_PREFIX + uuid.uuid4().hex


def check_job_size(size: int) -> int:
    if not 1 <= size <= C.MAX_ITEMS_PER_JOB:
        raise PayloadError("job_size", f"must be between 1 and {C.MAX_ITEMS_PER_JOB}, "
                                       f"got {size}")
    return size


def _runs(items: Sequence[Item]) -> Iterator[list[Item]]:
    """Consecutive items of one file (a PDF's pages), in order."""
    run: list[Item] = []
    for item in items:
        if run and item.source != run[-1].source:
            yield run
            run = []
        run.append(item)
    if run:
        yield run


def split_items(items: Sequence[Item], size: int = JOB_ITEMS, *,
                max_bytes: int | None = None,
                blob_sizes: Mapping[str, int] | None = None) -> list[list[Item]]:
    """Items in jobs of at most `size`, in order; a file's items stay in one job unless
    the file alone has more than `size`, which is then cut into runs of `size`.

    With `max_bytes`, a job also ends before its uploads (`blob_sizes`, by sha256) would
    pass it, so a set of big PDFs still moves through a producer's upload budget in
    several jobs (a single file larger than that is a job of its own)."""
    check_job_size(size)
    sizes = blob_sizes or {}
    jobs: list[list[Item]] = []
    current: list[Item] = []
    held = 0
    for run in _runs(items):
        cost = sizes.get(run[0].blob or "", 0)  # a run is one file: one upload at most
        if current and (len(current) + len(run) > size
                        or (max_bytes is not None and held + cost > max_bytes)):
            jobs.append(current)
            current, held = [], 0
        held += cost
        at = 0  # a long run is cut by index: slicing off its head each time is quadratic
        while len(run) - at > size:
            jobs.append(run[at:at + size])
            at += size
        current.extend(run[at:])
    if current:
        jobs.append(current)
    return jobs


def split_prepared(prepared: Prepared, size: int = JOB_ITEMS, *,
                   max_bytes: int | None = None) -> list[Prepared]:
    """`prepared` as one Prepared per job, each with only the blobs its items use.

    Each job's blobs are looked up from its own items, so the split costs the set's size
    once (walking every blob per job cost jobs x blobs)."""
    from vlmq.producer.inputs import Prepared

    out = []
    blobs = prepared.blobs
    sizes = {sha: src.size for sha, src in blobs.items()}
    for chunk in split_items(prepared.items, size, max_bytes=max_bytes, blob_sizes=sizes):
        needed = dict.fromkeys(i.blob for i in chunk if i.blob is not None and i.blob in blobs)
        out.append(Prepared(items=chunk, blobs={sha: blobs[sha] for sha in needed}))
    return out


# --- the record ---------------------------------------------------------------------------


def split_for(client: Client, prepared: Prepared, size: int = JOB_ITEMS) -> list[Prepared]:
    """`prepared` cut into jobs of at most `size` items whose uploads fit the client's
    budget (Uploader.job_bytes; a single larger file alone): the one cut every producer
    path takes (submit_parts, so manifests, OpenAI batch files, retries, schedules and
    sets; stream_sets for streamed folders), so no path can make a job the budget cannot
    hold."""
    return split_prepared(prepared, size, max_bytes=client.uploads.job_bytes)


# More fields for a batch's record, from its final parts and their job ids (an OpenAI
# batch file's input order and skipped lines: producer/openai_files.py).
RecordFields = Callable[[Sequence[Part], Sequence[str]], Mapping[str, str]]
# The record's own fields: what a Batch handle reads (never its callers' extra ones).
_BATCH_FIELDS = ("task", "items", "created_at", "labels")


def _record(client: Client, batch_id: str, parts: Sequence[Part], job_ids: Sequence[str],
            labels: Mapping[str, str], extra: Mapping[str, str] | None = None) -> None:
    """The batch record and each job's batch key, in one transaction, before any job."""
    keys = client.keys
    tasks = sorted({p.task for p in parts})
    ttl = max(max(p.options.result_ttl for p in parts), C.FAILURE_TTL_S)
    pipe = client.redis.pipeline(transaction=True)
    fields: dict[str, str | int] = {
        "task": tasks[0] if len(tasks) == 1 else ",".join(tasks),
        "created_at": utc_now_iso(), "labels": json.dumps(dict(labels)),
        "items": sum(len(p.prepared.items) for p in parts), "jobs": len(parts),
        "ttl": ttl, **(extra or {})}
    pipe.hset(keys.batch(batch_id), mapping=fields)  # type: ignore[arg-type]
    pipe.rpush(keys.batch_jobs(batch_id), *job_ids)
    pipe.sadd(keys.batch_pending(batch_id), *job_ids)
    for job_id in job_ids:
        pipe.set(keys.job_batch(job_id), batch_id)
    pipe.execute()


def submit_parts(client: Client, parts: Sequence[Part], *,
                 rejected: Sequence[tuple[str, str]] = (),
                 not_media: Sequence[tuple[str, str, str]] = (),
                 labels: Mapping[str, str] | None = None, batch: bool = False,
                 record: RecordFields | None = None) -> Job | Batch:
    """One job as it is, or several under a new batch (each job through Client.submit).
    With `batch` even one job gets a batch record, and `record` adds fields to it.

    Every payload is checked before anything is written. A job that cannot be enqueued
    (an upload refused, Redis down) counts out itself and the jobs after it, so the batch
    still ends once the jobs before it have, and the error is raised.
    """
    if not parts:
        raise InputError("(no files)", "nothing to enqueue")
    # The budget's cut, here where every path meets: a part keeps its items (each is at
    # most a job already) and becomes several jobs only when its uploads pass job_bytes.
    parts = [Part(p.task, piece, p.options) for p in parts
             for piece in split_for(client, p.prepared, C.MAX_ITEMS_PER_JOB)]
    if len(parts) == 1 and not batch:
        job = client.submit(parts[0].task, parts[0].prepared, parts[0].options)
        job.rejected = list(rejected)
        job.not_media = list(not_media)
        return job
    _check_parts(parts)
    batch_id = new_set_id()
    job_ids = [uuid.uuid4().hex for _ in parts]
    shown = labels if labels is not None else parts[0].options.labels
    _record(client, batch_id, parts, job_ids, shown,
            None if record is None else record(parts, job_ids))
    pending = client.keys.batch_pending(batch_id)
    jobs: list[Job] = []
    try:
        for part, job_id in zip(parts, job_ids, strict=True):
            if not client.redis.sismember(pending, job_id):
                continue  # the batch was canceled while this producer was enqueueing it
            jobs.append(client.submit(part.task, part.prepared,
                                      part.options.with_(batch=batch_id, job_id=job_id)))
    finally:
        _count_out(client, pending, job_ids, {j.id for j in jobs})
    blobs = {sha for p in parts for sha in p.prepared.blobs}
    return Batch(client, batch_id, jobs=jobs, rejected=rejected, blobs=len(blobs),
                 not_media=not_media)


def _check_parts(parts: Sequence[Part]) -> None:
    """Refuse the set before anything is written: a job id cannot name several jobs, and
    every part's payload must be valid."""
    for part in parts:
        if part.options.job_id is not None:
            raise PayloadError("job_id", f"names one job, and this set makes {len(parts)} "
                                         "jobs (drop --job-id, or raise --job-size)")
        part.options.payload(part.task, part.prepared.items)


def _count_out(client: Client, pending: str, job_ids: Sequence[str],
               enqueued: set[str]) -> None:
    """Count out the batch's jobs that were not enqueued (an error, Ctrl-C), so the batch
    still ends once the others have."""
    for job_id in job_ids:
        if job_id not in enqueued and client.redis.sismember(pending, job_id) \
                and not client.redis.exists(Keys.rq_job(job_id)):
            job_admin.abandon(client.redis, client.keys, job_id)


def submit_set(client: Client, task: str, prepared: Prepared, options: JobOptions, *,
               job_size: int = JOB_ITEMS) -> Job | Batch:
    """A prepared set as one job, or as a batch of jobs of at most `job_size` items."""
    parts = [Part(task, p, options) for p in split_prepared(prepared, job_size)]
    return submit_parts(client, parts, rejected=prepared.rejected,
                        not_media=prepared.not_media)


def is_batch(client: Client, some_id: str) -> bool:
    return bool(client.redis.exists(client.keys.batch(some_id)))


def expand(client: Client, ids: Iterable[str]) -> list[Job]:
    """Jobs for ids that are job ids or batch ids (a batch: its jobs in order, those still
    in Redis). Every id is checked first: JobNotFound names the first unknown one."""
    out: list[Job] = []
    for some_id in ids:
        if is_batch(client, some_id):
            out += Batch.load(client, some_id).jobs()
        else:
            out.append(client.job(some_id))
    return out


# --- the handle -----------------------------------------------------------------------------


class Batch:
    """Handle for a batch: its jobs in order, their summed status, waiting, results,
    cancel, retry and delete; every method reads Redis."""

    def __init__(self, client: Client, batch_id: str, *, jobs: Sequence[Job] | None = None,
                 rejected: Sequence[tuple[str, str]] = (), blobs: int = 0,
                 not_media: Sequence[tuple[str, str, str]] = ()) -> None:
        self.client = client
        self.id = batch_id
        self.rejected: list[tuple[str, str]] = list(rejected)
        self.not_media: list[tuple[str, str, str]] = list(not_media)
        self.blobs = blobs  # distinct uploaded inputs, when this handle made the batch
        self._jobs = list(jobs) if jobs is not None else None
        raw = client.redis.hmget(client.keys.batch(batch_id), _BATCH_FIELDS)
        if not any(raw):
            raise BatchNotFound(batch_id)
        record = {k: as_str(v) for k, v in zip(_BATCH_FIELDS, raw, strict=True)
                  if v is not None}
        self.task = record.get("task", "?")
        self.items = int(record.get("items", "0"))
        self.created_at = record.get("created_at", "")
        self.labels: dict[str, str] = json.loads(record.get("labels", "{}"))

    @classmethod
    def load(cls, client: Client, batch_id: str) -> Batch:
        """Handle for an existing batch; raises BatchNotFound."""
        return cls(client, batch_id)

    def __repr__(self) -> str:
        return f"Batch(id={self.id!r}, items={self.items})"

    @property
    def keys(self) -> Keys:
        return self.client.keys

    def job_ids(self) -> list[str]:
        """Every job id the batch was made with, in order (enqueued or not)."""
        return [as_str(j) for j in self.client.redis.lrange(self.keys.batch_jobs(self.id),
                                                            0, -1)]

    def jobs(self) -> list[Job]:
        """The batch's jobs still in Redis, in order."""
        ids = self.job_ids()
        present = {r.id for r in job_admin.read_rows(self.client.redis, self.keys, ids)}
        known = {j.id: j for j in self._jobs or ()}  # handles made at enqueue
        return [known.get(j) or self.client.job(j) for j in ids if j in present]

    def missing(self) -> list[str]:
        """Jobs that never got enqueued (the producer stopped) and still hold the batch
        open; cancel or delete the batch to count them out."""
        pending = {as_str(m) for m in self.client.redis.smembers(
            self.keys.batch_pending(self.id))}
        present = {r.id for r in job_admin.read_rows(self.client.redis, self.keys, sorted(pending))}
        return [j for j in self.job_ids() if j in pending and j not in present]

    def ended(self) -> dict[str, str] | None:
        """The batch's terminal event (PROTOCOL.md section 9), or None while it runs."""
        return _end_of(self.client.redis.xrange(self.keys.batch_events(self.id), count=1))

    def look(self) -> tuple[job_index.Counts, int, dict[str, str] | None]:
        """The batch's running counts, how many of its jobs have not ended, and its end:
        one round trip of three commands, whatever the batch's size."""
        pipe = self.client.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.batch_counts(self.id))
        pipe.scard(self.keys.batch_pending(self.id))
        pipe.xrange(self.keys.batch_events(self.id), count=1)
        raw, pending, entries = pipe.execute()
        return job_index.Counts.of(raw), int(pending), _end_of(entries)

    def status(self) -> dict[str, Any]:
        """Jobs by state, items done/failed/total, jobs never enqueued, and the end; from
        the batch's running counts (PROTOCOL.md 8b), so a 100k-job batch costs what a
        one-job batch does. Jobs deleted or expired are counted out, as they are gone."""
        counts, pending, end = self.look()
        summary = counts.summary()
        summary["items"]["total"] = self.items
        return {"batch": self.id, "task": self.task, "labels": self.labels,
                "created_at": self.created_at, "status": end["type"] if end else _unended(counts),
                **summary, "missing": max(0, pending - counts.live), "ended": end}

    def wait(self, timeout: float | None = None, progress: ShowProgress | None = None
             ) -> str:
        """Block until the batch has ended; returns its end (finished, failed or
        canceled). Raises WaitTimeout when `timeout` passes first.

        It follows the batch's counts (progress) and its events stream (the end), a few
        commands a poll whatever its size, never its jobs. A batch whose only unended
        jobs were never enqueued (its producer stopped) ends here as the others did.
        """
        from vlmq.producer.client import follow_batch

        return follow_batch(self, timeout=timeout, progress=progress)

    def results(self) -> Iterator[tuple[Job, ItemResult]]:
        """Every result written so far, job by job in batch order, items in order."""
        for job in self.jobs():
            for result in job.results():
                yield job, result

    def cancel(self) -> int:
        """Cancel every job that has not ended, and count out jobs never enqueued; returns
        how many were canceled."""
        canceled = 0
        for row in job_admin.read_rows(self.client.redis, self.keys, self.job_ids()):
            if row.status not in job_admin.ENDED:
                try:
                    job_admin.cancel(self.client.redis, self.keys, row.id)
                    canceled += 1
                except job_admin.CannotCancel:
                    continue  # it ended meanwhile
        for job_id in self.missing():
            job_admin.abandon(self.client.redis, self.keys, job_id)
        return canceled

    def retry(self, *, failed_only: bool = False) -> Job | Batch:
        """The jobs' retries as a new batch (labels carry retry_of=<this batch>); with
        failed_only, jobs with nothing failed or missing are left out."""
        parts: list[Part] = []
        for job in self.jobs():
            try:
                task, prepared, options = job.retry_request(failed_only=failed_only)
            except PayloadError:
                if failed_only:
                    continue  # nothing to retry in this job
                raise
            labels = {**options.labels, "retry_of": self.id}
            parts.append(Part(task, prepared, options.with_(labels=labels)))
        if not parts:
            raise PayloadError("items", f"batch {self.id} has no failed or missing items "
                                        "to retry")
        return submit_parts(self.client, parts, labels={**self.labels, "retry_of": self.id})

    def delete(self, *, purge_blobs: bool = False) -> int:
        """Delete every job and the batch record; returns blobs purged."""
        ids = [j.id for j in self.jobs()]
        for job_id in self.missing():
            job_admin.abandon(self.client.redis, self.keys, job_id)
        purged = self.client.delete(ids, purge_blobs=purge_blobs)
        self.client.redis.delete(self.keys.batch(self.id), self.keys.batch_jobs(self.id),
                                 self.keys.batch_pending(self.id),
                                 self.keys.batch_events(self.id),
                                 self.keys.batch_counts(self.id))
        return purged


# Job states that wait for a worker: a batch whose jobs are all in one has not started.
_WAITING = frozenset({"queued", "deferred", "scheduled"})


def _unended(counts: job_index.Counts) -> str:
    """A batch's state before its end: `queued` until a worker has started one of its jobs
    (or one ended, or an item is done), then `running`."""
    started = counts.done > 0 or any(s not in _WAITING for s in counts.by_state)
    return "running" if started else "queued"


def _end_of(entries: Any) -> dict[str, str] | None:
    """A batch's terminal event from XRANGE's reply, or None."""
    if not entries:
        return None
    return {as_str(k): as_str(v) for k, v in entries[0][1].items()}
