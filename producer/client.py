"""Python client: enqueue OCR/caption/generate/extract jobs, follow them, read their results.

Order of work is validate everything, then upload blobs, then enqueue: a bad input
leaves Redis untouched, and a job never names a blob that is not there yet.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from rq import Worker
from rq.job import Job as RQJob
from rq.results import Result
from rq.serializers import JSONSerializer

from vlmq.producer import job_admin
from vlmq.producer.defaults import DEFAULT_MAX_PENDING_MB, JOB_ITEMS
from vlmq.producer.errors import JobNotFound, NotAJob
from vlmq.producer.fleet import read_fleet
from vlmq.producer.options import JOB_FIELDS, JobOptions
from vlmq.producer.progress import Progress, ShowProgress, StatusLines
from vlmq.producer.upload import Uploader
from vlmq.shared import constants as C
from vlmq.shared import extract_schema, redis_checks
from vlmq.shared.blobs import BlobStore
from vlmq.shared.connection import check_url, connect, transient
from vlmq.shared.constants import DEFAULT_REDIS_URL
from vlmq.shared.enqueue import (
    check_job_id,
    enqueue,
    fetch_job,
    payload_of,
    raw_exc_info,
)
from vlmq.shared.errors import PayloadError, VlmqError
from vlmq.shared.keys import (
    JOB_ID_SHAPE,
    QUEUE_SHAPE,
    RQ_QUEUES,
    IdShape,
    Keys,
    label_problem,
)
from vlmq.shared.messages import ItemResult, JobPayload
from vlmq.shared.redis_text import as_str
from vlmq.shared.results import count_done, read_end, read_items
from vlmq.shared.urls import redact_url

# The enqueue side (file checks, Pillow and PDFium through them, sets, stores) is
# imported by the methods that enqueue: a listing through the client pays for none of it
#.
if TYPE_CHECKING:
    from vlmq.producer import job_sets
    from vlmq.producer.chat import ChatStream, MessagesIn
    from vlmq.producer.inputs import Prepared
    from vlmq.producer.page_specs import PageSpec
    from vlmq.stores.backends import Stores

__all__ = ["DEFAULT_REDIS_URL", "Client", "Job", "JobFailed", "JobNotFound",
           "RedisUnreachable", "WaitTimeout", "check_redis_url", "follow_batch", "redact_url",
           "wait_all"]

log = logging.getLogger(__name__)

REDIS_URL_ENV = "REDIS_URL"
NO_MESSAGE = "failed (no exception recorded)"
# RQ statuses after which nothing more will happen to a job without someone acting.
TERMINAL = frozenset({"finished", "failed", "stopped", "canceled"})
POLL_S = 0.5
HASH_QUIET_S = 2.0  # hashing that takes longer shows "files hashed" progress
Inputs = Iterable[str | os.PathLike[str]] | str | os.PathLike[str]


class JobFailed(VlmqError):
    """A waited-on job ended in a state other than finished."""

    def __init__(self, job_id: str, status: str, error: str | None) -> None:
        self.job_id = job_id
        self.status = status
        self.error = error
        detail = f": {error.strip().splitlines()[-1]}" if error and error.strip() else ""
        super().__init__(f"job {job_id} {status}{detail}")


class RedisUnreachable(VlmqError):
    """A wait's deadline passed while Redis was unreachable (or mid-failover)."""

    def __init__(self, url: str, error: RedisError, timeout: float) -> None:
        self.error = error
        super().__init__(f"Redis at {redact_url(url)} still unreachable after {timeout:g}s: "
                         f"{error}")


class WaitTimeout(VlmqError, TimeoutError):
    """The wait deadline passed; `statuses` holds where each job stood."""

    def __init__(self, statuses: Mapping[str, str], done: int, total: int,
                 timeout: float) -> None:
        self.statuses = dict(statuses)
        self.done = done
        self.total = total
        pending = [j for j, s in self.statuses.items() if s not in TERMINAL]
        super().__init__(f"timed out after {timeout:g}s: {done}/{total} items done; "
                         f"still pending: {', '.join(pending)}")


