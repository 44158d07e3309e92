"""Every Redis key vlmq writes, in one table, under a configurable prefix.

KEY_TABLE is the one place a key name is spelled. `Keys` builds the names Python uses
from it, every Lua script carries a generated block of the same names (shared/lua.py,
`python -m vlmq.shared.lua --write`; the block lives in the file because other languages'
producers load the scripts from disk), and PROTOCOL.md's key tables are generated from it
(shared/docs_tables.py). A new key is one row here plus a `Keys` method.

RQ's own keys (queues, registries, job hashes) keep RQ's names so that `rq info` and
rq-dashboard work unchanged; only vlmq's additions live under the prefix.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PREFIX = "vlmq"
PREFIX_ENV = "VLMQ_PREFIX"

# Whole-string patterns: use .fullmatch (`$` would accept a trailing newline).
JOB_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
# What vlmq makes batch ids look like ("b-" and 32 hex digits); any job id is accepted as
# a batch id on the wire, and commands tell batches from jobs by the batch record.
BATCH_ID_PREFIX = "b-"
QUEUE_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# A schedule's name (producer/ops/schedules.py's NAME_CHARS, at most 64): a queue's shape.
SCHEDULE_NAME_RE = QUEUE_NAME_RE


@dataclass(frozen=True)
class IdShape:
    """What one kind of caller-given id looks like, checked before it names any key: an id
    with ':' or a newline would name another key (`b-x:jobs` is a batch's list), so
    commands and Client methods refuse it by shape instead of sending it."""

    kind: str  # as messages name it: "job or batch id"
    pattern: re.Pattern[str]
    shown: str  # the expected shape, as messages write it

    def problem(self, value: object) -> str | None:
        """Why `value` is not such an id (naming it and the shape), or None."""
        if isinstance(value, str) and self.pattern.fullmatch(value):
            return None
        return f"{value!r} is not a {self.kind}: expected {self.shown}"


# Batch ids are job ids on the wire (vlmq makes them "b-" and 32 hex digits).
JOB_ID_SHAPE = IdShape("job or batch id", JOB_ID_RE,
                       "1 to 128 of A-Z a-z 0-9 _ - (a batch: b-<32 hex digits>)")
QUEUE_SHAPE = IdShape("queue name", QUEUE_NAME_RE, "1 to 64 of A-Z a-z 0-9 _ . -")
SCHEDULE_SHAPE = IdShape("schedule name", SCHEDULE_NAME_RE, "1 to 64 of A-Z a-z 0-9 _ . -")


def label_problem(key: str, value: str) -> str | None:
    """Why key=value cannot be a stored label (so a filter on it would send text Redis
    cannot take, or look up a label no job can carry), or None. Labels name their index
    keys with the key's length first, so any other text is safe in a key name."""
    shown = f"{key}={value}".encode("utf-8", "replace").decode()
    if not key:
        return f"label {shown!r} is not a label: expected KEY=VALUE with a non-empty KEY"
    for text in (key, value):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return (f"label {shown!r} is not a label: expected KEY=VALUE in valid UTF-8 "
                    "text (it holds an undecodable byte)")
    return None


@dataclass(frozen=True)
class KeyName:
    """One key (or pub/sub channel): its name pattern and what PROTOCOL.md says of it.

    `pattern` holds `{prefix}` (vlmq's keys; RQ's have none) and one `{field}` per part the
    caller gives. A field named in `lengths` is not given but computed: the UTF-8 byte
    length of the field it maps to, so that fields which may hold the separator still
    name exactly one key. The prose columns may hold `{placeholders}` that
    shared/docs_tables.py fills from the constants they quote, so the document's numbers
    follow the code's.
    """

    name: str  # the Keys attribute, and the name in the Lua block
    pattern: str
    type: str
    writers: str
    content: str
    lifetime: str
    lengths: tuple[tuple[str, str], ...] = ()
    section: str = "keys"  # which PROTOCOL.md table lists it

    @property
    def fields(self) -> tuple[str, ...]:
        """Every field of the pattern, in order ("prefix" included)."""
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.pattern) if f)

    @property
    def params(self) -> tuple[str, ...]:
        """The fields a caller gives: all but the prefix and the computed lengths."""
        computed = dict(self.lengths)
        return tuple(f for f in self.fields if f != "prefix" and f not in computed)

    @property
    def shown(self) -> str:
        """The name as the documents and Lua's error messages write it, e.g.
        `<prefix>:job:<job_id>:items`."""
        return self.pattern.replace("{", "<").replace("}", ">")

    def build(self, prefix: str, values: Mapping[str, str]) -> str:
        """The key for `values` (one per param) under `prefix`."""
        if not self.lengths:
            return self.pattern.format(prefix=prefix, **values)
        computed = {n: str(len(values[of].encode())) for n, of in self.lengths}
        return self.pattern.format(prefix=prefix, **values, **computed)



