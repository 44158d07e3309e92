"""Queue entries and job hashes are checked before RQ reads them; poison goes to `<prefix>:dead`.

Anything can be pushed onto an RQ queue list: bytes that are not UTF-8 (RQ's dequeue
raises UnicodeDecodeError and the worker dies), an id RQ splits at ':' into another job's
id, a hash without `data` (RQ skips it and the job stays queued forever), an id whose hash
is gone (evicted, or lost with a Redis restart: RQ skips it without a word), `data` that
inflates to a gigabyte (RQ inflates it unbounded inside Job.fetch), JSON nested past the
parser's recursion limit or holding a number Python cannot convert, a job key of another
Redis type than the protocol's (every later command on it answers WRONGTYPE). `inspect`
finds each of these from raw Redis reads, with every read bounded and every per-key error
the entry's own; the worker then dead-letters the entry with its reason, fails the job
where a hash exists, logs one line, and goes on. `scrub_intermediate` does the same for RQ's
intermediate list, whose maintenance would otherwise fail on such an entry every minute
and leave its lock held for 899 s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import ResponseError
from rq.queue import Queue
from rq.utils import now, utcformat

from vlmq.shared import bounded_reads
from vlmq.shared import constants as C
from vlmq.shared.enqueue import fail_job, timeout_problem
from vlmq.shared.keys import JOB_ID_RE, KEY_TABLE, KeyName, Keys
from vlmq.shared.redis_text import as_str

log = logging.getLogger(__name__)

# Fields of an RQ job hash that RQ parses as JSON when it loads the job, with the shape RQ
# later relies on (None: any JSON; RQ itself survives text that is not JSON in these).
_LENIENT = ("result", "webhooks")
_JSON_SHAPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "meta": ("a JSON object", lambda v: isinstance(v, dict)),
    "dependency_ids": ("a list of job ids",
                       lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "retry_intervals": ("a list of seconds", lambda v: _seconds_list(v)),
    "repeat_intervals": ("a list of seconds", lambda v: _seconds_list(v)),
}
# Fields RQ reads with int(); each ends up in a TTL, a count or a timeout, where a number
# past 12 digits makes Redis refuse the command that carries it.
_INT_FIELDS = ("result_ttl", "failure_ttl", "ttl", "retries_left", "number_of_retries",
               "repeats_left", "success_callback_timeout", "failure_callback_timeout",
               "stopped_callback_timeout", "rate_limit_concurrency")
_INT_RE = re.compile(rb"-?[0-9]{1,12}")
# A real job hash is a few KB plus its data; anything far past the data cap is hostile.
MAX_HASH_BYTES = 2 * C.MAX_FIELD_BYTES + 1024 * 1024
# Every key of one job, with the Redis type the protocol gives it: a producer that wrote one
# of another type (a list at rq:job:<id>) would make each command on it fail with WRONGTYPE.
JOB_KEYS: tuple[KeyName, ...] = tuple(k for k in KEY_TABLE if k.params == ("job_id",))
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


def inspect(conn: Redis, keys: Keys, raw: bytes | str) -> Verdict:
    """Check one queue entry and its job hash with bounded reads; see module docstring."""
    return inspect_many(conn, keys, [raw])[0][0]


def inspect_many(conn: Redis, keys: Keys, raws: Sequence[bytes | str]
                 ) -> list[tuple[Verdict, dict[bytes, bytes] | None]]:
    """`inspect` for several entries in two round trips: the type of every key of each job
    and the bounded size checks of every hash in one pipeline, then the whole hash of each
    that passed in another (HGETALL, read only once its size is known). A safe entry's hash
    comes back with its verdict, for RQ's Job.restore; None for the others (and when the
    hash vanished between the two reads)."""
    out: list[tuple[Verdict, dict[bytes, bytes] | None]] = [(Verdict(None, ""), None)] * len(raws)
    sized = _check_ids(conn, raws, out)
    readable = _check_sizes(conn, keys, sized, out)
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
            # Failed by id only where that key is a hash: HSET on anything else is refused.
            is_hash = as_str(conn.type(Keys.rq_job(job_id))) == "hash"
            out[i] = (Verdict(job_id, f"queue entry {job_id!r:.80} is not a valid job id "
                                      "(must match [A-Za-z0-9_-]{1,128})",
                              hash_exists=is_hash), None)
        else:
            sized.append((i, job_id))
    return sized


def _check_sizes(conn: Redis, keys: Keys, sized: list[tuple[int, str]],
                 out: list[tuple[Verdict, dict[bytes, bytes] | None]]) -> list[tuple[int, str]]:
    """Entries whose keys all have the protocol's types and whose hash exists, has data and
    is small enough to read whole (one pipeline of bounded reads, an error in it the
    entry's own)."""
    if not sized:
        return []
    width = len(JOB_KEYS) + 2
    with conn.pipeline(transaction=False) as pipe:
        for _, job_id in sized:
            for name in JOB_KEYS:
                pipe.type(name.build(keys.prefix, {"job_id": job_id}))
            key = Keys.rq_job(job_id)
            pipe.memory_usage(key, samples=0)
            pipe.hstrlen(key, "data")
        replies = pipe.execute(raise_on_error=False)
    readable: list[tuple[int, str]] = []
    for n, (i, job_id) in enumerate(sized):
        row = replies[width * n:width * (n + 1)]
        verdict = _size_verdict(job_id, keys, row[:-2], row[-2], row[-1])
        if verdict is None:
            readable.append((i, job_id))
        else:
            out[i] = (verdict, None)
    return readable


def _size_verdict(job_id: str, keys: Keys, types: Sequence[Any], size: Any,
                  data_len: Any) -> Verdict | None:
    """The refusal of one entry from its keys' types and its hash's sizes, or None."""
    by_name = dict(zip((k.name for k in JOB_KEYS), types, strict=True))
    hash_type = _reply(by_name["rq_job"])
    if hash_type == "none":
        # RQ would skip it without a word; on an evicting or restarted Redis that hides
        # a lost job, so it is dead-lettered and logged (no hash to fail).
        return Verdict(job_id, MISSING_HASH)
    is_hash = hash_type == "hash" and not wrong_type(size) and not wrong_type(data_len)
    problem = _type_problem(job_id, keys, by_name)
    if problem is not None or not is_hash:
        return Verdict(job_id, problem or _wrong(Keys.rq_job(job_id), "hash"),
                       hash_exists=is_hash)
    if size is not None and int(size) > MAX_HASH_BYTES:
        return Verdict(job_id, f"job hash is {size} bytes, over the "
                               f"{MAX_HASH_BYTES // (1024 * 1024)} MiB limit", True)
    if not data_len:
        return Verdict(job_id, "job hash has no data field (not an RQ job)", True)
    return None


def _type_problem(job_id: str, keys: Keys, types: Mapping[str, Any]) -> str | None:
    """The first key of the job whose Redis type is not the protocol's, said plainly."""
    for name in JOB_KEYS:
        found = _reply(types[name.name])
        if found not in ("none", name.type):
            return _wrong(name.build(keys.prefix, {"job_id": job_id}), name.type, found)
    return None


def _wrong(key: str, want: str, found: str | None = None) -> str:
    what = f"a Redis {found}" if found else "of another Redis type"
    return (f"its key {key} is {what}, where vlmq keeps a {want} (written by hand?): no "
            "command on it can succeed")


def _reply(reply: Any) -> str:
    """A TYPE reply as text; an error reply (not a per-key one) is raised."""
    if isinstance(reply, Exception):
        raise reply
    return as_str(reply)


def wrong_type(reply: Any) -> bool:
    """Whether a pipeline reply is Redis's WRONGTYPE refusal (a key of another type);
    any other error reply is the server's, not the entry's, and is raised."""
    if not isinstance(reply, Exception):
        return False
    if isinstance(reply, ResponseError) and "WRONGTYPE" in str(reply):
        return True
    raise reply


def _read_hashes(conn: Redis, readable: list[tuple[int, str]],
                 out: list[tuple[Verdict, dict[bytes, bytes] | None]]) -> None:
    """The hashes of sized entries, read whole (one pipeline) and checked field by field."""
    if not readable:
        return
    with conn.pipeline(transaction=False) as pipe:
        for _, job_id in readable:
            pipe.hgetall(Keys.rq_job(job_id))
        hashes = pipe.execute(raise_on_error=False)
    for (i, job_id), fields in zip(readable, hashes, strict=True):
        if wrong_type(fields):  # replaced by another type between the two reads
            out[i] = (Verdict(job_id, _wrong(Keys.rq_job(job_id), "hash")),
                      None)
        elif not fields:  # deleted between the two reads: nothing to run or fail
            out[i] = (Verdict(job_id, None, hash_exists=False), None)
        else:
            verdict = check_fields(job_id, fields)
            out[i] = (verdict, fields if verdict.reason is None else None)


def check_fields(job_id: str, fields: Mapping[bytes, bytes]) -> Verdict:
    """The content checks on a hash whose size was checked: a timeout and whole numbers RQ
    can parse and Redis can use, data and JSON fields that inflate and parse within bounds,
    and the JSON fields RQ relies on of the shape it expects."""
    problem = timeout_problem(fields.get(b"timeout")) or _int_problem(fields)
    if problem:
        return Verdict(job_id, problem, True)
    try:
        _check_data(fields.get(b"data", b""))
        problem = next(filter(None, (_json_problem(name, fields.get(name.encode()))
                                     for name in (*_LENIENT, *_JSON_SHAPES))), None)
    except bounded_reads.BoundError as exc:
        return Verdict(job_id, f"refused: {exc}", True)
    return Verdict(job_id, problem, True)


def _int_problem(fields: Mapping[bytes, bytes]) -> str | None:
    for name in _INT_FIELDS:
        raw = fields.get(name.encode())
        if raw is not None and not _INT_RE.fullmatch(raw):
            return (f"job field {name} {as_str(raw[:40])!r} is not a whole number of at most "
                    "12 digits")
    return None


def _check_data(raw: bytes) -> None:
    """Raises BoundError for data over a bound; data that is not JSON is refused with a
    clear reason later, by payload_of, with the job failed by RQ."""
    with contextlib.suppress(UnicodeDecodeError, json.JSONDecodeError):
        bounded_reads.loads(bounded_reads.inflate(raw, what="job data"), what="job data")


def _json_problem(name: str, raw: bytes | None) -> str | None:
    """Why RQ cannot use this JSON field (BoundError when over a bound), or None."""
    if not raw:
        return None
    try:
        value = bounded_reads.loads(raw, what=f"job {name}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None if name in _LENIENT or name == "meta" else f"job {name} is not JSON"
    if name not in _JSON_SHAPES:
        return None
    shown, fits = _JSON_SHAPES[name]
    return None if fits(value) else f"job {name} is not {shown}"


def _seconds_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        type(x) in (int, float) and 0 <= x <= 10**9 for x in value)  # a bool is no interval


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
    it records it. Returns whether this call did. A command of the failure that Redis
    refuses (one of the job's keys replaced meanwhile by another type) is logged: the entry
    is out of the queue and dead-lettered either way, and the worker goes on.
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
        refused = [r for r in pipe.execute(raise_on_error=False) if isinstance(r, Exception)]
    log.error("queue %s: entry %s dead-lettered: %s", queue.name, verdict.label, reason)
    if refused:
        log.warning("queue %s: entry %s: Redis refused part of its failure: %s", queue.name,
                    verdict.label, refused[0])
    return True


def scrub_intermediate(conn: Redis, keys: Keys, queue: Queue, worker: str) -> int:
    """Dead-letter poison entries of `queue`'s intermediate list before RQ's maintenance
    reads it. Healthy entries (another worker between its pop and its start) are left."""
    refused = 0
    for raw in conn.lrange(queue.intermediate_queue_key, 0, -1):
        verdict = inspect(conn, keys, raw)
        if verdict.reason is not None and refuse(conn, keys, queue, raw, verdict, worker):
            refused += 1
    return refused