@dataclass(frozen=True)
class QueueInfo:
    name: str
    queued: int
    started: int
    finished: int
    failed: int
    queued_items: int = 0  # items of the queued jobs (a job may hold thousands)
    queues: int = 1  # how many queues the row sums (the OTHER_QUEUES row: all not shown)


@dataclass(frozen=True)
class WorkerInfo:
    """An RQ worker and/or the live stats a vlmq worker publishes (whatever fields exist)."""

    name: str
    state: str | None
    queues: tuple[str, ...]
    stats: dict[str, str] = field(default_factory=dict)


class Client:
    def __init__(self, redis_url: str | None = None, *, prefix: str | None = None,
                 stores: Stores | None = None,
                 max_pending_mb: float = DEFAULT_MAX_PENDING_MB,
                 progress: StatusLines | None = None, allow_eviction: bool | None = None,
                 wait_timeout: float | None = None,
                 on_warning: Callable[[str], None] | None = None) -> None:
        """`stores`: this machine's stores (default: $VLMQ_STORES); files in them are
        enqueued by reference, not uploaded. `max_pending_mb`: this producer's uploads whose
        jobs have not ended stay under it (producer/upload.py); `progress`: told the status
        lines of a wait for workers (the CLI's cli/progress.StatusLines shows them).
        `wait_timeout`: a wait for room in that budget raises BudgetWaitTimeout after this
        many seconds (default: only once no live worker has served the pending jobs' queues
        for upload.UNSERVED_WAIT_S, 600 s). `allow_eviction` (default
        $VLMQ_ALLOW_EVICTION): enqueue on a Redis that may evict keys, with a warning,
        instead of refusing. `on_warning`: told that warning (default: logged, on this
        module's logger)."""
        self._stores = stores
        self.allow_eviction = allow_eviction
        self.on_warning = on_warning
        self._redis_checked = False
        self.redis_url = check_redis_url(
            redis_url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL)
        self.redis = connect(self.redis_url)
        self.keys = Keys(prefix) if prefix is not None else Keys.from_env()
        self.blobs = BlobStore(self.redis, self.keys)
        self.uploads = Uploader(self.redis, self.keys, max_pending_mb=max_pending_mb,
                                progress=progress, wait_timeout=wait_timeout)

    @property
    def stores(self) -> Stores:
        """Read from the environment only when an enqueue needs them: a bad VLMQ_STORES
        must not break `vlmq status`."""
        if self._stores is None:
            from vlmq.stores.backends import Stores

            self._stores = Stores.from_env()
        return self._stores

    def close(self) -> None:
        self.uploads.close()
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- enqueue ----------------------------------------------------------------------

    def ocr(self, paths: Inputs, pages: PageSpec = None, options: JobOptions | None = None,
            *, recursive: bool = False, skip_bad: bool = False, **values: Any) -> Job:
        """OCR PDFs (each selected page one item) and images (one page each).

        `pages` ("1-3,7" or a list of ints) applies to every PDF in `paths`. Options come
        as a JobOptions, or as its field names (queue=, max_tokens=, labels=, ...).
        """
        return self.submit("ocr", paths, _options(options, values), pages=pages,
                           recursive=recursive, skip_bad=skip_bad)

    def caption(self, paths: Inputs, *, recursive: bool = False, skip_bad: bool = False,
                options: JobOptions | None = None, **values: Any) -> Job:
        """Caption a set of files, folders or globs (a PDF: every page); with skip_bad
        see `job.rejected`, and for what folders held that is not media `job.not_media`."""
        return self.submit("caption", paths, _options(options, values), recursive=recursive,
                           skip_bad=skip_bad)

    def generate(self, paths: Inputs, prompt: str, *, recursive: bool = False,
                 skip_bad: bool = False, options: JobOptions | None = None,
                 **values: Any) -> Job:
        """Run one prompt over every image (and PDF page) in the set."""
        opts = _options(options, values).with_(prompt=prompt)
        return self.submit("generate", paths, opts, recursive=recursive, skip_bad=skip_bad)

    def extract(self, paths: Inputs, schema: Any, pages: PageSpec = None,
                options: JobOptions | None = None, *, recursive: bool = False,
                skip_bad: bool = False, **values: Any) -> Job:
        """Extract a JSON object per image and PDF/TIFF page, following `schema`: a dict,
        JSON text, or a pydantic model class or instance (its `model_json_schema()`).

        Each item's result carries the object as `json` (its text as `text`). A bad schema
        raises PayloadError naming the problem, before anything is uploaded.
        """
        opts = _options(options, values).with_(schema=extract_schema.as_schema(schema))
        return self.submit("extract", paths, opts, pages=pages, recursive=recursive,
                           skip_bad=skip_bad)

    def chat(self, messages: MessagesIn, *, image: str | os.PathLike[str] | bytes | None = None,
             system: str | None = None, max_tokens: int | None = None,
             temperature: float | None = None, stop: Sequence[str] | None = None,
             schema: Any = None, model: str | None = None, timeout: float | None = None,
             result_cache: str = "off", job_id: str | None = None) -> ChatStream:
        """Ask now: one conversation about at most one image, taken by a worker ahead of
        every bulk job; iterate the returned ChatStream for the text as it is decoded.

        `messages`: a question (str), with `image` a path or its bytes; or OpenAI-style
        message dicts (producer/chat.py chat_input). `schema` constrains the answer to a
        JSON Schema (the extract path). Raises NoWorker at once when no live worker
        serves the chat queue; the stream raises ChatError when the answer cannot come.
        """
        from vlmq.producer import chat

        return chat.chat(self, messages, image=image, system=system, max_tokens=max_tokens,
                         temperature=temperature, stop=stop, schema=schema, model=model,
                         timeout=timeout, result_cache=result_cache, job_id=job_id)

    def submit(self, task: str, inputs: Inputs | Prepared, options: JobOptions | None = None,
               *, pages: PageSpec = None, recursive: bool = False,
               skip_bad: bool = False, reserved: bool = False) -> Job:
        """Validate, upload what is missing, enqueue: the one path every job takes.

        `inputs` are paths (files, folders, globs) checked here, or items already
        prepared (a manifest, a retry). `reserved`: the options' job id is one the caller
        made for a batch it is enqueueing (producer/job_sets.py, stream_sets.py), whose
        queue it checked once for the set: neither is checked again per job.
        """
        from vlmq.producer.inputs import Prepared, prepare

        if task not in C.TASKS:
            raise PayloadError("task", f"must be one of {list(C.TASKS)}, got {task!r}")
        opts = options if options is not None else JobOptions()
        prepared = inputs if isinstance(inputs, Prepared) else prepare(
            _as_list(inputs), pages=pages, recursive=recursive, skip_bad=skip_bad,
            stores=self.stores)
        # The worker will run exactly this check; failing here keeps Redis untouched.
        wire, payload = opts.payload(task, prepared.items)
        queue = opts.queue_for(task)
        fresh = reserved and opts.job_id is not None
        if not fresh:
            self._refuse_new_queue(queue)
        if opts.job_id is not None and not fresh:
            self._refuse_taken_id(opts.job_id)
        self.check_redis()
        # Under this producer's budget, one bounded chunk of files in memory at a time;
        # uploads live UPLOAD_TTL_S until enqueue() holds them for the job.
        uploaded, uploaded_bytes = self.uploads.upload(list(prepared.blobs.values()),
                                                       blob_ttl=opts.blob_ttl)
        jid = enqueue(self.redis, payload, queue=queue, job_id=opts.job_id,
                      result_ttl=opts.result_ttl, wire=wire, keys=self.keys, fresh_id=fresh)
        self.uploads.enqueued(jid, len(payload.items), uploaded_bytes, queue=queue)
        return Job(self, jid, queue=queue, items=len(payload.items),
                   rejected=list(prepared.rejected), not_media=prepared.not_media,
                   uploaded=uploaded,
                   blobs=len({i.blob for i in payload.items if i.blob is not None}),
                   labels=payload.labels,
                   task=task)

    def submit_set(self, task: str, inputs: Inputs | Prepared,
                   options: JobOptions | None = None, *, pages: PageSpec = None,
                   recursive: bool = False, skip_bad: bool = False,
                   job_size: int = JOB_ITEMS,
                   progress: ShowProgress | None = None) -> Job | job_sets.Batch:
        """A set of any size: one job when it fits in `job_size` items, else a Batch of
        jobs of at most `job_size` (producer/job_sets.py says why 500 by default).
        `progress`: opens the "files hashed" progress while a big folder is checked."""
        from vlmq.producer import job_sets, stream_sets
        from vlmq.producer.inputs import Prepared

        if task not in C.TASKS:
            raise PayloadError("task", f"must be one of {list(C.TASKS)}, got {task!r}")
        job_sets.check_job_size(job_size)
        self._refuse_new_queue((options or JobOptions()).queue_for(task))
        with ExitStack() as stack:
            shown: dict[str, Progress] = {}
            quiet_until = time.monotonic() + HASH_QUIET_S

            def on_file(done: int, total: int) -> None:
                if total <= 0 or ("bar" not in shown and time.monotonic() < quiet_until):
                    return  # a set checked within seconds needs no progress (a walked
                    # set's total is unknown: the uploader's lines say what is enqueued)
                if "bar" not in shown and progress is not None:
                    shown["bar"] = progress(stack, total, "files hashed")
                shown["bar"].update(done, final=done == total)

            if not isinstance(inputs, Prepared):
                # Checked and enqueued as walked: a large set's first job goes at once.
                return stream_sets.submit_paths(
                    self, task, _as_list(inputs), options or JobOptions(), pages=pages,
                    recursive=recursive, skip_bad=skip_bad, job_size=job_size,
                    stores=self.stores, on_file=on_file if progress is not None else None)
        return job_sets.submit_set(self, task, inputs, options or JobOptions(),
                                   job_size=job_size)

    def check_redis(self) -> None:
        """Before the first upload: raise EvictionRefused on an evicting Redis unless
        eviction is allowed (then one warning, to on_warning). Once per client."""
        if self._redis_checked:
            return
        warning = redis_checks.check_eviction(self.redis, self.allow_eviction)
        if warning and self.on_warning is not None:
            self.on_warning(warning)
        elif warning:
            log.warning("%s", warning)
        self._redis_checked = True

    def _refuse_new_queue(self, queue: str) -> None:
        """Refuse a queue rq:queues does not know once it holds C.MAX_QUEUES, before any
        upload: queue names are the caller's, and each one lives on in every listing.
        enqueue.lua makes the same check atomically; RQ's enqueue here has no such step,
        so producers racing to add new queues at the limit may pass it by one each."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.sismember(RQ_QUEUES, Keys.rq_queue(_checked(QUEUE_SHAPE, queue, "queue")))
        pipe.scard(RQ_QUEUES)
        known, count = pipe.execute()
        if not known and int(count) >= C.MAX_QUEUES:
            raise PayloadError("queue", f"{queue!r} would be a new queue, and vlmq keeps at "
                                        f"most {C.MAX_QUEUES} queues (rq:queues holds "
                                        f"{count}): use an existing queue")

    def batch(self, batch_id: str) -> job_sets.Batch:
        """Handle for an existing batch; raises BatchNotFound (a JobNotFound)."""
        from vlmq.producer import job_sets

        return job_sets.Batch.load(self, _checked(JOB_ID_SHAPE, batch_id, "batch_id"))

    def serving(self, queue: str) -> int:
        """How many live RQ workers listen on `queue`, counting those still starting
        (loading their model; PROTOCOL.md): 0 means a job there waits for one."""
        queue = _checked(QUEUE_SHAPE, queue, "queue")
        pipe = self.redis.pipeline(transaction=False)
        pipe.scard(Keys.rq_queue_workers(queue))
        pipe.scard(self.keys.queue_starting(queue))
        return sum(int(n) for n in pipe.execute())

    def _refuse_taken_id(self, job_id: str) -> None:
        """Refuse a taken id before uploading anything for a job that cannot be enqueued.

        Also catches an id whose RQ job is gone (deleted, expired) but whose item results
        are not: a new job under it would count them as its own and skip those items.
        The check that holds against a racing producer is the atomic one in enqueue().
        """
        check_job_id(job_id)
        if self.redis.exists(Keys.rq_job(job_id), self.keys.job_items(job_id)):
            raise PayloadError("job_id", f"a job with id {job_id} already exists")

    # --- inspect ----------------------------------------------------------------------

    def job(self, job_id: str) -> Job:
        """Handle for an existing job; raises JobNotFound (NotAJob where its key holds
        another Redis type than a hash: no command on it could answer).

        A job that is not a readable vlmq job (pickled data, a bad payload, a hash RQ
        cannot parse) still gets a handle, with `problem` saying why and `items` 0: its
        status and failure message are exactly what whoever asks about it needs.
        """
        found = as_str(self.redis.type(Keys.rq_job(_checked(JOB_ID_SHAPE, job_id, "job_id"))))
        if found == "none":
            raise JobNotFound(job_id)
        if found != "hash":
            raise NotAJob(job_id, found)
        try:
            rq_job = fetch_job(self.redis, job_id, self.keys)
        except PayloadError as exc:
            origin = self.redis.hget(Keys.rq_job(job_id), "origin")
            return Job(self, job_id, queue=as_str(origin or b""), items=0, problem=str(exc))
        try:
            payload = payload_of(rq_job)
        except PayloadError as exc:
            return Job(self, job_id, queue=rq_job.origin, items=0, problem=str(exc))
        return Job(self, job_id, queue=rq_job.origin, items=len(payload.items),
                   labels=payload.labels, task=payload.task)

    def jobs(self, *, queue: str | None = None, status: str | None = None,
             labels: Mapping[str, str] | None = None,
             limit: int | None = None) -> list[job_admin.JobRow]:
        """Jobs newest first, with items done/failed/total; filters combine (AND)."""
        if queue is not None:
            _checked(QUEUE_SHAPE, queue, "queue")
        _checked_labels(labels or {})
        return job_admin.list_jobs(self.redis, self.keys, queue=queue, status=status,
                                   labels=labels, limit=limit)

    def group_status(self, labels: Mapping[str, str]) -> dict[str, Any]:
        """Every job carrying all of `labels`, summed: jobs by state, items done/failed."""
        return job_admin.group_status(self.redis, self.keys, _checked_labels(labels))

    def cancel(self, job_id: str) -> None:
        """Cancel a queued or running job (terminal `canceled` event included)."""
        job_admin.cancel(self.redis, self.keys, _checked(JOB_ID_SHAPE, job_id, "job_id"))

    def delete(self, job_ids: Iterable[str], *, purge_blobs: bool = False) -> int:
        """Remove jobs with their results and events; returns blobs purged.

        With purge_blobs, blobs these jobs used go too unless a remaining job names them.
        All ids are checked first, so a typo deletes nothing.
        """
        ids = [_checked(JOB_ID_SHAPE, j, "job_id") for j in job_ids]  # all before Redis
        for job_id in ids:
            if not self.redis.exists(Keys.rq_job(job_id)):
                raise JobNotFound(job_id)
        used: set[str] = set()
        for job_id in ids:
            used |= job_admin.delete(self.redis, self.keys, job_id)
        return job_admin.purge_blobs(self.redis, self.keys, used) if purge_blobs else 0

    def queues(self, shown: int = C.MAX_SHOWN_QUEUES) -> dict[str, QueueInfo]:
        """The queues RQ knows of, with their depth (jobs and their items) and registry
        counts: at most `shown` rows, those with workers and the most jobs, the rest summed
        in one row named OTHER_QUEUES (its `queues` says how many), so the answer stays
        bounded whatever names Redis holds."""
        fleet = read_fleet(self.redis, self.keys, items=True, shown=shown, defaults=False,
                           ages=False)
        return {q.name: QueueInfo(name=q.name, queued=q.jobs["queued"],
                                  started=q.jobs["started"], finished=q.jobs["finished"],
                                  failed=q.jobs["failed"], queued_items=q.items or 0,
                                  queues=q.queues)
                for q in [*fleet.queues, *([fleet.other] if fleet.other else [])]}

    def workers(self) -> list[WorkerInfo]:
        """RQ workers merged by name with vlmq's published stats hashes."""
        rq_workers = {w.name: w for w in Worker.all(connection=self.redis,
                                                    serializer=JSONSerializer)}
        names = set(rq_workers)
        names.update(as_str(n) for n in self.redis.smembers(self.keys.workers))
        out: list[WorkerInfo] = []
        for name in sorted(names):
            raw = self.redis.hgetall(self.keys.worker_stats(name))
            stats = {as_str(k): as_str(v) for k, v in raw.items()}
            worker = rq_workers.get(name)
            if worker is None and not stats:
                continue  # stats expired and no RQ worker: it is gone
            out.append(WorkerInfo(
                name=name,
                state=str(worker.get_state()) if worker is not None else None,
                queues=tuple(worker.queue_names()) if worker is not None else (),
                stats=stats,
            ))
        return out