# What the document says is "none" for a channel's lifetime.
_CHANNEL = "nothing is kept: a subscriber hears it or misses it"
_RQ = "worker (RQ)"

KEY_TABLE: tuple[KeyName, ...] = (
    KeyName("blob", "{prefix}:blob:{sha256}", "string", "producer",
            "input bytes (an image file or a whole PDF); SET NX",
            "short ({upload_ttl} s) until a job holds it; then the job's `blob_ttl` "
            "({blob_ttl_days} days by default) while a job uses it; `keep_inputs` "
            "({keep_inputs} s by default) after the last one ends, or a failed job's failure "
            "TTL (section 2)"),
    KeyName("blob_jobs", "{prefix}:blob-jobs:{sha256}", "zset", "enqueue, end_job.lua",
            "the jobs holding the blob: member job id, score `inf` while the job lives, the "
            "epoch ms its failure record expires once it failed", "the blob's"),
    KeyName("job_inputs", "{prefix}:job:{job_id}:inputs", "hash", "enqueue",
            "field = sha256 of each blob the job holds, value = the job's `keep_inputs` (s)",
            "the job's `blob_ttl`; deleted when the job finishes or is canceled or deleted, "
            "the failure TTL once it failed"),
    KeyName("rq_job", "rq:job:{job_id}", "hash", "producer", "the RQ job (section 3)",
            "none while queued or running; `result_ttl` s after it finishes, `failure_ttl` s "
            "after it fails (RQ)"),
    KeyName("rq_queue", "rq:queue:{queue}", "list", "producer",
            "job ids waiting; RPUSH to enqueue", "none"),
    KeyName("rq_intermediate", "rq:queue:{queue}:intermediate", "list", _RQ,
            "entries a worker has taken from the queue and not yet started (RQ's; a "
            "worker's maintenance cleans what a crashed one left)", "none"),
    KeyName("rq_queues", "rq:queues", "set", "producer",
            "every queue key (`rq:queue:<queue>`)", "none"),
    KeyName("job_items", "{prefix}:job:{job_id}:items", "hash", "worker",
            "field = item index (decimal), value = item result JSON (section 4)",
            "the job's `result_ttl`, counted from the last write"),
    KeyName("job_events", "{prefix}:job:{job_id}:events", "stream", "worker, `vlmq cancel`",
            "progress events and the one terminal event (section 5), while the job runs",
            "refreshed on each write; 60 s once the job ends (its end stays in the job hash: "
            "section 5)"),
    KeyName("job_tokens", "{prefix}:job:{job_id}:tokens", "stream", "worker",
            "an interactive job's answer as it is decoded (`stream` set): Delta entries, "
            "then one End entry (section 3b)",
            "the job's heartbeat while it runs; 60 s after its End entry"),
    KeyName("job_owner", "{prefix}:job:{job_id}:owner", "string", "worker",
            "the execution running the job, `<execution id> <worker name>` (section 5, "
            "fencing); a producer never writes it",
            "the heartbeat TTL, refreshed by the owner's heartbeats"),
    KeyName("job_failed", "{prefix}:job:{job_id}:failed", "set", "worker (write_items.lua)",
            "indexes of the job's failed items", "as the items hash"),
    KeyName("job_end", "{prefix}:job:{job_id}:end", "hash", "end_job.lua",
            "a finished job's `event` (its terminal event, JSON, section 5) and `data` "
            "(RQ's payload, moved out of the job hash, which then holds a stub: section 6)",
            "as the job hash (`result_ttl` after the end)"),
    KeyName("job_risk", "{prefix}:job:{job_id}:risk", "hash", "worker",
            "item index -> `<worker>\\|<step>\\|<unix time>` while that item is in a step "
            "that could kill its worker", "cleared after the step; left behind if the worker died"),
    KeyName("job_kills", "{prefix}:job:{job_id}:kills", "hash", "worker",
            "`count`: workers that died while one of the job's items was in such a step",
            "the failure TTL ({failure_ttl_days} days) from the last death"),
    KeyName("job_batch", "{prefix}:job:{job_id}:batch", "string", "producer",
            "the batch id of a job in a batch",
            "none while the job runs; the job hash's lifetime once it ends"),
    KeyName("rq_results", "rq:results:{job_id}", "stream", _RQ,
            "a failed job's failure message (section 6); none for a finished job, whose "
            "summary the job hash keeps", "same as the job hash"),
    KeyName("done_channel", "{prefix}:done", "channel", "end_job.lua",
            "pub/sub: `{\"id\", \"status\"}` once per job that ends, and "
            "`{\"id\", \"status\", \"batch\": true}` once per batch (sections 5, 9)", _CHANNEL),
    KeyName("done_queue_channel", "{prefix}:done:{queue}", "channel", "end_job.lua",
            "pub/sub: the same message, for the jobs of one queue only", _CHANNEL),
    KeyName("batch", "{prefix}:batch:{batch_id}", "hash", "producer",
            "a batch's record (section 9): `task`, `created_at`, `labels` (JSON), `items`, "
            "`jobs`, `ttl`; once it ends `status`, `ended_at` and its jobs' ends counted by "
            "type (`finished`, `failed`, `canceled`); a batch made from an OpenAI batch file "
            "also `openai:lines`, `openai:skipped`, `openai:jobs` (its input order and skipped "
            "lines, docs/openai-batch.md)", "none while it runs; `ttl` s after it ends"),
    KeyName("batch_jobs", "{prefix}:batch:{batch_id}:jobs", "list", "producer",
            "the batch's job ids in order", "as the batch hash"),
    KeyName("batch_pending", "{prefix}:batch:{batch_id}:pending", "set",
            "producer, end_job.lua", "the batch's jobs that have not ended", "gone when empty"),
    KeyName("batch_events", "{prefix}:batch:{batch_id}:events", "stream", "end_job.lua",
            "the batch's one terminal event (section 9)", "as the batch hash"),
    KeyName("fair_jobs", "{prefix}:fair:{queue}:batch:{batch_id}", "list",
            "enqueue, worker (fair_take.lua)",
            "ids of the batch's jobs waiting in the queue, in order (`<batch_id>` empty for "
            "jobs without a batch), so a worker takes the batch's next job without scanning "
            "the queue (section 3a); an id taken otherwise stays until popped, then skipped",
            "none (popped as the batch's jobs are taken)"),
    KeyName("fair_ring", "{prefix}:fair:{queue}:ring", "zset", "enqueue, worker",
            "the batches with waiting jobs in the queue, scored by their fair-share tag: the "
            "lowest goes next (section 3a)", "none (a batch leaves it when its list empties)"),
    KeyName("fair_clock", "{prefix}:fair:{queue}:clock", "string", "worker",
            "the queue's fair-share virtual time: the tag of the last batch served",
            "none"),
    KeyName("jobs_index", "{prefix}:jobs", "zset", "enqueue (Python, enqueue.lua)",
            "every indexed job id, score = its `created_at` in epoch microseconds (section 8a)",
            "until the job is deleted, or its hash is found gone"),
    KeyName("jobs_queue_index", "{prefix}:jobs:queue:{queue}", "zset", "enqueue",
            "the same, for one queue", "as `<prefix>:jobs`"),
    KeyName("jobs_label_index", "{prefix}:jobs:label:{n}:{key}={value}", "zset", "enqueue",
            "the same, for one label; `<n>` = the key's length in UTF-8 bytes, so any key and "
            "value name one zset", "as `<prefix>:jobs`", lengths=(("n", "key"),)),
    KeyName("jobs_meta", "{prefix}:jobs:meta", "hash", "enqueue",
            "job id -> JSON `{\"task\", \"items\", \"queue\", \"labels\", \"created\"}` "
            "(section 8a)", "as `<prefix>:jobs`"),
    KeyName("jobs_tally", "{prefix}:jobs:tally", "hash", "enqueue, the scripts that change "
            "a job (tally block)",
            "job id -> JSON `{\"s\", \"n\", \"d\", \"f\", \"c\", \"t\"}`: the state the job "
            "is counted in, its items, items done and failed, its index score and the count "
            "hashes it is in (section 8b)",
            "until the job is deleted or its hash is found gone (then it is counted out)"),
    KeyName("jobs_state_index", "{prefix}:by-state:{name}", "zset", "tally block",
            "the jobs counted in state `<name>`, for the states RQ keeps no list or "
            "registry of (stopped, other), scored as `<prefix>:jobs`",
            "as `<prefix>:jobs:tally`"),
    KeyName("counts_queue", "{prefix}:counts:queue:{queue}", "hash", "tally block",
            "running counts of the queue's jobs (section 8b): `jobs`, `items`, `items_done`, "
            "`items_failed`, and per state `<state>` (jobs) and `<state>_items`",
            "deleted when its last job is counted out"),
    KeyName("counts_label", "{prefix}:counts:label:{n}:{key}={value}", "hash", "tally block",
            "the same counts, for the jobs carrying one label (`<n>` as in the label index)",
            "deleted when its last job is counted out", lengths=(("n", "key"),)),
    KeyName("batch_counts", "{prefix}:batch:{batch_id}:counts", "hash", "tally block",
            "the same counts, for the jobs of one batch", "as the batch hash once it ends; "
            "deleted when its last job is counted out"),
    KeyName("jobs_sweep", "{prefix}:jobs:sweep", "string", "worker",
            "the rank in `<prefix>:jobs` where the last sweep stopped", "none"),
    KeyName("worker_stats", "{prefix}:worker:{name}:stats", "hash", "worker",
            "live worker stats (section 7)", "a few stats intervals, refreshed while the "
            "worker lives"),
    KeyName("workers", "{prefix}:workers", "set", "worker",
            "names of workers that publish stats", "none (a stopped worker removes itself)"),
    KeyName("queue_starting", "{prefix}:starting:{queue}", "set", "worker",
            "names of workers starting to serve the queue (loading their model, not yet in "
            "`rq:workers:<queue>`); `vlmq enqueue` counts them as serving it",
            "{starting_ttl} s after the last refresh (each starting worker refreshes it); a "
            "worker leaves it once registered with RQ, or when it exits"),
    KeyName("redis_restart", "{prefix}:redis:restart", "hash", "worker",
            "left in a Redis that restarted empty: `last` (when, old and new run_id) and "
            "`job:<id>` for each job lost with it; `vlmq wait` reads it",
            "{restart_days} days"),
    KeyName("dead", "{prefix}:dead", "list", "worker",
            "queue entries no worker can run, newest first (at most {dead_max}): JSON "
            "`{\"queue\", \"entry\", \"reason\", \"worker\", \"at\"}`",
            "none (trimmed to {dead_max})"),
    KeyName("rq_worker", "rq:worker:{name}", "hash", _RQ,
            "one RQ worker (state, queues, death...)", "RQ's (while the worker lives)"),
    KeyName("rq_workers", "rq:workers", "set", _RQ, "every live RQ worker's key",
            "none (RQ keeps it current)"),
    KeyName("rq_queue_workers", "rq:workers:{queue}", "set", _RQ,
            "live RQ workers serving that queue", "none (RQ keeps it current)"),
    # A queue's registries (zsets of job ids scored by expiry), by the state vlmq shows.
    KeyName("rq_started", "rq:wip:{queue}", "zset", _RQ,
            "the queue's started jobs, scored by when their execution lapses", "none"),
    KeyName("rq_finished", "rq:finished:{queue}", "zset", _RQ,
            "the queue's finished jobs, scored by when their record expires", "none"),
    KeyName("rq_failed", "rq:failed:{queue}", "zset", _RQ,
            "the queue's failed jobs, scored by when their record expires", "none"),
    KeyName("rq_deferred", "rq:deferred:{queue}", "zset", _RQ,
            "the queue's deferred jobs (RQ's; vlmq enqueues none)", "none"),
    KeyName("rq_scheduled", "rq:scheduled:{queue}", "zset", _RQ,
            "the queue's scheduled jobs (RQ's; vlmq enqueues none)", "none"),
    KeyName("rq_canceled", "rq:canceled:{queue}", "zset", _RQ,
            "the queue's canceled jobs (section 8)", "none"),
    KeyName("schedules", "{prefix}:schedules", "set", "`vlmq schedule`",
            "schedule names", "none"),
    KeyName("schedule", "{prefix}:schedule:{name}", "hash", "`vlmq schedule`, schedulers",
            "a schedule's definition (`def`, JSON), `next_due` (epoch ms) and `paused`",
            "until the schedule is removed"),
    KeyName("schedule_done", "{prefix}:schedule:{name}:done", "set", "schedulers",
            "the work units (settings, source, sha256, page) the schedule has done",
            "as the schedule"),
    KeyName("schedule_pending", "{prefix}:schedule:{name}:pending", "hash", "schedulers",
            "job id -> the units (and roots) of the schedule's jobs not yet finished",
            "as the schedule"),
    KeyName("schedule_runs", "{prefix}:schedule:{name}:runs", "hash", "schedulers",
            "run id -> run record (due time, job id, items, skipped, status)",
            "as the schedule"),
    KeyName("schedule_files", "{prefix}:schedule:{name}:files", "hash", "schedulers",
            "path -> `size:mtime_ns:sha256:kind:pages` from the schedule's last run",
            "as the schedule"),
    KeyName("schedule_lock", "{prefix}:schedule:{name}:lock", "string", "schedulers",
            "held while one run of the schedule reads its paths and enqueues",
            "the lock's timeout"),
    KeyName("result_cache_gen", "{prefix}:rcache:gen:{g}", "hash", "worker",
            "field: an item key's digest (128 bits, base64url, 22 characters); value: "
            "`<job id> <index> <text hash>`, the item result that holds the text and the "
            "first 8 hex digits of the text's sha256",
            "until the end of span `g` (a day: `g` = epoch seconds // 86400); entries sit in "
            "the span in which their target result expires, capped by the cache's ttl",
            section="rcache"),
    KeyName("api_file", "{prefix}:api:file:{name}", "hash", "vlmq api",
            "an uploaded file's metadata (owner, filename, purpose, bytes, sha256, "
            "created_at); its bytes are in the server's --files-dir, never in Redis",
            "until DELETE /v1/files/<id>"),
    KeyName("api_files", "{prefix}:api:files:{name}", "zset", "vlmq api",
            "one API key's files (`<name>`: the key's digest), scored by created_at (ms)",
            "as its files"),
    KeyName("api_batch", "{prefix}:api:batch:{batch_id}", "hash", "vlmq api",
            "an API batch (docs/openai-api.md): owner, input file, window, metadata, the "
            "vlmq batch it enqueued, its validation errors and lifecycle times",
            "30 days"),
    KeyName("api_batches", "{prefix}:api:batches:{name}", "zset", "vlmq api",
            "one API key's batches, scored by created_at (ms)", "30 days after the last"),
    KeyName("api_live", "{prefix}:api:live", "set", "vlmq api",
            "API batches not yet ended, which the server checks for their completion window",
            "none (a batch leaves it when it ends)"),
)

