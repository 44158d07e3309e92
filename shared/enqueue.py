"""Creating vlmq jobs as real RQ jobs (JSON serializer only) and reading them back.

Python producers go through RQ's own Queue API; `enqueue.lua` writes the same hash for
producers in other languages, and tests pin that both paths read back identically.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from redis import Redis, WatchError
from redis.client import Pipeline
from rq import Queue, Retry
from rq.exceptions import DeserializationError, TimeoutFormatError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import current_timestamp, now, utcformat

from vlmq.shared import bounded_reads, fair, job_index, lua, results
from vlmq.shared import constants as C
from vlmq.shared import settings as S
from vlmq.shared.blobs import BlobStore
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import RQ_QUEUES, Keys
from vlmq.shared.messages import JobPayload, parse_payload, utc_now_iso

# What RQ's Job.restore raises on a job hash it cannot read (bad dates, status, timeout...).
# RQ's parse_timeout asserts on a timeout like "86400.0": AssertionError belongs here too.
UNREADABLE_HASH_ERRORS = (ValueError, TypeError, KeyError, AttributeError, AssertionError,
                          TimeoutFormatError)


def timeout_problem(raw: bytes | str | None) -> str | None:
    """Why RQ cannot parse a job hash's `timeout` field, or None (RQ's own error for e.g.
    "86400.0" is a bare AssertionError with no message). A number longer than 12 digits is
    refused too: RQ would parse it, and Redis refuse every expiry computed from it."""
    if raw is None or raw in (b"", ""):
        return None
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if len(text) <= 13:
        try:
            int(text)  # what RQ's parse_timeout tries first
            return None
        except ValueError:
            digits, unit = text[:-1], text[-1:].lower()
            if digits.isascii() and digits.isdigit() and unit in ("d", "h", "m", "s"):
                return None
    return (f"job timeout {text[:40]!r} is not a whole number of seconds (at most 12 "
            "digits), nor digits with a unit d/h/m/s (e.g. 86400 or 24h)")


# At most this many UTF-8 bytes: Redis keeps a hash compact only while every value is
# <= 64 B (hash-max-listpack-value), and a finished job's hash is otherwise.
DESCRIPTION_BYTES = 64


def describe(payload: JobPayload) -> str:
    sources = sorted({i.source for i in payload.items})
    head = ", ".join(sources[:3]) + (f" +{len(sources) - 3} more" if len(sources) > 3 else "")
    text = f"vlmq {payload.task}: {len(payload.items)} item(s) from {head}"
    raw = text.encode()
    if len(raw) <= DESCRIPTION_BYTES:
        return text
    return raw[:DESCRIPTION_BYTES - 3].decode(errors="ignore") + "..."


def check_queue_name(queue: str) -> str:
    S.BY_NAME["queue"].check(queue)
    return queue


def check_job_id(job_id: str) -> str:
    S.BY_NAME["job_id"].check(job_id)
    return job_id


def enqueue(redis: Redis, payload: JobPayload, *, queue: str, job_id: str | None = None,
            timeout: int = C.JOB_TIMEOUT_S, result_ttl: int = C.RESULT_TTL_S,
            failure_ttl: int = C.FAILURE_TTL_S, pipeline: Pipeline | None = None,
            wire: Mapping[str, Any] | None = None, keys: Keys | None = None,
            fresh_id: bool = False) -> str:
    """Enqueue a validated payload as an RQ job; returns the job id.

    `wire`: the JSON form `payload` was parsed from, sent as it is (no second build).

    The job's hold on its input blobs (shared/blobs.py) and its index entries
    (shared/job_index.py) are written in the same MULTI as RQ's enqueue, so a job never
    exists without them, nor they without their job.
    A caller-chosen `job_id` that already names a job is refused (PayloadError) instead of
    overwriting it: the new job would otherwise inherit the old one's item results and
    resume from them. The id and its results key are WATCHed from the check to EXEC, so
    two producers racing for one id cannot both win; hence no `pipeline` with `job_id`.
    `fresh_id`: the caller made `job_id` itself just now (a uuid4 its batch record names),
    so no job can hold it: it is not checked, and it may go in a pipeline (three round
    trips fewer per job of a large set).
    """
    watched = _checked_id(queue, job_id, fresh_id=fresh_id, pipelined=pipeline is not None)
    keys = keys or Keys.from_env()
    pipe = pipeline if pipeline is not None else redis.pipeline(transaction=True)
    try:
        if watched is not None:
            pipe.watch(Keys.rq_job(watched), keys.job_items(watched))  # type: ignore[no-untyped-call]
            if pipe.exists(Keys.rq_job(watched), keys.job_items(watched)):
                raise PayloadError("job_id", f"a job with id {watched} already exists")
        if pipeline is None:
            pipe.multi()
        job = _enqueue_on(pipe, redis, payload, queue=queue, job_id=job_id, timeout=timeout,
                          result_ttl=result_ttl, failure_ttl=failure_ttl, wire=wire)
        jid = str(job.id)
        _index_and_hold(redis, keys, jid, payload, queue, job, pipe)
        if pipeline is None:
            pipe.execute()
    except WatchError as exc:
        raise PayloadError("job_id", f"a job with id {job_id} already exists") from exc
    finally:
        if pipeline is None:
            pipe.reset()
    return jid


def _checked_id(queue: str, job_id: str | None, *, fresh_id: bool,
                pipelined: bool) -> str | None:
    """Checks the names; returns the id to WATCH (a caller-chosen id that is not fresh)."""
    check_queue_name(queue)
    if job_id is not None:
        check_job_id(job_id)
    watched = job_id if job_id is not None and not fresh_id else None
    if watched is not None and pipelined:
        raise ValueError("enqueue: job_id cannot be combined with a pipeline (the id is "
                         "checked for uniqueness atomically, outside any pipeline)")
    return watched


def _index_and_hold(redis: Redis, keys: Keys, jid: str, payload: JobPayload, queue: str,
                    job: Job, pipe: Pipeline) -> None:
    """The job's index entries, its fair-share place and its hold on its input blobs, in
    the enqueue's MULTI."""
    job_index.add(redis, keys, jid, job_index.meta_of(
        payload, queue, job_index.us_of(job.created_at)), pipeline=pipe)
    fair.index(pipe, keys, jid, queue, fair.share_of(payload))
    BlobStore(redis, keys, ttl_s=int(payload.get("blob_ttl"))).hold(
        jid, (i.blob for i in payload.items if i.blob is not None),
        keep_s=int(payload.get("keep_inputs")), pipeline=pipe)