class Job:
    """Handle for one enqueued vlmq job; cheap to create, every method reads Redis."""

    def __init__(self, client: Client, job_id: str, *, queue: str, items: int,
                 rejected: Sequence[tuple[str, str]] = (), uploaded: int = 0,
                 blobs: int = 0, problem: str | None = None,
                 labels: Mapping[str, str] | None = None, task: str = "?",
                 not_media: Sequence[tuple[str, str, str]] = ()) -> None:
        self.client = client
        self.task = task
        self.id = job_id
        self.queue = queue
        self.items = items
        self.rejected: list[tuple[str, str]] = list(rejected)
        # Files its folders held that are not media, left out: (path, kind, reason).
        self.not_media: list[tuple[str, str, str]] = list(not_media)
        # Blobs newly written by this enqueue / distinct blobs the job uses.
        self.uploaded = uploaded
        self.blobs = blobs
        # Why this is not a readable vlmq job (None when it is); a worker will fail it.
        self.problem = problem
        # The payload's labels, echoed back as the protocol promises ({} for a job whose
        # payload cannot be read). Fixed at enqueue, so read once rather than per call.
        self.labels: dict[str, str] = dict(labels or {})

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, queue={self.queue!r}, items={self.items})"

    def status(self) -> str:
        raw = self.client.redis.hget(Keys.rq_job(self.id), "status")
        if raw is None:
            raise JobNotFound(self.id)
        return as_str(raw)

    def progress(self) -> tuple[int, int]:
        """(items done, items in the job); done counts failed items too."""
        return count_done(self.client.redis, self.client.keys, self.id), self.items

    def failed_items(self) -> int:
        return sum(1 for r in self.results() if not r.ok)

    def results(self) -> Iterator[ItemResult]:
        """Results written so far, in item order."""
        yield from read_items(self.client.redis, self.client.keys, self.id)

    def payload(self) -> JobPayload:
        return payload_of(fetch_job(self.client.redis, self.id, self.client.keys))

    def cancel(self) -> None:
        self.client.cancel(self.id)

    def delete(self, *, purge_blobs: bool = False) -> int:
        return self.client.delete([self.id], purge_blobs=purge_blobs)

    def retry(self, *, failed_only: bool = False) -> Job:
        """A new job with this one's settings over its items (failed_only: only the failed
        ones and those with no result); its labels carry `retry_of`.

        The inputs are this job's blobs, so nothing is read from disk; a blob that has
        expired is refused naming its source.
        """
        return self.client.submit(*self.retry_request(failed_only=failed_only))

    def retry_request(self, *, failed_only: bool = False
                      ) -> tuple[str, Prepared, JobOptions]:
        """What retry() submits (task, items, options), checked; a batch retries its jobs
        through it into a new batch."""
        from vlmq.producer.inputs import Prepared

        payload = self.payload()
        results = {r.index: r for r in self.results()}
        items = [item for i, item in enumerate(payload.items)
                 if not failed_only or i not in results or not results[i].ok]
        if not items:
            raise PayloadError("items", f"job {self.id} has no failed or missing items "
                                        "to retry")
        raw = self.client.redis.hmget(Keys.rq_job(self.id), list(JOB_FIELDS))
        opts = JobOptions.of_job(payload, {
            name: as_str(value) for name, value in zip(JOB_FIELDS, raw, strict=True)
            if value is not None})
        opts = opts.with_(labels={**payload.labels, "retry_of": self.id})
        blobs = BlobStore(self.client.redis, self.client.keys, ttl_s=opts.blob_ttl)
        for item in items:
            if item.blob is not None and not blobs.touch(item.blob):  # refs: in their store
                raise PayloadError("items", f"the input {item.source} has expired from "
                                            "Redis; enqueue it again from its file")
        return payload.task, Prepared(items=items), opts

    def _latest(self) -> Result | None:
        """RQ's latest Result, read from its results stream alone.

        A stand-in Job carries only the id: fetching the real one would parse the hash,
        which fails for exactly the jobs whose failure people most need to see.
        """
        if not self.client.redis.exists(Keys.rq_job(self.id)):
            raise JobNotFound(self.id)
        ref = RQJob(self.id, connection=self.client.redis, serializer=JSONSerializer)
        latest: Result | None = Result.fetch_latest(ref, serializer=JSONSerializer)
        return latest

    def _end(self) -> dict[str, Any] | None:
        """The terminal event the job hash keeps (end_job.lua), or None: the job has not
        ended, or ended before vlmq kept it there (RQ's results stream holds its end)."""
        return read_end(self.client.redis, self.client.keys, self.id)

    def summary(self) -> dict[str, Any] | None:
        """The job's summary (a JobSummary dict) once finished, else None: from the job
        hash's terminal event, else (a job finished by an older worker) RQ's result."""
        end = self._end()
        if end is not None:
            value = end.get("summary") if end["type"] == "finished" else None
            return dict(value) if isinstance(value, Mapping) else None
        result = self._latest()
        if result is None or result.type != Result.Type.SUCCESSFUL:
            return None
        value = result.return_value
        return dict(value) if isinstance(value, Mapping) else {"value": value}

    def error(self) -> str | None:
        """Why the job failed, or None while it has not.

        The `failed` event the job hash keeps holds the message as plain text; RQ keeps it
        too, in its results stream (latest_result().exc_string). A job whose hash RQ
        cannot load never gets a Result: the worker writes the reason to the hash's
        `exc_info` field instead, read here as plain text.
        """
        end = self._end()
        message = end.get("error") if end is not None and end["type"] == "failed" else None
        if isinstance(message, str):
            return message or NO_MESSAGE
        result = self._latest()
        if result is not None and result.type == Result.Type.FAILED:
            return result.exc_string or NO_MESSAGE
        if self.status() == "failed":
            return raw_exc_info(self.client.redis, self.id) or NO_MESSAGE
        return None

    def wait(self, timeout: float | None = None, progress: ShowProgress | None = None, *,
             check: bool = False) -> str:
        """Block until the job is finished/failed/stopped/canceled; returns that status.

        Raises WaitTimeout when `timeout` seconds pass first, and with check=True raises
        JobFailed for any end other than finished.
        """
        status = wait_all([self], timeout=timeout, progress=progress)[self.id]
        if check and status != "finished":
            raise JobFailed(self.id, status, self.error())
        return status


