"""Every Redis key vlmq writes, in one place, under a configurable prefix.

RQ's own keys (queues, registries, job hashes) keep RQ's names so that `rq info` and
rq-dashboard work unchanged; only vlmq's additions live under the prefix.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

DEFAULT_PREFIX = "vlmq"
PREFIX_ENV = "VLMQ_PREFIX"

# RQ's names: the only place vlmq spells them. They mirror rq 3.0 (tests/protocol/test_keys.py
# checks them against RQ's own classes; tests/protocol/test_protocol.py pins the wire names).
RQ_JOB = "rq:job:{id}"
RQ_QUEUE = "rq:queue:{name}"
RQ_QUEUES = "rq:queues"
RQ_RESULTS = "rq:results:{id}"
RQ_WORKER = "rq:worker:{name}"
RQ_WORKERS = "rq:workers"
RQ_QUEUE_WORKERS = "rq:workers:{queue}"
# A queue's registries (zsets scored by expiry), by the name vlmq shows each under.
RQ_REGISTRIES = {"started": "rq:wip:{queue}", "finished": "rq:finished:{queue}",
                 "failed": "rq:failed:{queue}", "deferred": "rq:deferred:{queue}",
                 "scheduled": "rq:scheduled:{queue}", "canceled": "rq:canceled:{queue}"}

# Whole-string patterns: use .fullmatch (`$` would accept a trailing newline).
JOB_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
# What vlmq makes batch ids look like ("b-" and 32 hex digits); any job id is accepted as
# a batch id on the wire, and commands tell batches from jobs by the batch record.
BATCH_ID_PREFIX = "b-"
QUEUE_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix; build one per connection, pass it everywhere."""

    prefix: str = DEFAULT_PREFIX

    @classmethod
    def from_env(cls) -> Keys:
        return cls(os.environ.get(PREFIX_ENV, DEFAULT_PREFIX))

    def blob(self, sha256: str) -> str:
        return f"{self.prefix}:blob:{sha256}"

    def blob_jobs(self, sha256: str) -> str:
        """Zset: the jobs holding a blob, scored by when the hold ends in epoch ms (`inf`
        while the job is queued or running; a failed job's failure record expiry)."""
        return f"{self.prefix}:blob-jobs:{sha256}"

    def job_inputs(self, job_id: str) -> str:
        """Hash: sha256 of each blob a job holds -> the job's keep_inputs (seconds)."""
        return f"{self.prefix}:job:{job_id}:inputs"

    def job_items(self, job_id: str) -> str:
        """Hash: item index (decimal string) -> ItemResult JSON."""
        return f"{self.prefix}:job:{job_id}:items"

    def job_events(self, job_id: str) -> str:
        """Stream of progress events for one job (item done, job finished/failed)."""
        return f"{self.prefix}:job:{job_id}:events"

    def job_owner(self, job_id: str) -> str:
        """String: the execution that owns a running job, `<execution id> <worker name>`.

        Set when a worker starts the job, deleted when it ends it. Every write a worker
        makes for the job (item results, events, the job's end, heartbeats) checks it
        atomically, so a worker that lost the job (stalled past its heartbeat) writes nothing.
        """
        return f"{self.prefix}:job:{job_id}:owner"

    @property
    def done_channel(self) -> str:
        """Pub/sub channel: `{"id": ..., "status": ...}` once per job that ends."""
        return f"{self.prefix}:done"

    def done_queue_channel(self, queue: str) -> str:
        """Pub/sub channel: the same message, for jobs of one queue only."""
        return f"{self.prefix}:done:{queue}"

    def job_risk(self, job_id: str) -> str:
        """Hash: item index -> "<worker>|<step>|<unix time>" while that item is in a step
        that could kill its worker (worker/intake/poison.py); left behind if it did."""
        return f"{self.prefix}:job:{job_id}:risk"

    def job_kills(self, job_id: str) -> str:
        """Hash: how many workers died while one of this job's items was in risky work."""
        return f"{self.prefix}:job:{job_id}:kills"

    def job_batch(self, job_id: str) -> str:
        """String: the id of the batch a job belongs to, written with the batch record
        before the job is enqueued; end_job.lua reads it to count the job's end once."""
        return f"{self.prefix}:job:{job_id}:batch"

    # --- job indexes (shared/job_index.py; PROTOCOL.md section "Job indexes") ---------

    @property
    def jobs_index(self) -> str:
        """Zset: every indexed job id, scored by its enqueue time (RQ's created_at, epoch µs)."""
        return f"{self.prefix}:jobs"

    def jobs_queue_index(self, queue: str) -> str:
        """Zset: the indexed jobs of one queue, scored as jobs_index."""
        return f"{self.prefix}:jobs:queue:{queue}"

    def jobs_label_index(self, key: str, value: str) -> str:
        """Zset: the indexed jobs carrying label key=value, scored as jobs_index.

        The key's length in UTF-8 bytes comes first, so any key and value (both may hold
        '=' or ':') name exactly one zset."""
        return f"{self.prefix}:jobs:label:{len(key.encode())}:{key}={value}"

    @property
    def jobs_meta(self) -> str:
        """Hash: job id -> JSON summary {task, items, queue, labels, created} for listing
        without the payload; outlives the job hash so stale index entries can be found."""
        return f"{self.prefix}:jobs:meta"

    @property
    def jobs_sweep(self) -> str:
        """String: the jobs_index rank where the last sweep for expired jobs stopped."""
        return f"{self.prefix}:jobs:sweep"

    def job_failed(self, job_id: str) -> str:
        """Set: indexes of a job's failed items (write_items.lua); expires with the items
        hash, so done = HLEN items and failed = SCARD of this."""
        return f"{self.prefix}:job:{job_id}:failed"

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's record (task, created_at, labels, items, jobs, ttl) and, once it
        ends, its status and its jobs' end counts (finished, failed, canceled)."""
        return f"{self.prefix}:batch:{batch_id}"

    def batch_jobs(self, batch_id: str) -> str:
        """List: a batch's job ids in order (its items' order)."""
        return f"{self.prefix}:batch:{batch_id}:jobs"

    def batch_pending(self, batch_id: str) -> str:
        """Set: the batch's jobs that have not ended; the last one out ends the batch."""
        return f"{self.prefix}:batch:{batch_id}:pending"

    def batch_events(self, batch_id: str) -> str:
        """Stream: the batch's one terminal event (end_job.lua writes it)."""
        return f"{self.prefix}:batch:{batch_id}:events"

    @property
    def redis_restart(self) -> str:
        """Hash a worker leaves in a Redis that restarted empty: when, and which jobs it
        lost with it, so `vlmq wait` can say why a job is gone."""
        return f"{self.prefix}:redis:restart"

    def worker_stats(self, name: str) -> str:
        """Hash of one worker's live stats; expires when the worker stops refreshing it."""
        return f"{self.prefix}:worker:{name}:stats"

    @property
    def dead(self) -> str:
        """List of queue entries no worker can run (undecodable, bad id, unreadable hash),
        newest first, each a JSON object with the reason."""
        return f"{self.prefix}:dead"

    @property
    def workers(self) -> str:
        """Set of worker names that have published stats."""
        return f"{self.prefix}:workers"

    def result_cache_gen(self, gen: int) -> str:
        """Hash: one generation of the result cache (worker/results/cache.py). Field = an
        item key's digest (128 bits, base64url), value = "<job id> <index> <text hash>",
        the stored item result holding its text; generation `gen` holds the entries whose
        target expires in day `gen` (epoch s // span) and expires at that day's end."""
        return f"{self.prefix}:rcache:gen:{gen}"

    @property
    def schedules(self) -> str:
        """Set of schedule names."""
        return f"{self.prefix}:schedules"

    def schedule(self, name: str) -> str:
        """Hash: a schedule's definition (def, JSON), next_due (epoch ms) and paused."""
        return f"{self.prefix}:schedule:{name}"

    def schedule_done(self, name: str) -> str:
        """Set of the work units (settings, source, sha256, page) a schedule has done."""
        return f"{self.prefix}:schedule:{name}:done"

    def schedule_pending(self, name: str) -> str:
        """Hash: job id -> the units (and roots) of a schedule's job not yet finished."""
        return f"{self.prefix}:schedule:{name}:pending"

    def schedule_runs(self, name: str) -> str:
        """Hash: run id -> run record (due time, job id, items, skipped, status)."""
        return f"{self.prefix}:schedule:{name}:runs"

    def schedule_files(self, name: str) -> str:
        """Hash: path -> "size:mtime_ns:sha256:kind:pages" from a schedule's last run."""
        return f"{self.prefix}:schedule:{name}:files"

    def schedule_lock(self, name: str) -> str:
        """Lock held while one run of a schedule reads its paths and enqueues."""
        return f"{self.prefix}:schedule:{name}:lock"

    # --- RQ's keys (static: RQ's names take no vlmq prefix) ---------------------------

    @staticmethod
    def rq_job(job_id: str) -> str:
        return RQ_JOB.format(id=job_id)

    @staticmethod
    def rq_job_glob() -> str:
        """SCAN pattern for job hashes; it also matches RQ's `rq:job:<id>:<sub>` keys,
        which rq_job_id tells apart."""
        return RQ_JOB.format(id="*")

    @staticmethod
    def rq_job_id(key: str) -> str | None:
        """The job id of a job hash key, or None for any other key (RQ keeps a job's
        dependents and dependencies under `rq:job:<id>:...`)."""
        head = RQ_JOB.format(id="")
        job_id = key.removeprefix(head)
        return job_id if key.startswith(head) and job_id and ":" not in job_id else None

    @staticmethod
    def rq_queue(name: str) -> str:
        return RQ_QUEUE.format(name=name)

    @staticmethod
    def rq_registry(kind: str, queue: str) -> str:
        """One of RQ_REGISTRIES (started, finished, failed, ...) of `queue`."""
        return RQ_REGISTRIES[kind].format(queue=queue)

    @staticmethod
    def rq_results(job_id: str) -> str:
        """Stream of a job's results (RQ's Result entries)."""
        return RQ_RESULTS.format(id=job_id)

    @staticmethod
    def rq_worker(name: str) -> str:
        """Hash of one RQ worker (state, queues, death...)."""
        return RQ_WORKER.format(name=name)

    @staticmethod
    def rq_queue_workers(queue: str) -> str:
        """Set of the live workers that listen on `queue`."""
        return RQ_QUEUE_WORKERS.format(queue=queue)

    @staticmethod
    def rq_name(key: str) -> str:
        """The name in a queue or worker key (members of RQ_QUEUES and RQ_WORKERS are
        `rq:queue:<name>` and `rq:worker:<name>`)."""
        return key.split(":", 2)[-1]
