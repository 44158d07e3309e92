"""Queue entries and job hashes are checked before RQ reads them; poison goes to `<prefix>:dead`.

Anything can be pushed onto an RQ queue list: bytes that are not UTF-8 (RQ's dequeue
raises UnicodeDecodeError and the worker dies), an id RQ splits at ':' into another job's
id, a hash without `data` (RQ skips it and the job stays queued forever), an id whose hash
is gone (evicted, or lost with a Redis restart: RQ skips it without a word), `data` that
inflates to a gigabyte (RQ inflates it unbounded inside Job.fetch), JSON nested past the
parser's recursion limit. `inspect` finds each of these from raw Redis reads, with every
read bounded; the worker then dead-letters the entry with its reason, fails the job where
a hash exists, logs one line, and goes on. `scrub_intermediate` does the same for RQ's
intermediate list, whose maintenance would otherwise fail on such an entry every minute
and leave its lock held for 899 s.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq.queue import Queue
from rq.utils import now, utcformat

from vlmq.shared import bounded_reads as bounded
from vlmq.shared import constants as C
from vlmq.shared.enqueue import fail_job, timeout_problem
from vlmq.shared.keys import JOB_ID_RE, Keys

log = logging.getLogger(__name__)

# Fields of an RQ job hash that RQ parses as JSON (JSONSerializer) when it loads the job.
_JSON_FIELDS = ("meta", "result", "webhooks", "dependency_ids")
# A real job hash is a few KB plus its data; anything far past the data cap is hostile.
MAX_HASH_BYTES = 2 * C.MAX_FIELD_BYTES + 1024 * 1024
MISSING_HASH = ("its job hash is gone (evicted by a Redis whose maxmemory-policy is not "
                "noeviction, lost with a Redis restart, or deleted by hand): the job is lost")


@dataclass(frozen=True)
class Verdict:
    """What a raw queue entry is: a job id RQ may load, or a reason it must not."""

    job_id: str | None  # None when the entry is not even text
    reason: str | None  # None: safe to hand to RQ
    hash_exists: bool = False

    @property
    def label(self) -> str:
        """The id for log lines and Refused: bounded, since an entry can be megabytes."""
        if self.job_id is None:
            return "<undecodable>"
        if JOB_ID_RE.fullmatch(self.job_id):
            return self.job_id
        shown = repr(self.job_id)  # a newline or control character stays visible
        return shown if len(shown) <= 80 else f"{shown[:77]}..."


def decode_entry(raw: bytes | str) -> str | None:
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def inspect(conn: Redis, raw: bytes | str) -> Verdict:
    """Check one queue entry and its job hash with bounded reads; see module docstring."""
    return inspect_many(conn, [raw])[0][0]


def inspect_many(conn: Redis, raws: Sequence[bytes | str]
                 ) -> list[tuple[Verdict, dict[bytes, bytes] | None]]:
    """`inspect` for several entries in two round trips: the bounded size checks of every
    hash in one pipeline, then the whole hash of each that passed in another (HGETALL, read
    only once its size is known). A safe entry's hash comes back with its verdict, for RQ's
    Job.restore; None for the others (and when the hash vanished between the two reads)."""
    out: list[tuple[Verdict, dict[bytes, bytes] | None]] = [(Verdict(None, ""), None)] * len(raws)
    sized = _check_ids(conn, raws, out)
    readable = _check_sizes(conn, sized, out)
    _read_hashes(conn, readable, out)
    return out


# Each step below sets the verdicts of the entries it refuses in `out` and returns the
# (position, job id) of those that go on to the next one.

def _check_ids(conn: Redis, raws: Sequence[bytes | str],
               out: list[tuple[Verdict, dict[bytes, bytes] | None]]) -> list[tuple[int, str]]:
    """Entries that are text and a valid job id: nothing else becomes part of a key."""
    sized: list[tuple[int, str]] = []
    for i, raw in enumerate(raws):
        job_id = decode_entry(raw)
        if job_id is None:
            out[i] = (Verdict(None, f"queue entry {raw!r:.80} is not UTF-8 text"), None)
        elif not JOB_ID_RE.fullmatch(job_id):
            out[i] = (Verdict(job_id, f"queue entry {job_id!r:.80} is not a valid job id "
                                      "(must match [A-Za-z0-9_-]{1,128})",
                              hash_exists=bool(conn.exists(Keys.rq_job(job_id)))), None)
        else:
            sized.append((i, job_id))
    return sized


def _check_sizes(conn: Redis, sized: list[tuple[int, str]],
                 out: list[tuple[Verdict, dict[bytes, bytes] | None]]) -> list[tuple[int, str]]:
    """Entries whose hash exists, has data and is small enough to read whole (one pipeline
    of bounded reads)."""
    if not sized:
        return []
    with conn.pipeline(transaction=False) as pipe:
        for _, job_id in sized:
            key = Keys.rq_job(job_id)
            pipe.exists(key)
            pipe.memory_usage(key, samples=0)
            pipe.hstrlen(key, "data")
        sizes = pipe.execute()
    readable: list[tuple[int, str]] = []
    for n, (i, job_id) in enumerate(sized):
        exists, size, data_len = sizes[3 * n:3 * n + 3]
        if not exists:
            # RQ would skip it without a word; on an evicting or restarted Redis that hides
            # a lost job, so it is dead-lettered and logged (no hash to fail).
            out[i] = (Verdict(job_id, MISSING_HASH), None)
        elif size is not None and int(size) > MAX_HASH_BYTES:
            out[i] = (Verdict(job_id, f"job hash is {size} bytes, over the "
                                      f"{MAX_HASH_BYTES // (1024 * 1024)} MiB limit", True), None)
        elif not data_len:
            out[i] = (Verdict(job_id, "job hash has no data field (not an RQ job)", True), None)
        else:
            readable.append((i, job_id))
    return readable


def _read_hashes(conn: Redis, readable: list[tuple[int, str]],
                 out: list[tuple[Verdict, dict[bytes, bytes] | None]]) -> None:
    """The hashes of sized entries, read whole (one pipeline) and checked field by field."""
    if not readable:
        return
    with conn.pipeline(transaction=False) as pipe:
        for _, job_id in readable:
            pipe.hgetall(Keys.rq_job(job_id))
        hashes = pipe.execute()
    for (i, job_id), fields in zip(readable, hashes, strict=True):
        if not fields:  # deleted between the two reads: nothing to run or fail
            out[i] = (Verdict(job_id, None, hash_exists=False), None)
            continue
        verdict = check_fields(job_id, fields)
        out[i] = (verdict, fields if verdict.reason is None else None)


def check_fields(job_id: str, fields: Mapping[bytes, bytes]) -> Verdict:
    """The content checks on a hash whose size was checked: a timeout RQ can parse, and
    data and JSON fields that inflate and parse within bounds."""
    problem = timeout_problem(fields.get(b"timeout"))
    if problem:
        return Verdict(job_id, problem, True)
    try:
        payload = bounded.inflate(fields.get(b"data", b""), what="job data")
        bounded.loads(payload, what="job data")
        for name in _JSON_FIELDS:
            value = fields.get(name.encode())
            if value:
                bounded.loads(value, what=f"job {name}")
    except bounded.BoundError as exc:
        return Verdict(job_id, f"refused: {exc}", True)
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass  # not JSON: a clear refusal follows in payload_of, with the job failed by RQ
    return Verdict(job_id, None, True)


def dead_letter(conn: Redis, keys: Keys, queue: str, raw: bytes | str, reason: str,
                worker: str, *, pipeline: Pipeline | None = None) -> None:
    """Keep the entry and why it was refused, newest first, bounded."""
    entry = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
    record = json.dumps({"queue": queue, "entry": entry[:512], "reason": reason,
                         "worker": worker, "at": utcformat(now())})
    target: Any = pipeline if pipeline is not None else conn.pipeline(transaction=False)
    target.lpush(keys.dead, record)
    target.ltrim(keys.dead, 0, C.DEAD_LETTER_MAX - 1)
    if pipeline is None:
        target.execute()


def refuse(conn: Redis, keys: Keys, queue: Queue, raw: bytes | str, verdict: Verdict,
           worker: str) -> bool:
    """Take the entry out of the intermediate list, dead-letter it and fail its job.

    The LREM is the claim: when two workers find the same entry, only the one that removed
    it records it. Returns whether this call did.
    """
    reason = verdict.reason or "refused"
    if not conn.lrem(queue.intermediate_queue_key, 1, raw):  # type: ignore[arg-type]  # bytes ok
        return False
    with conn.pipeline() as pipe:
        dead_letter(conn, keys, queue.name, raw, reason, worker, pipeline=pipe)
        if verdict.hash_exists and verdict.job_id is not None:
            # By id: RQ may not be able to load this hash at all.
            fail_job(pipe, keys, verdict.job_id, queue.name,
                     f"vlmq refused job {verdict.job_id}: {reason}")
        pipe.execute()
    log.error("queue %s: entry %s dead-lettered: %s", queue.name, verdict.label, reason)
    return True


def scrub_intermediate(conn: Redis, keys: Keys, queue: Queue, worker: str) -> int:
    """Dead-letter poison entries of `queue`'s intermediate list before RQ's maintenance
    reads it. Healthy entries (another worker between its pop and its start) are left."""
    refused = 0
    for raw in conn.lrange(queue.intermediate_queue_key, 0, -1):
        verdict = inspect(conn, raw)
        if verdict.reason is not None and refuse(conn, keys, queue, raw, verdict, worker):
            refused += 1
    return refused