def _enqueue_on(pipe: Pipeline, redis: Redis, payload: JobPayload, *, queue: str,
                job_id: str | None, timeout: int, result_ttl: int, failure_ttl: int,
                wire: Mapping[str, Any] | None) -> Job:
    q = Queue(queue, connection=redis, serializer=JSONSerializer)
    job = q.enqueue_call(
        func=C.TASK_FUNC,
        args=[dict(wire) if wire is not None else payload.to_dict()],
        timeout=timeout,
        result_ttl=result_ttl,
        failure_ttl=failure_ttl,
        description=describe(payload),
        job_id=job_id,
        retry=Retry(max=C.CRASH_RETRIES),
        pipeline=pipe,
    )
    return job


def lua_script() -> str:
    """enqueue.lua's text, as a client in another language reads it."""
    return lua.source(lua.ENQUEUE)


def enqueue_lua(redis: Redis, payload: dict[str, Any], *, queue: str,
                job_id: str | None = None, timeout: int | str = C.JOB_TIMEOUT_S,
                result_ttl: int = C.RESULT_TTL_S, failure_ttl: int = C.FAILURE_TTL_S,
                keys: Keys | None = None) -> str:
    """Enqueue through the shipped Lua script, exactly as a non-Python producer would."""
    check_queue_name(queue)
    job_id = job_id or uuid.uuid4().hex
    keys = keys or Keys.from_env()
    data = json.dumps([C.TASK_FUNC, None, [payload], {}])
    ok = lua.script(redis, lua.ENQUEUE)(
        keys=[Keys.rq_job(job_id), Keys.rq_queue(queue), RQ_QUEUES, keys.job_items(job_id),
              keys.job_events(job_id)],
        args=[job_id, queue, data, f"vlmq {payload.get('task')} (lua)", timeout, result_ttl,
              failure_ttl, utc_now_iso(), C.CRASH_RETRIES])
    if not ok:
        raise PayloadError("job_id", f"a job with id {job_id} already exists (or its "
                                     "results do)")
    return job_id


def fetch_job(redis: Redis, job_id: str, keys: Keys | None = None) -> Job:
    """The RQ job, read with the JSON serializer so nothing in it is ever unpickled.

    `keys`: given, a finished job's payload, which end_job.lua moved to its end hash
    (the job hash keeps C.MOVED_DATA), is put back into the Job's `data`.

    Raises PayloadError when RQ cannot parse the hash (a non-Python producer wrote e.g.
    `created_at` = "yesterday"): RQ's own error is a bare ValueError that names neither
    the job nor the field, and callers should not have to know RQ's parsing internals.
    """
    data, timeout = redis.hmget(Keys.rq_job(job_id), ["data", "timeout"])
    if data is None and redis.exists(Keys.rq_job(job_id)):
        raise PayloadError("data", "job hash has no data field (not an RQ job)")
    problem = timeout_problem(timeout)
    if problem:
        raise PayloadError("timeout", problem)
    moved = (results.moved_data(redis, keys, job_id)
             if keys is not None and data == C.MOVED_DATA.encode() else None)
    payload = moved if moved is not None else data
    if isinstance(payload, bytes):
        try:  # RQ inflates `data` unbounded inside Job.fetch: check the bound first
            payload = bounded_reads.inflate(payload, what="job data")
        except bounded_reads.BoundError as exc:
            raise PayloadError("data", str(exc)) from exc
    try:
        job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    except UNREADABLE_HASH_ERRORS as exc:
        raise PayloadError("", f"RQ cannot read the job's hash "
                               f"({type(exc).__name__}: {exc})") from exc
    if moved is not None:
        job.data = payload
    return job


