"""Uploading a job's inputs under this producer's Redis budget, one bounded chunk at a time.

Every input byte a producer uploads sits in Redis RAM until the jobs using it end, so a
producer keeps its own uploads whose jobs have not ended under `max_pending_bytes`
(`--max-pending-mb`, a Client attribute shared by the jobs it submits). A job is uploaded
only when it fits beside the jobs still pending; otherwise the producer waits for workers
to drain them (a job larger than the whole budget waits until nothing is pending, then goes
alone). The batch layer cuts a large set into jobs (producer/job_sets.py), so a folder many
times the budget goes through a Redis of about the budget plus one job. Files are read into
memory one chunk at a time: at most UPLOAD_CHUNK blobs and UPLOAD_CHUNK_BYTES (or one file
larger than that).

The budget follows the pending jobs through their ends, not by reading them: the producer
subscribes to the done channel (`<prefix>:done`, one message per job end, end_job.lua)
before its first upload, so each end costs one message whatever else is pending. A full
read of the pending jobs' statuses (one pipelined round trip per SWEEP_CHUNK jobs) happens
only when the messages may have missed an end (no subscription, a lost connection) and at
most every SWEEP_S besides; never once per upload, which made a set of one-item jobs cost
the square of its size.

One job must fit the budget: a job whose new uploads pass it is refused (OverBudget, naming
the budget) unless it is one file, which waits until nothing is pending and goes alone.
Every path that cuts a set into jobs cuts them to `job_bytes` (job_sets.split_for), so only
a job made by hand (Client.ocr and the like) can meet the refusal.

A wait for room ends (BudgetWaitTimeout, naming the queues and the budget; `vlmq enqueue`
exits 124): after `wait_timeout` seconds when one is given, else after UNSERVED_WAIT_S
while no live worker serves any queue a pending job is on (a queue nobody serves never
drains); while a worker serves one, the default waits as long as it takes. The first wait
says which queues have no worker.

Nothing is ever half-written: a blob is uploaded with a short TTL (blobs.UPLOAD_TTL_S) and
lives longer only once a job holding it is enqueued, in one MULTI (shared/enqueue.enqueue). A
Ctrl-C, a crash or Redis running out of memory leaves the jobs enqueued so far whole and the
other uploads expiring within minutes. Running the same command again resumes: the workers'
result cache answers the pages already done (README, "Big sets and Redis memory").
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis import Redis
from redis.client import Pipeline, PubSub
from redis.exceptions import OutOfMemoryError, RedisError

from vlmq.producer import defaults
from vlmq.shared import constants as C
from vlmq.shared.blobs import UPLOAD_TTL_S, BlobStore
from vlmq.shared.errors import PayloadError, VlmqError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import JobPayload

if TYPE_CHECKING:
    from vlmq.producer.files import BlobSource  # (file checks: the client's enqueue side)
    from vlmq.producer.progress import StatusLines

MB = 1024 * 1024
DEFAULT_MAX_PENDING_MB = defaults.DEFAULT_MAX_PENDING_MB  # where the CLI's help reads it
UPLOAD_CHUNK = 256  # blobs per pipelined round trip
UPLOAD_CHUNK_BYTES = 32 * MB  # file bytes held in memory at once (one larger file alone)
# Jobs of at most this share of the budget let the next job upload while workers are still
# busy with the ones before it (job_bytes, for whoever cuts a set into jobs).
JOBS_PER_BUDGET = 4
POLL_S = 0.5
# With no wait_timeout, a wait for room gives up after this long with no live worker on
# any pending job's queue (a queue nobody serves never drains; ten minutes covers a worker
# restarting or still loading its model).
UNSERVED_WAIT_S = 600.0
# A full read of the pending jobs' statuses at most this often while the done channel is
# followed (it catches an end no message told of), and this many jobs per round trip.
SWEEP_S = 30.0
SWEEP_CHUNK = 10_000
# A status line names items done only while this few jobs are pending (one HLEN each).
DESCRIBE_MAX = 1000
# RQ statuses after which a job holds its inputs no more (failed: only until its record goes).
ENDED = frozenset({b"finished", b"failed", b"stopped", b"canceled"})


@dataclass
class _Pending:
    items: int
    bytes: int
    queue: str = ""


class OverBudget(PayloadError):
    """One job's new uploads pass the whole budget: it could never fit beside anything,
    and several files need not go as one job (a set is cut into jobs that fit)."""

    def __init__(self, size: int, files: int, budget_mb: float) -> None:
        super().__init__("inputs", f"of this job ({size / MB:.1f} MB in {files} files to "
                                   f"upload) pass the Redis budget (--max-pending-mb "
                                   f"{budget_mb:g}); a job must fit in it: enqueue the set "
                                   "as a set (vlmq enqueue, Client.submit_set) to cut it "
                                   "into jobs that fit, or raise --max-pending-mb")


class BudgetWaitTimeout(VlmqError, TimeoutError):
    """A wait for room in the budget ran out: the pending jobs did not drain in time. The
    jobs enqueued so far stay queued; nothing of the waiting job was uploaded."""

    def __init__(self, queues: Sequence[str], unserved: Sequence[str], waited: float,
                 budget_mb: float) -> None:
        self.queues = tuple(queues)
        self.unserved = tuple(unserved)
        names = ", ".join(repr(q) for q in (self.unserved or self.queues))
        why = (f"no live worker serves queue {names}" if self.unserved
               else f"the jobs pending on queue {names} did not drain")
        start = " ".join(f"--queues {q}" for q in self.unserved) or "--queues ..."
        super().__init__(f"gave up after {waited:.0f} s waiting for room in the Redis "
                         f"budget (--max-pending-mb {budget_mb:g}): {why}; the jobs "
                         f"enqueued so far stay queued (start one: vlmq worker --model M "
                         f"{start}; or raise --wait-timeout / wait_timeout=)")


class Uploader:
    """One producer's uploads and the budget they share, across the jobs it submits.

    `pending` maps each job this producer enqueued to the bytes it uploaded for it; a job
    leaves it when it ends (its inputs are released then, end_job.lua), heard of on the
    done channel (`_ends`) or, failing that, read in a sweep.
    """

    def __init__(self, redis: Redis, keys: Keys, *,
                 max_pending_mb: float = DEFAULT_MAX_PENDING_MB,
                 progress: StatusLines | None = None,
                 wait_timeout: float | None = None) -> None:
        if max_pending_mb <= 0:
            raise ValueError(f"max_pending_mb must be positive, got {max_pending_mb}")
        if wait_timeout is not None and wait_timeout <= 0:
            raise ValueError(f"wait_timeout must be positive, got {wait_timeout}")
        self.redis = redis
        self.keys = keys
        self.max_pending_mb = max_pending_mb
        self.wait_timeout = wait_timeout
        self.max_pending_bytes = int(max_pending_mb * MB)
        self.progress = progress
        self.pending: dict[str, _Pending] = {}
        self._bytes = 0  # the sum of pending's bytes, kept rather than summed per upload
        self._ends: PubSub | None = None  # the done channel, once something is uploaded
        self._stale = False  # an end may have gone unheard: sweep at the next refresh
        self._swept = time.monotonic()
        self.blobs = BlobStore(redis, keys, ttl_s=UPLOAD_TTL_S)
        self._waited = False  # the first wait is always said
        self.totals = {"jobs": 0, "items": 0, "bytes": 0}

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    @property
    def job_bytes(self) -> int:
        """New uploads one job should hold at most, so that jobs overlap under the budget."""
        return max(1, self.max_pending_bytes // JOBS_PER_BUDGET)

    def _missing(self, sources: Sequence[BlobSource]) -> list[tuple[str, BlobSource]]:
        """The sources Redis lacks; those it holds now live at least UPLOAD_TTL_S more."""
        out: list[tuple[str, BlobSource]] = []
        for at in range(0, len(sources), UPLOAD_CHUNK):
            chunk = sources[at:at + UPLOAD_CHUNK]
            pipe = self.redis.pipeline(transaction=False)
            for source in chunk:
                self.blobs.touch(source.sha256, pipeline=pipe)
            out += [(s.sha256, s) for s, hit in zip(chunk, pipe.execute(), strict=True)
                    if not hit]
        return out

    # --- uploading --------------------------------------------------------------------

    def upload(self, sources: Sequence[BlobSource], *,
               blob_ttl: int = UPLOAD_TTL_S) -> tuple[int, int]:
        """Make room, then upload what Redis lacks of `sources`; returns (blobs uploaded,
        bytes uploaded). Checked again at the end: a blob present before a long wait or a
        long upload may have expired meanwhile, and is uploaded again. Uploads live
        UPLOAD_TTL_S, or the job's blob_ttl when that is shorter."""
        self.blobs.ttl_s = min(UPLOAD_TTL_S, blob_ttl)
        missing = [s for _, s in self._missing(sources)]
        need = sum(s.size for s in missing)
        if len(missing) > 1 and need > self.max_pending_bytes:
            raise OverBudget(need, len(missing), self.max_pending_mb)
        if missing:
            self.listen()  # before the job is enqueued, so its end cannot go unheard
        self.wait_for_room(need)
        uploaded = size = 0
        for _ in range(3):
            for chunk in _chunks(missing):
                pipe = self.redis.pipeline(transaction=False)
                for source in chunk:
                    self.blobs.add(source.read_verified(), pipeline=pipe)
                for source, created in zip(chunk, self._send(pipe), strict=True):
                    uploaded += bool(created)
                    size += source.size if created else 0
            missing = [s for _, s in self._missing(sources)]
            if not missing:
                break
        return uploaded, size

    @staticmethod
    def _send(pipe: Pipeline) -> list[Any]:
        """Run an upload round trip. Out of memory, redis-py's message would quote the
        command, file bytes and all: say instead what is left behind and what to do."""
        try:
            return list(pipe.execute())
        except OutOfMemoryError:
            raise OutOfMemoryError(
                "command not allowed when used memory > 'maxmemory', while uploading "
                "inputs; nothing was enqueued for this job, and what was uploaded for it "
                f"expires within {UPLOAD_TTL_S // 60} minutes. "
                "Lower --max-pending-mb, or give Redis more memory") from None

    def enqueued(self, job_id: str, items: int, uploaded_bytes: int, *,
                 queue: str = "") -> None:
        """Count a job's new uploads against the budget until the job ends (`queue`: where
        it waits, so a wait for room can say which queue has no worker)."""
        self.totals["jobs"] += 1
        self.totals["items"] += items
        self.totals["bytes"] += uploaded_bytes
        if uploaded_bytes:
            self._forget(job_id)
            self.pending[job_id] = _Pending(items=items, bytes=uploaded_bytes, queue=queue)
            self._bytes += uploaded_bytes
        self._status(lambda: f"enqueued {self.totals['jobs']} job(s), {self.totals['items']} "
                             f"item(s), {self.totals['bytes'] / MB:.1f} MB uploaded; "
                             + self.describe())

    def wait_for_room(self, need: int) -> None:
        """Block until `need` more bytes fit the budget, or nothing of this producer's is
        pending (a job larger than the budget then goes alone). Raises BudgetWaitTimeout
        when the wait runs out (module docstring: when)."""
        if self.pending:
            self.refresh()
        started = time.monotonic()
        unserved_since: float | None = None
        said: tuple[str, ...] = ()
        try:
            while self.pending and self.pending_bytes + need > self.max_pending_bytes:
                queues, unserved = self._queues()
                now = time.monotonic()
                unserved_since = (unserved_since or now) if unserved else None
                note = ("; no live worker serves queue " + ", ".join(map(repr, unserved))
                        if unserved else "")
                self._status(functools.partial(self._waiting_line, note),
                             force=not self._waited or unserved != said, live=True)
                self._waited, said = True, unserved
                self._give_up(queues, unserved, now - started,
                              None if unserved_since is None else now - unserved_since)
                self._await_end(POLL_S)
                self.refresh()
        finally:
            if self.progress is not None:
                self.progress.end()

    def _waiting_line(self, note: str) -> str:
        return "waiting for workers: " + self.describe() + note

    def _queues(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The queues pending jobs are on, and those of them no live RQ worker serves and
        none is starting to (two SCARDs each)."""
        queues = tuple(dict.fromkeys(p.queue for p in self.pending.values() if p.queue))
        pipe = self.redis.pipeline(transaction=False)
        for queue in queues:
            pipe.scard(Keys.rq_queue_workers(queue))
            pipe.scard(self.keys.queue_starting(queue))
        counts = pipe.execute() if queues else []
        served = [int(a) + int(b) for a, b in zip(counts[::2], counts[1::2], strict=True)]
        return queues, tuple(q for q, n in zip(queues, served, strict=True) if not n)

    def _give_up(self, queues: Sequence[str], unserved: Sequence[str], waited: float,
                 unserved_for: float | None) -> None:
        """Raise BudgetWaitTimeout once the wait is past wait_timeout, or without one, once
        no worker has served the pending jobs' queues for UNSERVED_WAIT_S."""
        if self.wait_timeout is not None:
            over = waited >= self.wait_timeout
        else:
            over = unserved_for is not None and len(unserved) == len(queues) \
                and unserved_for >= UNSERVED_WAIT_S
        if over:
            raise BudgetWaitTimeout(queues, unserved, waited, self.max_pending_mb)

    # --- following the pending jobs ------------------------------------------------------

    def listen(self) -> None:
        """Subscribe to the done channel (once). Without it (a Redis that refuses pub/sub)
        every refresh sweeps, as before the channel was followed."""
        if self._ends is not None:
            return
        try:
            # Typed in some redis-py releases and not in others.
            pubsub: Callable[[], PubSub] = self.redis.pubsub
            ends = pubsub()
            ends.subscribe(self.keys.done_channel)
        except RedisError:
            self._stale = True
            return
        self._ends = ends
        self._stale = bool(self.pending)  # ended before the subscription: one sweep

    def close(self) -> None:
        """Let go of the done channel's connection."""
        if self._ends is not None:
            self._ends.close()
            self._ends = None

    def refresh(self) -> None:
        """Forget the jobs that have ended (or are gone): their inputs are released. The
        done channel's messages say which, at one message per end; the statuses of all
        pending jobs are read only when an end may have gone unheard, or SWEEP_S after the
        last such read."""
        self._hear(0.0)
        if self.pending and (self._stale or self._ends is None
                             or time.monotonic() - self._swept >= SWEEP_S):
            self._sweep()

    def _hear(self, timeout: float) -> None:
        """Take every end message already come (waiting up to `timeout` for the first).
        A lost connection drops the subscription: the next refresh sweeps, the next upload
        subscribes again."""
        if self._ends is None:
            return
        try:
            message = self._ends.get_message(timeout=timeout)
            while message is not None:
                self._ended(message)
                message = self._ends.get_message(timeout=0.0)
        except (RedisError, OSError):
            self._ends.close()
            self._ends = None
            self._stale = True

    def _ended(self, message: dict[str, Any]) -> None:
        """One message of the done channel: the job it names (if ours) has ended."""
        if message.get("type") != "message":
            return  # the subscription's own confirmation
        try:
            job_id = json.loads(message["data"]).get("id")
        except (ValueError, AttributeError, TypeError):
            return  # not end_job.lua's: nothing of ours to forget
        if isinstance(job_id, str):
            self._forget(job_id)

    def _await_end(self, timeout: float) -> None:
        """Block until a job ends (a message comes) or `timeout` passes."""
        if self._ends is None:
            time.sleep(timeout)
        else:
            self._hear(timeout)

    def _sweep(self) -> None:
        """Read every pending job's status, SWEEP_CHUNK per round trip; forget the ended
        and the gone."""
        ids = list(self.pending)
        for at in range(0, len(ids), SWEEP_CHUNK):
            chunk = ids[at:at + SWEEP_CHUNK]
            pipe = self.redis.pipeline(transaction=False)
            for job_id in chunk:
                pipe.hget(Keys.rq_job(job_id), "status")
            for job_id, status in zip(chunk, pipe.execute(), strict=True):
                if status is None or status in ENDED:
                    self._forget(job_id)
        self._swept = time.monotonic()
        self._stale = self._ends is None

    def _forget(self, job_id: str) -> None:
        gone = self.pending.pop(job_id, None)
        if gone is not None:
            self._bytes -= gone.bytes

    def describe(self) -> str:
        """Where the pending jobs stand, for a status line."""
        ids = list(self.pending)
        head = (f"{len(ids)} job(s) with {self.pending_bytes / MB:.1f} MB of inputs pending "
                f"(budget {self.max_pending_bytes / MB:g} MB)")
        if len(ids) > DESCRIBE_MAX:
            return head  # items done would cost one read per pending job
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hlen(self.keys.job_items(job_id))
        done = sum(int(n) for n in pipe.execute())
        total = sum(p.items for p in self.pending.values())
        return f"{head}, items done {done}/{total}"

    def _status(self, line: str | Callable[[], str], *, force: bool = False,
                live: bool = False) -> None:
        """A status line for `progress`, the caller's to show or drop (the CLI shows at
        most one every few seconds unless forced). `line` may be a callable, so a line
        that is not shown costs no Redis round trip."""
        if self.progress is not None:
            self.progress(line, force=force, live=live)


def _chunks(sources: Iterable[BlobSource]) -> Iterable[list[BlobSource]]:
    """Runs of sources of at most UPLOAD_CHUNK files and UPLOAD_CHUNK_BYTES (a larger file
    alone): the bytes of one run are all a producer holds in memory."""
    chunk: list[BlobSource] = []
    size = 0
    for source in sources:
        if chunk and (len(chunk) >= UPLOAD_CHUNK or size + source.size > UPLOAD_CHUNK_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(source)
        size += source.size
    if chunk:
        yield chunk


def retention(redis: Redis, keys: Keys, job_id: str, payload: JobPayload | None,
              ) -> dict[str, str]:
    """How long a job's results and inputs are kept, as `vlmq status` says it."""
    raw = redis.hmget(Keys.rq_job(job_id), ["status", "result_ttl", "failure_ttl"])
    status, result_ttl, failure_ttl = (v.decode() if isinstance(v, bytes) else v for v in raw)
    ended = status in ("finished", "failed", "stopped", "canceled")
    if ended:
        # The job hash holds the end (and the summary) as long as the items live; the
        # events stream only a minute more (PROTOCOL.md section 5).
        results = _left(max(int(redis.ttl(Keys.rq_job(job_id))),
                            int(redis.ttl(keys.job_items(job_id)))))
    else:
        results = (f"{_span(int(result_ttl or C.RESULT_TTL_S))} after the job ends "
                   f"({_span(int(failure_ttl or C.FAILURE_TTL_S))} if it fails)")
    return {"results": results, "inputs": _inputs_kept(redis, keys, payload, ended=ended)}


def _inputs_kept(redis: Redis, keys: Keys, payload: JobPayload | None, *,
                 ended: bool) -> str:
    if payload is None:
        return "unknown"
    shas = {i.blob for i in payload.items if i.blob}
    if not shas:
        return "none in Redis (references into a store)"
    if not ended:
        return (f"while the job is queued or running, then "
                f"{_span(int(payload.get('keep_inputs')))} (--keep-inputs; a failed job keeps "
                "them as long as its failure record)")
    pipe = redis.pipeline(transaction=False)
    for sha in shas:
        pipe.ttl(keys.blob(sha))
    ttls = [int(t) for t in pipe.execute() if int(t) != -2]
    return _left(max(ttls)) if ttls else "gone from Redis"


def _left(ttl: int) -> str:
    """A key's TTL as status says it (-1: no TTL, -2: no key)."""
    if ttl == -2:
        return "none left"
    return f"{_span(ttl)} more" if ttl >= 0 else "until deleted"


def _span(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if (seconds >= size and seconds % size == 0) or seconds >= 10 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds} s"
