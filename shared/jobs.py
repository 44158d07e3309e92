"""Creating vlmq jobs as real RQ jobs (JSON serializer only) and reading them back.

Python producers go through RQ's own Queue API; `enqueue.lua` writes the same hash for
producers in other languages, and tests pin that both paths read back identically.
"""

from __future__ import annotations

import contextlib
import json
import uuid
import zlib
from importlib import resources
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq import Queue, Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from vlmq.shared import constants as C
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import JOB_ID_RE, QUEUE_NAME_RE, RQ_QUEUES, Keys
from vlmq.shared.schema import JobPayload, parse_payload, utc_now_iso


def describe(payload: JobPayload) -> str:
    sources = sorted({i.source for i in payload.items})
    head = ", ".join(sources[:3]) + (f" +{len(sources) - 3} more" if len(sources) > 3 else "")
    return f"vlmq {payload.task}: {len(payload.items)} item(s) from {head}"


def check_queue_name(queue: str) -> str:
    if not QUEUE_NAME_RE.match(queue):
        raise PayloadError("queue", f"invalid queue name {queue!r} (letters, digits, _ . -)")
    return queue


def enqueue(redis: Redis, payload: JobPayload, *, queue: str, job_id: str | None = None,
            timeout: int = C.JOB_TIMEOUT_S, result_ttl: int = C.RESULT_TTL_S,
            failure_ttl: int = C.FAILURE_TTL_S, pipeline: Pipeline | None = None) -> str:
    """Enqueue a validated payload as an RQ job; returns the job id."""
    check_queue_name(queue)
    if job_id is not None and not JOB_ID_RE.match(job_id):
        raise PayloadError("job_id", "must match [A-Za-z0-9_-]{1,128}")
    q = Queue(queue, connection=redis, serializer=JSONSerializer)
    job = q.enqueue_call(
        func=C.TASK_FUNC,
        args=[payload.to_dict()],
        timeout=timeout,
        result_ttl=result_ttl,
        failure_ttl=failure_ttl,
        description=describe(payload),
        job_id=job_id,
        retry=Retry(max=C.CRASH_RETRIES),
        pipeline=pipeline,
    )
    return str(job.id)


def lua_script() -> str:
    return resources.files("vlmq.shared").joinpath("enqueue.lua").read_text(encoding="utf-8")


def enqueue_lua(redis: Redis, payload: dict[str, Any], *, queue: str,
                job_id: str | None = None, timeout: int = C.JOB_TIMEOUT_S,
                result_ttl: int = C.RESULT_TTL_S, failure_ttl: int = C.FAILURE_TTL_S) -> str:
    """Enqueue through the shipped Lua script, exactly as a non-Python producer would."""
    check_queue_name(queue)
    job_id = job_id or uuid.uuid4().hex
    data = json.dumps([C.TASK_FUNC, None, [payload], {}])
    ok = redis.eval(lua_script(), 3, Keys.rq_job(job_id), Keys.rq_queue(queue), RQ_QUEUES,
                    job_id, queue, data, f"vlmq {payload.get('task')} (lua)", timeout,
                    result_ttl, failure_ttl, utc_now_iso(), C.CRASH_RETRIES)
    if not ok:
        raise PayloadError("job_id", f"a job with id {job_id} already exists")
    return job_id


def fetch_job(redis: Redis, job_id: str) -> Job:
    return Job.fetch(job_id, connection=redis, serializer=JSONSerializer)


def is_json_data(raw: bytes) -> bool:
    """True when an RQ job's `data` field is (zlib-compressed or plain) JSON, never pickle."""
    with contextlib.suppress(zlib.error):  # RQ accepts plain JSON too
        raw = zlib.decompress(raw)
    try:
        json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return True


def payload_of(job: Job) -> JobPayload:
    """Validated payload of a vlmq job (raises PayloadError naming the problem)."""
    # Checked before RQ touches `data`: a pickled job gets a clear refusal instead of
    # RQ's message-less DeserializationError, and is never handed to a deserializer.
    if not is_json_data(job.data):
        raise PayloadError("data", "job data is not JSON (a pickled job?): vlmq refuses "
                                   "pickle; enqueue with RQ's JSONSerializer")
    if job.func_name != C.TASK_FUNC:
        raise PayloadError("func", f"not a vlmq job: function {job.func_name!r}")
    args = job.args
    if not isinstance(args, (list, tuple)):
        raise PayloadError("args", f"must be a list, got {type(args).__name__}")
    if len(args) != 1:
        raise PayloadError("args", f"a vlmq job takes exactly one argument, got {len(args)}")
    return parse_payload(args[0])