def wait_all(jobs: Sequence[Job], *, timeout: float | None = None,
             progress: ShowProgress | None = None, poll_s: float = POLL_S
             ) -> dict[str, str]:
    """Wait for several jobs at once; one progress bar over all their items.

    Sleeps by blocking on the jobs' event streams, so an item finishing wakes the bar
    at once while a silent job costs one status check per poll_s.

    Transient Redis errors (connection reset or refused, a failover in progress) are
    ridden out until `timeout`: a wait outlives a Redis restart. Raises RedisUnreachable
    when Redis is still unreachable at the deadline.
    """
    if not jobs:
        return {}
    client = jobs[0].client
    total = sum(j.items for j in jobs)
    deadline = None if timeout is None else time.monotonic() + timeout
    cursors: dict[Any, Any] = {client.keys.job_events(j.id): "0-0" for j in jobs}
    with ExitStack() as stack:
        shown = progress(stack, total, "items") if progress is not None else None
        while True:
            try:
                statuses, done, ended = _look(jobs, shown)
                if ended:
                    return statuses
                wait_s = _wait_s(deadline, poll_s)
                if wait_s <= 0:
                    raise WaitTimeout(statuses, done, total, timeout or 0.0)
                _follow_events(client, cursors, wait_s)
            except RedisError as exc:
                if not transient(exc):
                    raise
                _ride_out(client, exc, deadline, timeout, poll_s)


