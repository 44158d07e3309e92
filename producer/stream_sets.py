"""A large set enqueued as it is walked: each job goes to Redis as soon as it is full.

Checking every file before enqueueing anything held the whole set in memory and kept the
workers idle while a million files were walked. Here files are checked one at a time and
packed into jobs as producer/job_sets.py packs them (the same split, run over what is held,
which is never more than a job or two beyond STREAM_AFTER_ITEMS).

When streaming starts, and what it changes. A set is held whole, exactly as before, until it
passes STREAM_AFTER_ITEMS items (sets smaller than that behave as they always did: a bad
file refuses the set before anything is written, every bad file listed). Streaming starts
past that only when no bad file has been found so far, or with skip_bad (bad files are left
out and reported at the end either way). Without skip_bad, a bad file found after the first
jobs were enqueued stops the set: nothing more is enqueued, the rest is still checked so
that every bad file is listed, and the error (StreamedInputErrors) says which batch holds
the jobs already queued. A rerun after the fix resumes from the workers' result cache.

The batch record grows with the set: the batch's first job id is written with the record,
and each further job's id is added (to the job list, the pending set, the job count and the
item count, in one transaction) before the job ahead of it is enqueued. The pending set
therefore always holds a job not yet enqueued until the last job is, so the batch cannot end
early, as PROTOCOL.md section 9 requires of a record written whole.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.client import Pipeline

from vlmq.producer import job_sets
from vlmq.producer.expand import iter_inputs
from vlmq.producer.files import LocalStores
from vlmq.producer.inputs import (
    InputErrors,
    NotMediaFile,
    Prepared,
    checked_pages,
    finished,
    not_media,
)
from vlmq.producer.options import JobOptions
from vlmq.producer.page_specs import PageSpec
from vlmq.shared import constants as C
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.messages import utc_now_iso
from vlmq.stores.backends import Stores

if TYPE_CHECKING:
    from vlmq.producer.client import Client, Job

# Items held before a set starts going to Redis: sets up to this size keep the whole-set
# refusal; past it the producer holds about this much (ten default jobs, a few MB).
STREAM_AFTER_ITEMS = 5000


class StreamedInputErrors(InputErrors):
    """Bad files found after the first jobs of a large set were enqueued."""

    def __init__(self, errors: list[InputError], batch_id: str, jobs: int, items: int
                 ) -> None:
        super().__init__(errors)
        self.batch_id = batch_id
        self.jobs = jobs
        self.items = items

    def __str__(self) -> str:
        return (super().__str__() + f"\nthe set was over {STREAM_AFTER_ITEMS} items, so its "
                f"first {self.jobs} job(s) ({self.items} items) were already enqueued as "
                f"batch {self.batch_id} when the first bad file was found, and nothing after "
                "it was; fix or remove these files and run the command again (pages already "
                "done come from the result cache), or pass --skip-bad")


@dataclass
class _Stream:
    """A batch being enqueued: the jobs queued so far and the one whose id is reserved."""

    client: Client
    task: str
    options: JobOptions
    batch_id: str = field(default_factory=job_sets.new_set_id)
    jobs: list[Job] = field(default_factory=list)
    reserved: list[str] = field(default_factory=list)  # ids in the record, in order
    items: int = 0
    blobs: int = 0
    last_blobs: set[str] = field(default_factory=set)
    stopped: bool = False  # canceled from outside, or a bad file without skip_bad

    def open(self, first: Prepared) -> None:
        """The record, naming the first job, in one transaction."""
        keys = self.client.keys
        pipe = self.client.redis.pipeline(transaction=True)
        pipe.hset(keys.batch(self.batch_id), mapping={
            "task": self.task, "created_at": utc_now_iso(),
            "labels": json.dumps(dict(self.options.labels)), "items": 0, "jobs": 0,
            "ttl": max(self.options.result_ttl, C.FAILURE_TTL_S)})
        self._reserve(pipe, first)
        pipe.execute()

    def _reserve(self, pipe: Pipeline, part: Prepared) -> None:
        """Name one more job in the record: its id, and its items in the totals."""
        job_id = uuid.uuid4().hex
        keys = self.client.keys
        pipe.rpush(keys.batch_jobs(self.batch_id), job_id)
        pipe.sadd(keys.batch_pending(self.batch_id), job_id)
        pipe.set(keys.job_batch(job_id), self.batch_id)
        pipe.hincrby(keys.batch(self.batch_id), "jobs", 1)
        pipe.hincrby(keys.batch(self.batch_id), "items", len(part.items))
        self.reserved.append(job_id)

    def send(self, part: Prepared, after: Prepared | None) -> None:
        """Enqueue `part` (its id reserved already), first reserving `after`'s id. The
        check that the batch still wants `part` and the reservation are one round trip (an
        id reserved in a batch canceled meanwhile is counted out by close)."""
        job_id = self.reserved[len(self.jobs)]
        pipe = self.client.redis.pipeline(transaction=True)
        pipe.sismember(self.client.keys.batch_pending(self.batch_id), job_id)
        if after is not None:
            self._reserve(pipe, after)
        if not pipe.execute()[0]:
            self.stopped = True  # the batch was canceled while this producer enqueued it
            return
        self.jobs.append(self.client.submit(
            self.task, part, self.options.with_(batch=self.batch_id, job_id=job_id),
            reserved=True))
        self.items += len(part.items)
        # Distinct blobs, as far as memory allows: a file cut across jobs shares its blob
        # with the job before (only the same bytes under two names far apart count twice).
        self.blobs += len(part.blobs.keys() - self.last_blobs)
        self.last_blobs = set(part.blobs)

    def close(self) -> None:
        """Count out the reserved ids never enqueued (an error, Ctrl-C, a stop)."""
        job_sets._count_out(self.client, self.client.keys.batch_pending(self.batch_id),
                            self.reserved, {j.id for j in self.jobs})


@dataclass
class _Held:
    """What is checked but not yet enqueued: the set so far, or once streaming, the jobs not
    yet full. `ready` is a full job held until the next one has an item (its id is
    reserved before it goes)."""

    prepared: Prepared = field(default_factory=Prepared)
    errors: list[InputError] = field(default_factory=list)
    not_media: list[NotMediaFile] = field(default_factory=list)  # kept across jobs
    ready: Prepared | None = None
    paged: bool = False  # an item with pages (PDF, TIFF) was seen
    bytes: int = 0  # of the uploads `prepared` holds, kept as they come (not summed per file)


def submit_paths(client: Client, task: str, paths: Iterable[str | os.PathLike[str]],
                 options: JobOptions, *, pages: PageSpec, recursive: bool, skip_bad: bool,
                 job_size: int, stores: Stores,
                 on_file: Callable[[int, int], None] | None = None) -> Job | job_sets.Batch:
    """Check and enqueue a set of files, folders and globs (module docstring: when jobs go
    before the whole set is checked). `on_file(done, 0)`: a file was checked (the total is
    not known while a set is walked)."""
    held = _Held()
    local = LocalStores(stores)
    stream: _Stream | None = None
    found = iter_inputs(paths, stores, recursive=recursive)
    try:
        for done, checked in enumerate(_checked(found, stores, pages, local, held), start=1):
            if on_file is not None:
                on_file(done, 0)
            if checked and stream is None and _may_stream(held, skip_bad, pages):
                stream = _start(client, task, options)
            if stream is not None and not stream.stopped:
                _flush(stream, held, job_size, skip_bad=skip_bad)
            elif stream is not None:
                held.prepared = Prepared()  # stopped: only the errors are still wanted
                held.bytes = 0
        if stream is None:
            held.prepared.not_media = held.not_media
            prepared = finished(held.prepared, held.errors, skip_bad=skip_bad, pages=pages)
            return job_sets.submit_set(client, task, prepared, options, job_size=job_size)
        return _finish(stream, held, job_size, skip_bad=skip_bad)
    finally:
        if stream is not None:
            stream.close()


def _checked(found: Iterator[object], stores: Stores, pages: PageSpec, local: LocalStores,
             held: _Held) -> Iterator[bool]:
    """Check each found file into `held`; yields whether it became items."""
    for f in found:
        if isinstance(f, InputError):
            held.errors.append(f)
            yield False
            continue
        try:
            checked, page_list = checked_pages(f, stores, pages, local)  # type: ignore[arg-type]
        except InputError as exc:
            left_out = not_media(f, exc)  # type: ignore[arg-type]
            if left_out is not None:
                held.not_media.append(left_out)
            else:
                held.errors.append(exc)
            yield False
            continue
        held.paged = held.paged or checked.kind in C.PAGED_KINDS
        blobs = len(held.prepared.blobs)
        held.prepared.add(checked, page_list)
        if len(held.prepared.blobs) > blobs:
            held.bytes += checked.size
        yield True


def _may_stream(held: _Held, skip_bad: bool, pages: PageSpec) -> bool:
    """Past STREAM_AFTER_ITEMS, with nothing bad so far (or skip_bad), and a page range
    known to select something."""
    return (len(held.prepared.items) > STREAM_AFTER_ITEMS
            and (skip_bad or not held.errors) and (pages is None or held.paged))


def _start(client: Client, task: str, options: JobOptions) -> _Stream:
    """A stream for a set now known to make several jobs; checked as _check_parts does."""
    if task not in C.TASKS:
        raise PayloadError("task", f"must be one of {list(C.TASKS)}, got {task!r}")
    if options.job_id is not None:
        raise PayloadError("job_id", "names one job, and this set makes several (drop "
                                     "--job-id, or raise --job-size)")
    return _Stream(client, task, options)


def _flush(stream: _Stream, held: _Held, job_size: int, *, skip_bad: bool) -> None:
    """Enqueue what is held that makes full jobs; a bad file without skip_bad stops it."""
    if held.errors and not skip_bad:
        stream.stopped = True
        held.prepared = Prepared()
        held.bytes = 0
        return
    if len(held.prepared.items) < job_size and held.bytes <= stream.client.uploads.job_bytes:
        return
    parts = job_sets.split_for(stream.client, held.prepared, job_size)
    held.prepared = parts.pop()  # the last may fill further
    held.bytes = sum(b.size for b in held.prepared.blobs.values())
    for part in parts:
        _send_ready(stream, held, part)


def _send_ready(stream: _Stream, held: _Held, part: Prepared | None) -> None:
    """Hold `part` as the next full job; the one held before it goes now."""
    if held.ready is None:
        if part is not None and not stream.reserved:
            stream.open(part)
        held.ready = part
        return
    before, held.ready = held.ready, part
    if not stream.stopped:
        stream.send(before, part)


def _finish(stream: _Stream, held: _Held, job_size: int, *, skip_bad: bool
            ) -> job_sets.Batch:
    """The rest of the set once it has all been walked, and the batch handle."""
    if held.errors and not skip_bad:
        stream.stopped = True
    if not stream.stopped:
        if held.prepared.items:
            for part in job_sets.split_for(stream.client, held.prepared, job_size):
                _send_ready(stream, held, part)
        _send_ready(stream, held, None)  # the last job: nothing after it to reserve
    if held.errors and not skip_bad:
        raise StreamedInputErrors(held.errors, stream.batch_id, len(stream.jobs), stream.items)
    return job_sets.Batch(stream.client, stream.batch_id, jobs=stream.jobs,
                          rejected=[(e.path, e.problem) for e in held.errors],
                          blobs=stream.blobs, not_media=held.not_media)
