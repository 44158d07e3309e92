"""Python client: enqueue OCR/caption/generate jobs, follow them, read their results.

Order of work is validate everything, then upload blobs, then enqueue: a bad input
leaves Redis untouched, and a job never names a blob that is not there yet.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import click
from redis import ConnectionPool, Redis
from rq import Queue, Worker
from rq.job import Job as RQJob
from rq.results import Result
from rq.serializers import JSONSerializer

from vlmq.producer.inputs import PageSpec, Prepared, prepare
from vlmq.shared.blobs import BlobStore
from vlmq.shared.constants import DEFAULT_REDIS_URL
from vlmq.shared.errors import PayloadError, VlmqError
from vlmq.shared.jobs import (
    check_job_id,
    check_queue_name,
    enqueue,
    fetch_job,
    payload_of,
    raw_exc_info,
)
from vlmq.shared.keys import Keys
from vlmq.shared.results import count_done, read_items
from vlmq.shared.schema import Generation, Item, ItemResult, JobPayload, parse_payload
from vlmq.shared.text import as_str

__all__ = ["DEFAULT_REDIS_URL", "Client", "Job", "JobFailed", "JobNotFound", "WaitTimeout",
           "check_redis_url", "redact_url", "wait_all"]

REDIS_URL_ENV = "REDIS_URL"
NO_MESSAGE = "failed (no exception recorded)"
# RQ statuses after which nothing more will happen to a job without someone acting.
TERMINAL = frozenset({"finished", "failed", "stopped", "canceled"})
POLL_S = 0.5
UPLOAD_CHUNK = 256  # blobs per pipelined round trip when enqueueing


class JobNotFound(VlmqError):
    """No RQ job with this id: never enqueued here, or expired (result/failure TTL)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id} not found (wrong id or Redis db, or it expired)")


class JobFailed(VlmqError):
    """A waited-on job ended in a state other than finished."""

    def __init__(self, job_id: str, status: str, error: str | None) -> None:
        self.job_id = job_id
        self.status = status
        self.error = error
        detail = f": {error.strip().splitlines()[-1]}" if error and error.strip() else ""
        super().__init__(f"job {job_id} {status}{detail}")


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


@dataclass(frozen=True)
class WorkerInfo:
    """An RQ worker and/or the live stats a vlmq worker publishes (whatever fields exist)."""

    name: str
    state: str | None
    queues: tuple[str, ...]
    stats: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Settings:
    """What ocr/caption/generate take besides their inputs: how each item is processed."""

    prompt: str | None
    model: str | None
    max_side: int | None
    max_tokens: int | None
    temperature: float | None
    stop: Sequence[str] | None
    labels: Mapping[str, str] | None

    def payload(self, task: str, items: Sequence[Item]) -> JobPayload:
        return JobPayload(
            task=task,
            items=tuple(items),
            prompt=self.prompt,
            generation=Generation(max_tokens=self.max_tokens, temperature=self.temperature,
                                  stop=tuple(self.stop or ())),
            model=self.model,
            max_side=self.max_side,
            labels=dict(self.labels or {}),
        )