def follow_batch(batch: job_sets.Batch, *, timeout: float | None = None,
                 progress: ShowProgress | None = None, poll_s: float = POLL_S) -> str:
    """Wait for a batch's end by its running counts and its terminal event (Batch.wait):
    per poll one round trip of three commands and one blocking read of its events stream,
    which the end wakes at once. Redis outages are ridden out as in wait_all."""
    client = batch.client
    deadline = None if timeout is None else time.monotonic() + timeout
    with ExitStack() as stack:
        shown = progress(stack, batch.items, "items") if progress is not None else None
        while True:
            try:
                counts, _, end = batch.look()
                if end is None and counts.live == 0:  # left: jobs never enqueued, or none
                    end = {"type": next((s for s in ("failed", "canceled")
                                         if counts.by_state.get(s)), "finished")}
                if shown is not None:
                    shown.update(counts.done, final=end is not None)
                if end is not None:
                    return end["type"]
                wait_s = _wait_s(deadline, poll_s)
                if wait_s <= 0:
                    raise WaitTimeout({batch.id: "running"}, counts.done, batch.items,
                                      timeout or 0.0)
                _follow_events(client, {client.keys.batch_events(batch.id): "0-0"}, wait_s)
            except RedisError as exc:
                if not transient(exc):
                    raise
                _ride_out(client, exc, deadline, timeout, poll_s)