KEY: Mapping[str, KeyName] = {k.name: k for k in KEY_TABLE}

# RQ's names, from the table. They mirror rq 3.0 (tests/shared/test_keys.py checks them
# against RQ's own classes; tests/shared/test_payload.py pins the wire names).
RQ_QUEUES = KEY["rq_queues"].pattern
RQ_WORKERS = KEY["rq_workers"].pattern
# A queue's registries by the name vlmq shows each under: kind -> pattern with {queue}.
RQ_REGISTRIES = {kind: KEY[f"rq_{kind}"].pattern for kind in
                 ("started", "finished", "failed", "deferred", "scheduled", "canceled")}


def _name(entry: str, prefix: str = "", /, **values: str) -> str:
    """The key `entry` of KEY_TABLE names, for `values` under `prefix`."""
    return KEY[entry].build(prefix, values)


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix; build one per connection, pass it everywhere."""

    prefix: str = DEFAULT_PREFIX

    @classmethod
    def from_env(cls) -> Keys:
        return cls(os.environ.get(PREFIX_ENV, DEFAULT_PREFIX))

    def blob(self, sha256: str) -> str:
        return _name("blob", self.prefix, sha256=sha256)

    def blob_jobs(self, sha256: str) -> str:
        """Zset: the jobs holding a blob, scored by when the hold ends in epoch ms (`inf`
        while the job is queued or running; a failed job's failure record expiry)."""
        return _name("blob_jobs", self.prefix, sha256=sha256)

    def job_inputs(self, job_id: str) -> str:
        """Hash: sha256 of each blob a job holds -> the job's keep_inputs (seconds)."""
        return _name("job_inputs", self.prefix, job_id=job_id)

    def job_items(self, job_id: str) -> str:
        """Hash: item index (decimal string) -> ItemResult JSON."""
        return _name("job_items", self.prefix, job_id=job_id)

    def job_events(self, job_id: str) -> str:
        """Stream of progress events for one job (item done, job finished/failed)."""
        return _name("job_events", self.prefix, job_id=job_id)

    def job_tokens(self, job_id: str) -> str:
        """Stream of an interactive job's decoded text (shared/chat.py's entries)."""
        return _name("job_tokens", self.prefix, job_id=job_id)

    def job_owner(self, job_id: str) -> str:
        """String: the execution that owns a running job, `<execution id> <worker name>`.

        Set when a worker starts the job, deleted when it ends it. Every write a worker
        makes for the job (item results, events, the job's end, heartbeats) checks it
        atomically, so a worker that lost the job (stalled past its heartbeat) writes nothing.
        """
        return _name("job_owner", self.prefix, job_id=job_id)

    @property
    def done_channel(self) -> str:
        """Pub/sub channel: `{"id": ..., "status": ...}` once per job that ends."""
        return _name("done_channel", self.prefix)

    def done_queue_channel(self, queue: str) -> str:
        """Pub/sub channel: the same message, for jobs of one queue only."""
        return _name("done_queue_channel", self.prefix, queue=queue)

    def job_risk(self, job_id: str) -> str:
        """Hash: item index -> "<worker>|<step>|<unix time>" while that item is in a step
        that could kill its worker (worker/jobs/poison.py); left behind if it did."""
        return _name("job_risk", self.prefix, job_id=job_id)

    def job_kills(self, job_id: str) -> str:
        """Hash: how many workers died while one of this job's items was in risky work."""
        return _name("job_kills", self.prefix, job_id=job_id)

    def job_batch(self, job_id: str) -> str:
        """String: the id of the batch a job belongs to, written with the batch record
        before the job is enqueued; end_job.lua reads it to count the job's end once."""
        return _name("job_batch", self.prefix, job_id=job_id)

    # --- job indexes (shared/job_index.py; PROTOCOL.md section "Job indexes") ---------

    @property
    def jobs_index(self) -> str:
        """Zset: every indexed job id, scored by its enqueue time (RQ's created_at, epoch µs)."""
        return _name("jobs_index", self.prefix)

    def jobs_queue_index(self, queue: str) -> str:
        """Zset: the indexed jobs of one queue, scored as jobs_index."""
        return _name("jobs_queue_index", self.prefix, queue=queue)

    def jobs_label_index(self, key: str, value: str) -> str:
        """Zset: the indexed jobs carrying label key=value, scored as jobs_index.

        The key's length in UTF-8 bytes comes first, so any key and value (both may hold
        '=' or ':') name exactly one zset."""
        return _name("jobs_label_index", self.prefix, key=key, value=value)

    @property
    def jobs_meta(self) -> str:
        """Hash: job id -> JSON summary {task, items, queue, labels, created} for listing
        without the payload; outlives the job hash so stale index entries can be found."""
        return _name("jobs_meta", self.prefix)

    @property
    def jobs_tally(self) -> str:
        """Hash: job id -> JSON record of what the job adds to its counts (the state it is
        counted in, items, done, failed, score, count hashes), so whoever changes or
        forgets the job moves exactly that between counts (shared/tally_lib.lua)."""
        return _name("jobs_tally", self.prefix)

    def jobs_state_index(self, name: str) -> str:
        """Zset: the jobs counted in state `name`, scored as jobs_index; `vlmq jobs
        --status` reads it for states RQ keeps in no registry (stopped...)."""
        return _name("jobs_state_index", self.prefix, name=name)

    def counts_queue(self, queue: str) -> str:
        """Hash: running counts of one queue's jobs by state and of their items, so `vlmq
        status` reads a queue's queued items in one HGET instead of summing its jobs."""
        return _name("counts_queue", self.prefix, queue=queue)

    def counts_label(self, key: str, value: str) -> str:
        """Hash: the same running counts for the jobs carrying label key=value."""
        return _name("counts_label", self.prefix, key=key, value=value)

    def api_file(self, file_id: str) -> str:
        """Hash: an API upload's metadata; the bytes stay in the server's files folder."""
        return _name("api_file", self.prefix, name=file_id)

    def api_files(self, owner: str) -> str:
        """Zset: one API key's files, by creation time, for GET /v1/files."""
        return _name("api_files", self.prefix, name=owner)

    def api_batch(self, batch_id: str) -> str:
        """Hash: an API batch's record, the vlmq batch it became and its lifecycle."""
        return _name("api_batch", self.prefix, batch_id=batch_id)

    def api_batches(self, owner: str) -> str:
        """Zset: one API key's batches, by creation time, for GET /v1/batches."""
        return _name("api_batches", self.prefix, name=owner)

    @property
    def api_live(self) -> str:
        """Set: API batches not ended, swept for their completion window."""
        return _name("api_live", self.prefix)

    def queue_starting(self, queue: str) -> str:
        """Set: the workers starting to serve `queue`, before they register with RQ."""
        return _name("queue_starting", self.prefix, queue=queue)

    def batch_counts(self, batch_id: str) -> str:
        """Hash: the same running counts for the jobs of one batch."""
        return _name("batch_counts", self.prefix, batch_id=batch_id)

    def fair_jobs(self, queue: str, batch_id: str) -> str:
        """List: the ids of one batch's jobs waiting in `queue` (batch_id C.LOOSE_SHARE:
        jobs without a batch), pushed at enqueue and popped by the worker's fair take."""
        return _name("fair_jobs", self.prefix, queue=queue, batch_id=batch_id)

    def fair_ring(self, queue: str) -> str:
        """Zset: the batches with jobs waiting in `queue`, by fair-share tag (lowest next)."""
        return _name("fair_ring", self.prefix, queue=queue)

    def fair_clock(self, queue: str) -> str:
        """String: `queue`'s fair-share virtual time (where a returning batch starts)."""
        return _name("fair_clock", self.prefix, queue=queue)

    @property
    def jobs_sweep(self) -> str:
        """String: the jobs_index rank where the last sweep for expired jobs stopped."""
        return _name("jobs_sweep", self.prefix)

    def job_failed(self, job_id: str) -> str:
        """Set: indexes of a job's failed items (write_items.lua); expires with the items
        hash, so done = HLEN items and failed = SCARD of this."""
        return _name("job_failed", self.prefix, job_id=job_id)

    def job_end(self, job_id: str) -> str:
        """Hash: a finished job's terminal event and its payload, so that its job hash
        holds only values of at most 64 B (Redis's compact encoding)."""
        return _name("job_end", self.prefix, job_id=job_id)

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's record (task, created_at, labels, items, jobs, ttl) and, once it
        ends, its status and its jobs' end counts (finished, failed, canceled)."""
        return _name("batch", self.prefix, batch_id=batch_id)

    def batch_jobs(self, batch_id: str) -> str:
        """List: a batch's job ids in order (its items' order)."""
        return _name("batch_jobs", self.prefix, batch_id=batch_id)

    def batch_pending(self, batch_id: str) -> str:
        """Set: the batch's jobs that have not ended; the last one out ends the batch."""
        return _name("batch_pending", self.prefix, batch_id=batch_id)

    def batch_events(self, batch_id: str) -> str:
        """Stream: the batch's one terminal event (end_job.lua writes it)."""
        return _name("batch_events", self.prefix, batch_id=batch_id)

    @property
    def redis_restart(self) -> str:
        """Hash a worker leaves in a Redis that restarted empty: when, and which jobs it
        lost with it, so `vlmq wait` can say why a job is gone."""
        return _name("redis_restart", self.prefix)

    def worker_stats(self, name: str) -> str:
        """Hash of one worker's live stats; expires when the worker stops refreshing it."""
        return _name("worker_stats", self.prefix, name=name)

    @property
    def dead(self) -> str:
        """List of queue entries no worker can run (undecodable, bad id, unreadable hash),
        newest first, each a JSON object with the reason."""
        return _name("dead", self.prefix)

    @property
    def workers(self) -> str:
        """Set of worker names that have published stats."""
        return _name("workers", self.prefix)

    def result_cache_gen(self, gen: int) -> str:
        """Hash: one generation of the result cache (worker/results/cache.py). Field = an
        item key's digest (128 bits, base64url), value = "<job id> <index> <text hash>",
        the stored item result holding its text; generation `gen` holds the entries whose
        target expires in day `gen` (epoch s // span) and expires at that day's end."""
        return _name("result_cache_gen", self.prefix, g=str(gen))

    @property
    def schedules(self) -> str:
        """Set of schedule names."""
        return _name("schedules", self.prefix)

    def schedule(self, name: str) -> str:
        """Hash: a schedule's definition (def, JSON), next_due (epoch ms) and paused."""
        return _name("schedule", self.prefix, name=name)

    def schedule_done(self, name: str) -> str:
        """Set of the work units (settings, source, sha256, page) a schedule has done."""
        return _name("schedule_done", self.prefix, name=name)

    def schedule_pending(self, name: str) -> str:
        """Hash: job id -> the units (and roots) of a schedule's job not yet finished."""
        return _name("schedule_pending", self.prefix, name=name)

    def schedule_runs(self, name: str) -> str:
        """Hash: run id -> run record (due time, job id, items, skipped, status)."""
        return _name("schedule_runs", self.prefix, name=name)

    def schedule_files(self, name: str) -> str:
        """Hash: path -> "size:mtime_ns:sha256:kind:pages" from a schedule's last run."""
        return _name("schedule_files", self.prefix, name=name)

    def schedule_lock(self, name: str) -> str:
        """Lock held while one run of a schedule reads its paths and enqueues."""
        return _name("schedule_lock", self.prefix, name=name)

    # --- RQ's keys (static: RQ's names take no vlmq prefix) ---------------------------

    @staticmethod
    def rq_job(job_id: str) -> str:
        return _name("rq_job", job_id=job_id)

    @staticmethod
    def rq_job_glob() -> str:
        """SCAN pattern for job hashes; it also matches RQ's `rq:job:<id>:<sub>` keys,
        which rq_job_id tells apart."""
        return _name("rq_job", job_id="*")

    @staticmethod
    def rq_job_id(key: str) -> str | None:
        """The job id of a job hash key, or None for any other key (RQ keeps a job's
        dependents and dependencies under `rq:job:<id>:...`)."""
        head = _name("rq_job", job_id="")
        job_id = key.removeprefix(head)
        return job_id if key.startswith(head) and job_id and ":" not in job_id else None

    @staticmethod
    def rq_queue(name: str) -> str:
        return _name("rq_queue", queue=name)

    @staticmethod
    def rq_intermediate(queue: str) -> str:
        """List: entries taken from `queue` and not yet started (RQ's intermediate queue)."""
        return _name("rq_intermediate", queue=queue)

    @staticmethod
    def rq_registry(kind: str, queue: str) -> str:
        """One of RQ_REGISTRIES (started, finished, failed, ...) of `queue`."""
        return _name(f"rq_{kind}", queue=queue)

    @staticmethod
    def rq_results(job_id: str) -> str:
        """Stream of a job's results (RQ's Result entries)."""
        return _name("rq_results", job_id=job_id)

    @staticmethod
    def rq_worker(name: str) -> str:
        """Hash of one RQ worker (state, queues, death...)."""
        return _name("rq_worker", name=name)

    @staticmethod
    def rq_queue_workers(queue: str) -> str:
        """Set of the live workers that listen on `queue`."""
        return _name("rq_queue_workers", queue=queue)

    @staticmethod
    def rq_name(key: str) -> str:
        """The name in a queue or worker key (members of RQ_QUEUES and RQ_WORKERS are
        `rq:queue:<name>` and `rq:worker:<name>`)."""
        return key.split(":", 2)[-1]
