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

import click
from redis import Redis
from rq import Queue, Worker
from rq.results import Result
from rq.serializers import JSONSerializer

from vlmq.producer.inputs import PageSpec, Prepared, prepare
from vlmq.shared.blobs import BlobStore
from vlmq.shared.errors import VlmqError
from vlmq.shared.jobs import check_queue_name, enqueue, fetch_job, payload_of
from vlmq.shared.keys import Keys
from vlmq.shared.results import count_done, read_items
from vlmq.shared.schema import Generation, ItemResult, JobPayload, parse_payload

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
REDIS_URL_ENV = "REDIS_URL"
# RQ statuses after which nothing more will happen to a job without someone acting.
TERMINAL = frozenset({"finished", "failed", "stopped", "canceled"})
POLL_S = 0.5


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


class Client:
    def __init__(self, redis_url: str | None = None, *, prefix: str | None = None) -> None:
        self.redis_url = redis_url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL
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
        prepared = prepare(_as_list(paths), pages=pages)
        return self._submit("ocr", prepared, queue=queue, prompt=prompt, model=model,
                            max_side=max_side, max_tokens=max_tokens,
                            temperature=temperature, stop=stop, labels=labels, job_id=job_id)

    def caption(self, paths: Iterable[str | os.PathLike[str]], *, recursive: bool = False,
                skip_bad: bool = False, prompt: str | None = None, queue: str = "caption",
                model: str | None = None, max_tokens: int | None = None,
                max_side: int | None = None, temperature: float | None = None,
                stop: Sequence[str] | None = None, labels: Mapping[str, str] | None = None,
                job_id: str | None = None) -> Job:
        """Caption a set of files, folders or globs; with skip_bad see `job.rejected`."""
        prepared = prepare(_as_list(paths), recursive=recursive, skip_bad=skip_bad)
        return self._submit("caption", prepared, queue=queue, prompt=prompt, model=model,
                            max_side=max_side, max_tokens=max_tokens,
                            temperature=temperature, stop=stop, labels=labels, job_id=job_id)

    def generate(self, paths: Iterable[str | os.PathLike[str]], prompt: str, *,
                 recursive: bool = False, skip_bad: bool = False, queue: str = "generate",
                 model: str | None = None, max_tokens: int | None = None,
                 max_side: int | None = None, temperature: float | None = None,
                 stop: Sequence[str] | None = None, labels: Mapping[str, str] | None = None,
                 job_id: str | None = None) -> Job:
        """Run one prompt over every image (and PDF page) in the set."""
        prepared = prepare(_as_list(paths), recursive=recursive, skip_bad=skip_bad)
        return self._submit("generate", prepared, queue=queue, prompt=prompt, model=model,
                            max_side=max_side, max_tokens=max_tokens,
                            temperature=temperature, stop=stop, labels=labels, job_id=job_id)

    def _submit(self, task: str, prepared: Prepared, *, queue: str, prompt: str | None,
                model: str | None, max_side: int | None, max_tokens: int | None,
                temperature: float | None, stop: Sequence[str] | None,
                labels: Mapping[str, str] | None, job_id: str | None) -> Job:
        payload = JobPayload(
            task=task,
            items=tuple(prepared.items),
            prompt=prompt,
            generation=Generation(max_tokens=max_tokens, temperature=temperature,
                                  stop=tuple(stop or ())),
            model=model,
            max_side=max_side,
            labels=dict(labels or {}),
        )
        # The worker will run exactly this check; failing here keeps Redis untouched.
        payload = parse_payload(payload.to_dict())
        check_queue_name(queue)
        uploaded = 0
        for data in prepared.blobs.values():
            _, fresh = self.blobs.put(data)
            uploaded += fresh
        jid = enqueue(self.redis, payload, queue=queue, job_id=job_id)
        return Job(self, jid, queue=queue, items=len(payload.items),
                   rejected=list(prepared.rejected), uploaded=uploaded,
                   blobs=len(prepared.blobs))

    # --- inspect ----------------------------------------------------------------------

    def job(self, job_id: str) -> Job:
        """Handle for an existing job; raises JobNotFound or PayloadError (not a vlmq job)."""
        if not self.redis.exists(Keys.rq_job(job_id)):
            raise JobNotFound(job_id)
        rq_job = fetch_job(self.redis, job_id)
        payload = payload_of(rq_job)
        return Job(self, job_id, queue=rq_job.origin, items=len(payload.items))

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
        names.update(_text(n) for n in self.redis.smembers(self.keys.workers))
        out: list[WorkerInfo] = []
        for name in sorted(names):
            raw = self.redis.hgetall(self.keys.worker_stats(name))
            stats = {_text(k): _text(v) for k, v in raw.items()}
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
                 blobs: int = 0) -> None:
        self.client = client
        self.id = job_id
        self.queue = queue
        self.items = items
        self.rejected: list[tuple[str, str]] = list(rejected)
        # Blobs newly written by this enqueue / distinct blobs the job uses.
        self.uploaded = uploaded
        self.blobs = blobs

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, queue={self.queue!r}, items={self.items})"

    def status(self) -> str:
        raw = self.client.redis.hget(Keys.rq_job(self.id), "status")
        if raw is None:
            raise JobNotFound(self.id)
        return _text(raw)

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
        if not self.client.redis.exists(Keys.rq_job(self.id)):
            raise JobNotFound(self.id)
        latest: Result | None = fetch_job(self.client.redis, self.id).latest_result()
        return latest

    def summary(self) -> dict[str, Any] | None:
        """The job's return value (a JobSummary dict) once finished, else None."""
        result = self._latest()
        if result is None or result.type != Result.Type.SUCCESSFUL:
            return None
        value = result.return_value
        return dict(value) if isinstance(value, Mapping) else {"value": value}

    def error(self) -> str | None:
        """RQ's exception string for a failed job, else None."""
        result = self._latest()
        if result is not None and result.type == Result.Type.FAILED:
            return result.exc_string or "failed (no exception recorded)"
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
                    cursors[_text(stream)] = _text(entries[-1][0])


def _as_list(paths: Iterable[str | os.PathLike[str]]) -> list[str | os.PathLike[str]]:
    # A bare string is one path, not an iterable of one-character paths.
    if isinstance(paths, (str, os.PathLike)):
        return [paths]
    return list(paths)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