def _look(jobs: Sequence[Job], shown: Progress | None
          ) -> tuple[dict[str, str], int, bool]:
    """One look at every job: (statuses, items done, whether all have ended); the bar, when
    shown, moves to it."""
    statuses = {j.id: j.status() for j in jobs}
    done = sum(j.progress()[0] for j in jobs)
    ended = all(s in TERMINAL for s in statuses.values())
    if shown is not None:
        shown.update(done, final=ended)
    return statuses, done, ended


def _wait_s(deadline: float | None, poll_s: float) -> float:
    """How long to block now: poll_s, or less where the deadline is nearer (<= 0: passed)."""
    return poll_s if deadline is None else min(poll_s, deadline - time.monotonic())


def _ride_out(client: Client, exc: RedisError, deadline: float | None,
              timeout: float | None, poll_s: float) -> None:
    """Sleep a poll interval through a Redis outage, or raise RedisUnreachable when the
    deadline has passed. redis-py reconnects (and asks Sentinel again) on the next call."""
    wait_s = _wait_s(deadline, poll_s)
    if wait_s <= 0:
        raise RedisUnreachable(client.redis_url, exc, timeout or 0.0) from exc
    log.warning("Redis unavailable (%s); still waiting", exc)
    time.sleep(wait_s)


def _follow_events(client: Client, cursors: dict[Any, Any], wait_s: float) -> None:
    """Block until an event lands on one of the streams or `wait_s` passes; each stream's
    cursor moves past what came."""
    reply: Any = client.redis.xread(cursors, count=1000, block=max(1, int(wait_s * 1000)))
    for stream, entries in reply or []:
        if entries:
            cursors[as_str(stream)] = as_str(entries[-1][0])