class Client:
    def __init__(self, redis_url: str | None = None, *, prefix: str | None = None) -> None:
        self.redis_url = check_redis_url(
            redis_url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL)
        self.redis = Redis.from_url(self.redis_url)
        self.keys = Keys(prefix) if prefix is not None else Keys.from_env()
        self.blobs = BlobStore(self.redis, self.keys)

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- enqueue ----------------------------------------------------------------------

    def ocr(self, paths: Iterable[str | os.PathLike[str]], pages: PageSpec = None, *,
            max_side: int | None = None, prompt: str | None = None, queue: str = "ocr",
            model: str | None = None, max_tokens: int | None = None,
            temperature: float | None = None, stop: Sequence[str] | None = None,
            labels: Mapping[str, str] | None = None, job_id: str | None = None) -> Job:
        """OCR PDFs (each selected page one item) and images (one page each).

        `pages` ("1-3,7" or a list of ints) applies to every PDF in `paths`.
        """
        settings = _Settings(prompt=prompt, model=model, max_side=max_side,
                             max_tokens=max_tokens, temperature=temperature, stop=stop,
                             labels=labels)
        return self._submit("ocr", prepare(_as_list(paths), pages=pages), settings,
                            queue=queue, job_id=job_id)

    def caption(self, paths: Iterable[str | os.PathLike[str]], *, recursive: bool = False,
                skip_bad: bool = False, prompt: str | None = None, queue: str = "caption",
                model: str | None = None, max_tokens: int | None = None,
                max_side: int | None = None, temperature: float | None = None,
                stop: Sequence[str] | None = None, labels: Mapping[str, str] | None = None,
                job_id: str | None = None) -> Job:
        """Caption a set of files, folders or globs; with skip_bad see `job.rejected`."""
        settings = _Settings(prompt=prompt, model=model, max_side=max_side,
                             max_tokens=max_tokens, temperature=temperature, stop=stop,
                             labels=labels)
        return self._submit("caption", prepare(_as_list(paths), recursive=recursive,
                                               skip_bad=skip_bad),
                            settings, queue=queue, job_id=job_id)

    def generate(self, paths: Iterable[str | os.PathLike[str]], prompt: str, *,
                 recursive: bool = False, skip_bad: bool = False, queue: str = "generate",
                 model: str | None = None, max_tokens: int | None = None,
                 max_side: int | None = None, temperature: float | None = None,
                 stop: Sequence[str] | None = None, labels: Mapping[str, str] | None = None,
                 job_id: str | None = None) -> Job:
        """Run one prompt over every image (and PDF page) in the set."""
        settings = _Settings(prompt=prompt, model=model, max_side=max_side,
                             max_tokens=max_tokens, temperature=temperature, stop=stop,
                             labels=labels)
        return self._submit("generate", prepare(_as_list(paths), recursive=recursive,
                                                skip_bad=skip_bad),
                            settings, queue=queue, job_id=job_id)

    def _submit(self, task: str, prepared: Prepared, settings: _Settings, *, queue: str,
                job_id: str | None) -> Job:
        """Check the payload, upload what is missing, enqueue: the part all tasks share."""
        # The worker will run exactly this check; failing here keeps Redis untouched.
        payload = parse_payload(settings.payload(task, prepared.items).to_dict())
        check_queue_name(queue)
        if job_id is not None:
            self._refuse_taken_id(job_id)
        uploaded = 0
        sources = list(prepared.blobs.values())
        # Two pipelined round trips per chunk instead of two or three per blob: 5,000
        # small files went from ~350 to thousands of items/s (benchmarks/run.py).
        for at in range(0, len(sources), UPLOAD_CHUNK):
            chunk = sources[at:at + UPLOAD_CHUNK]
            pipe = self.redis.pipeline(transaction=False)
            for source in chunk:
                self.blobs.touch(source.sha256, pipeline=pipe)
            present = pipe.execute()
            pipe = self.redis.pipeline(transaction=False)
            # Already stored (TTL now refreshed): nothing to read or send.
            missing = [src for src, hit in zip(chunk, present, strict=True) if not hit]
            for source in missing:
                self.blobs.add(source.read_verified(), pipeline=pipe)
            uploaded += sum(bool(created) for created in pipe.execute()) if missing else 0
        jid = enqueue(self.redis, payload, queue=queue, job_id=job_id)
        return Job(self, jid, queue=queue, items=len(payload.items),
                   rejected=list(prepared.rejected), uploaded=uploaded,
                   blobs=len(prepared.blobs), labels=payload.labels)

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
        """Handle for an existing job; raises JobNotFound.

        A job that is not a readable vlmq job (pickled data, a bad payload, a hash RQ
        cannot parse) still gets a handle, with `problem` saying why and `items` 0: its
        status and failure message are exactly what whoever asks about it needs.
        """
        if not self.redis.exists(Keys.rq_job(job_id)):
            raise JobNotFound(job_id)
        try:
            rq_job = fetch_job(self.redis, job_id)
        except PayloadError as exc:
            origin = self.redis.hget(Keys.rq_job(job_id), "origin")
            return Job(self, job_id, queue=as_str(origin or b""), items=0, problem=str(exc))
        try:
            payload = payload_of(rq_job)
        except PayloadError as exc:
            return Job(self, job_id, queue=rq_job.origin, items=0, problem=str(exc))
        return Job(self, job_id, queue=rq_job.origin, items=len(payload.items),
                   labels=payload.labels)

    def queues(self) -> dict[str, QueueInfo]:
        """Every queue RQ knows of, with its depth and registry counts."""
        out: dict[str, QueueInfo] = {}
        for q in sorted(Queue.all(connection=self.redis, serializer=JSONSerializer),
                        key=lambda q: q.name):
            out[q.name] = QueueInfo(name=q.name, queued=q.count,
                                    started=q.started_job_registry.count,
                                    finished=q.finished_job_registry.count,
                                    failed=q.failed_job_registry.count)
        return out

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
                 labels: Mapping[str, str] | None = None) -> None:
        self.client = client
        self.id = job_id
        self.queue = queue
        self.items = items
        self.rejected: list[tuple[str, str]] = list(rejected)
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
        return payload_of(fetch_job(self.client.redis, self.id))

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

    def summary(self) -> dict[str, Any] | None:
        """The job's return value (a JobSummary dict) once finished, else None."""
        result = self._latest()
        if result is None or result.type != Result.Type.SUCCESSFUL:
            return None
        value = result.return_value
        return dict(value) if isinstance(value, Mapping) else {"value": value}

    def error(self) -> str | None:
        """Why the job failed, or None while it has not.

        RQ keeps the message in its results stream (latest_result().exc_string). A job
        whose hash RQ cannot load never gets a Result: the worker writes the reason to
        the hash's `exc_info` field instead, read here as plain text.
        """
        result = self._latest()
        if result is not None and result.type == Result.Type.FAILED:
            return result.exc_string or NO_MESSAGE
        if self.status() == "failed":
            return raw_exc_info(self.client.redis, self.id) or NO_MESSAGE
        return None

    def wait(self, timeout: float | None = None, progress: bool = False, *,
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
             progress: bool = False, poll_s: float = POLL_S) -> dict[str, str]:
    """Wait for several jobs at once; one progress bar over all their items.

    Sleeps by blocking on the jobs' event streams, so an item finishing wakes the bar
    at once while a silent job costs one status check per poll_s.
    """
    if not jobs:
        return {}
    client = jobs[0].client
    redis = client.redis
    total = sum(j.items for j in jobs)
    deadline = None if timeout is None else time.monotonic() + timeout
    cursors: dict[Any, Any] = {client.keys.job_events(j.id): "0-0" for j in jobs}
    statuses: dict[str, str] = {}
    shown = 0
    with ExitStack() as stack:
        bar: Any = (stack.enter_context(click.progressbar(
            length=total, label="items", file=sys.stderr, show_pos=True, show_eta=True))
            if progress else None)
        while True:
            statuses = {j.id: j.status() for j in jobs}
            done = sum(j.progress()[0] for j in jobs)
            if bar is not None and done > shown:
                bar.update(done - shown)
                shown = done
            if all(s in TERMINAL for s in statuses.values()):
                return statuses
            wait_s = poll_s
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(statuses, done, total, timeout or 0.0)
                wait_s = min(wait_s, remaining)
            reply: Any = redis.xread(cursors, count=1000, block=max(1, int(wait_s * 1000)))
            for stream, entries in reply or []:
                if entries:
                    cursors[as_str(stream)] = as_str(entries[-1][0])


def _as_list(paths: Iterable[str | os.PathLike[str]]) -> list[str | os.PathLike[str]]:
    # A bare string is one path, not an iterable of one-character paths.
    if isinstance(paths, (str, os.PathLike)):
        return [paths]
    return list(paths)


def check_redis_url(url: str) -> str:
    """`url`, or ValueError naming it: redis-py's own message does not say which URL."""
    try:
        ConnectionPool.from_url(url).disconnect()
    except ValueError as exc:
        raise ValueError(f"invalid Redis URL {redact_url(url)!r}: {exc}") from exc
    return url


def redact_url(url: str) -> str:
    """The URL with its password masked, for messages: stderr ends up in CI logs."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
