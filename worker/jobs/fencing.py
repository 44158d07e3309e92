"""Who may write for a job: its owner key, and the check every write makes against it.

Starting a job sets Keys.job_owner to the execution's token; from then on a write for the
job (a heartbeat, item results, its end) applies only while the job is STARTED and that key
still holds the token, checked atomically with the write: WATCH here, write_items.lua for
item results. A worker that stalled past its heartbeat TTL, and whose job another worker
took meanwhile, writes nothing more for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis.client import Pipeline
from redis.exceptions import WatchError
from rq.executions import Execution
from rq.job import Job, JobStatus

from vlmq.shared.keys import Keys
from vlmq.shared.redis_text import as_str
from vlmq.worker.jobs.running import BatchWorker, Running

# The owner key lives this many heartbeat TTLs, at least OWNER_TTL_MIN_S.
OWNER_TTL_HEARTBEATS = 10
OWNER_TTL_MIN_S = 600
# Why a STARTED job is not ours when its owner key is gone (it expired while this worker
# stalled far past its heartbeat TTL, and nobody took the job).
ORPHANED = "its owner key expired; RQ requeues it once its heartbeat TTL has passed"

Whys = list[str | None]  # per job of a batch: None while it is ours, else why not


class Fence:
    """The owner keys of one worker's executions, and fenced transactions over them."""

    def __init__(self, worker: BatchWorker, keys: Keys) -> None:
        self.worker = worker
        self.keys = keys
        self.connection = worker.connection

    @property
    def owner_ttl(self) -> int:
        """The owner key outlives many missed heartbeats (each refreshes it), and expires
        on its own after a worker died holding it."""
        return max(OWNER_TTL_MIN_S, OWNER_TTL_HEARTBEATS * self.worker.heartbeat_ttl)

    def token(self, execution: Execution) -> str:
        return f"{execution.id} {self.worker.name}"

    # --- the owner key, queued on the caller's transaction --------------------------------

    def claim(self, pipe: Pipeline, job_id: str, execution: Execution) -> None:
        """From here on only this execution writes for the job."""
        pipe.set(self.keys.job_owner(job_id), self.token(execution), ex=self.owner_ttl)

    def extend(self, pipe: Pipeline, job_id: str) -> None:
        pipe.expire(self.keys.job_owner(job_id), self.owner_ttl)

    def release(self, pipe: Pipeline, job_id: str) -> None:
        pipe.delete(self.keys.job_owner(job_id))

    def watch_keys(self, batch: Sequence[Running]) -> list[str]:
        """What a fenced write for `batch` WATCHes: each job's hash and owner key."""
        return [k for r in batch for k in (r.job.key, self.keys.job_owner(r.job_id))]

    # --- checks --------------------------------------------------------------------------

    def watched_reads(self, queue: Callable[[Pipeline], object]) -> list[Any]:
        """The reads of a check-then-write transaction, for many jobs in one round trip.

        The caller WATCHes the keys first; these reads then run pipelined on another
        connection. Any change to a watched key after the WATCH, before or after these
        reads, makes the caller's EXEC fail, so what they return still holds when the
        writes apply: the same guarantee as reading on the watching connection, which
        redis-py would do one round trip per read.
        """
        with self.connection.pipeline(transaction=False) as rp:
            queue(rp)
            return list(rp.execute())

    def read_whys(self, batch: Sequence[Running],
                  extra: Callable[[Pipeline, Running], object] | None = None
                  ) -> tuple[Whys, list[Any]]:
        """Whether each job of `batch` is ours (watched_reads), and the reply of `extra`'s
        one more read per job (None each without it)."""
        width = 2 if extra is None else 3

        def queue(rp: Pipeline) -> None:
            for r in batch:
                rp.hget(r.job.key, "status")
                rp.get(self.keys.job_owner(r.job_id))
                if extra is not None:
                    extra(rp, r)

        flat = self.watched_reads(queue)
        rows = [flat[i:i + width] for i in range(0, len(flat), width)]
        whys: Whys = [why_not_ours(row[0], row[1], r.token)
                      for r, row in zip(batch, rows, strict=True)]
        return whys, [row[2] if extra is not None else None for row in rows]

    def owned(self, conn: Any, job: Job, token: str) -> str | None:
        """None while `token` is the job's current execution, else why not (for the log).

        The job must be STARTED and its owner key must hold this execution's token: a
        worker that stalled past its heartbeat finds the job requeued (QUEUED), taken by
        another worker (another token), ended, canceled or deleted.
        """
        status = conn.hget(job.key, "status")
        owner = conn.get(self.keys.job_owner(str(job.id)))
        return why_not_ours(status, owner, token)

    def lost(self, running: Sequence[Running]) -> list[tuple[Running, str]]:
        """Those of `running` this worker no longer owns, each with why (one round trip)."""
        if not running:
            return []
        whys, _ = self.read_whys(running)
        return [(r, why) for r, why in zip(running, whys, strict=True) if why is not None]

    def is_ours(self, running: Running) -> bool:
        return self.owned(self.connection, running.job, running.token) is None

    # --- fenced transactions -------------------------------------------------------------

    def fenced(self, job: Job, token: str, build: Callable[[Pipeline], None]) -> str | None:
        """Run `build`'s writes in one transaction, only if execution `token` still owns
        the job.

        WATCH makes the check and the writes atomic: if the job hash or its owner key
        changes in between (another worker takes the job, someone cancels it), the
        transaction is dropped and the check runs again. Returns None when written, else
        why the job is not ours any more (nothing was written).
        """
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(job.key, self.keys.job_owner(str(job.id)))  # type: ignore[no-untyped-call]
                    why = self.owned(pipe, job, token)
                    if why is not None:
                        pipe.reset()
                        return why
                    pipe.multi()
                    build(pipe)
                    pipe.execute()
                    return None
                except WatchError:
                    continue

    def fenced_many(self, watch: Sequence[str], check: Callable[[], Whys],
                    build: Callable[[Pipeline, Whys], None], *, skip_if_none: bool
                    ) -> tuple[Whys, list[Any]]:
        """`fenced` for a batch of jobs: WATCH `watch`, `check` says per job whether it is
        ours (reading through watched_reads), `build` queues the writes given that answer,
        one EXEC for all; again from the WATCH whenever a watched key changed. With
        `skip_if_none`, nothing is written when no job passed. Returns the answers and the
        EXEC's replies ([] when skipped)."""
        with self.connection.pipeline() as pipe:
            while True:
                try:
                    if watch:
                        pipe.watch(*watch)  # type: ignore[no-untyped-call]
                    whys = check()
                    if skip_if_none and all(why is not None for why in whys):
                        pipe.reset()
                        return whys, []
                    pipe.multi()
                    build(pipe, whys)
                    return whys, list(pipe.execute())
                except WatchError:
                    continue


def why_not_ours(status: Any, owner: Any, token: str) -> str | None:
    """None when the job is STARTED and owned by `token`, else a short reason."""
    if status is None:
        return "deleted"
    st = as_str(status)
    if st != JobStatus.STARTED.value:
        return st  # queued (requeued after a missed heartbeat), canceled, finished, failed...
    if owner is None:
        return ORPHANED
    if as_str(owner) != token:
        return f"taken over by worker {as_str(owner).split(' ', 1)[-1]}"
    return None