def _checked(shape: IdShape, value: str, field: str) -> str:
    """`value` when it has `shape`'s form, else PayloadError naming it and the form: an
    id that holds ':' or a newline would name another key, so none is sent."""
    problem = shape.problem(value)
    if problem is not None:
        raise PayloadError(field, problem)
    return value


def _checked_labels(labels: Mapping[str, str]) -> Mapping[str, str]:
    """`labels` when each could be a stored label (label_problem), else PayloadError."""
    for key, value in labels.items():
        problem = label_problem(key, value)
        if problem is not None:
            raise PayloadError("labels", problem)
    return labels


def _options(options: JobOptions | None, values: Mapping[str, Any]) -> JobOptions:
    """A JobOptions from the wrappers' two forms; keywords override fields of `options`."""
    if options is None:
        return JobOptions.build(**values)
    return options.with_(**values) if values else options


def _as_list(paths: Inputs) -> list[str | os.PathLike[str]]:
    # A bare string is one path, not an iterable of one-character paths.
    if isinstance(paths, (str, os.PathLike)):
        return [paths]
    return list(paths)


def check_redis_url(url: str) -> str:
    """`url`, or ValueError naming it: redis-py's own message does not say which URL.
    Sentinel URLs (`redis+sentinel://`) are checked by vlmq.shared.connection."""
    return check_url(url)