def raw_exc_info(redis: Redis, job_id: str) -> str | None:
    """The `exc_info` field of a job hash as text, read without RQ.

    A worker fails a job whose hash RQ cannot load by writing status and `exc_info` to the
    hash directly (no Result can be created without a Job object), so this is the only
    place its reason lives. RQ itself writes the field zlib-compressed; both forms are
    text, never a serialized object, so nothing here deserializes anything.
    """
    raw = redis.hget(Keys.rq_job(job_id), "exc_info")
    if not raw:
        return None
    if isinstance(raw, str):  # a connection made with decode_responses=True
        return raw
    try:  # vlmq's worker writes it uncompressed; RQ compresses it
        raw = bounded_reads.inflate(raw, what="exc_info")
    except bounded_reads.BoundError as exc:
        return f"(unreadable failure text: {exc})"
    return raw.decode("utf-8", "replace")


def fail_job(pipe: Pipeline, keys: Keys, job: Job | str, queue: str, message: str, *,
             worker_name: str = "", execution: Execution | None = None) -> None:
    """Queue on `pipe` (a MULTI) all that makes a job failed: status, the failure text, the
    failed registry and the one terminal `failed` event (end_job.lua, after the status).

    Every failure vlmq writes comes through here (a worker's, poison attribution's, a
    refused queue entry's), so producers, `rq info` and rq-dashboard see them all alike.
    `job` is a loaded RQ job, failed as RQ's handle_job_failure would (a failure Result by
    `worker_name`, for `execution` if given); or the id of a hash RQ cannot load, whose
    status and exc_info are written into the hash itself (no Result exists without a Job;
    raw_exc_info reads it back). Whether to retry instead, and fencing, are the caller's.
    """
    ended = now()
    if isinstance(job, str):
        job_id, ttl = job, C.FAILURE_TTL_S
        pipe.hset(Keys.rq_job(job_id), mapping={"status": JobStatus.FAILED.value,
                                                "ended_at": utcformat(ended),
                                                "exc_info": message})
        pipe.expire(Keys.rq_job(job_id), ttl)
        pipe.zadd(Keys.rq_registry("failed", queue), {job_id: current_timestamp() + ttl})
    else:
        job_id, ttl = str(job.id), results.ended_ttl(job.failure_ttl, C.FAILURE_TTL_S)
        job.ended_at = ended
        job.set_status(JobStatus.FAILED, pipeline=pipe)
        job.failed_job_registry.add(job, ttl=job.failure_ttl, exc_string=message,
                                    pipeline=pipe)
        Result.create_failure(job, job.failure_ttl, exc_string=message,
                              worker_name=worker_name, pipeline=pipe,
                              execution_id=execution.id if execution else None,
                              execution_started_at=execution.created_at if execution else None,
                              execution_ended_at=ended)
    results.end_job_event(pipe, keys, job_id, "failed", queue=queue, ttl_s=ttl,
                          fields={"error": message}, pipeline=pipe)


def data_problem(raw: bytes) -> str | None:
    """Why an RQ job's `data` field is not readable JSON, or None when it is.

    Plain or zlib-compressed JSON is accepted, inflated and parsed within the bounds of
    shared/bounded_reads.py; pickle is never deserialized.
    """
    try:
        bounded_reads.loads(bounded_reads.inflate(raw, what="job data"), what="job data")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return ("job data is not JSON (a pickled job?): vlmq never unpickles; enqueue "
                "with RQ's JSONSerializer")
    except RecursionError:
        return "job data is JSON nested too deeply to read"
    except bounded_reads.BoundError as exc:
        return str(exc)
    return None


def is_json_data(raw: bytes) -> bool:
    """True when an RQ job's `data` field is (zlib-compressed or plain) JSON, never pickle."""
    return data_problem(raw) is None


def payload_of(job: Job) -> JobPayload:
    """Validated payload of a vlmq job (raises PayloadError naming the problem)."""
    # Checked before RQ touches `data`: a pickled job gets a clear refusal instead of
    # RQ's message-less DeserializationError, and is never handed to a deserializer.
    problem = data_problem(job.data)
    if problem is not None:
        raise PayloadError("data", problem)
    try:
        func_name = job.func_name
    except DeserializationError as exc:
        raise PayloadError("data", "job data is JSON but not RQ's [func, instance, args, "
                                   f"kwargs] array: {exc.__cause__}") from exc
    if func_name != C.TASK_FUNC:
        raise PayloadError("func", f"not a vlmq job: function {func_name!r}")
    args = job.args
    if not isinstance(args, (list, tuple)):
        raise PayloadError("args", f"must be a list, got {type(args).__name__}")
    if len(args) != 1:
        raise PayloadError("args", f"a vlmq job takes exactly one argument, got {len(args)}")
    return parse_payload(args[0])
