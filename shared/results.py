"""Per-item results and progress events: the worker writes them, producers read them.

Each finished item is one HSET into `<prefix>:job:<id>:items` plus one XADD to the
job's events stream, in one script (write_items.lua), so a reader never sees an event
without its result. A job's end is one terminal event (`finished`, `failed` or
`canceled`), written by end_job_event in the same transaction as the status change: to
the stream, which then lives only C.ENDED_EVENTS_S more, and into the job hash
(END_FIELD; a finished job's in its end hash, with its payload: read_end), where it stays
as long as the job (PROTOCOL.md section 5).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from redis import Redis
from redis.client import Pipeline

from vlmq.shared import constants as C
from vlmq.shared import lua
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult

# Field of the RQ job hash that end_job.lua sets: this run of the job has its terminal
# event, kept there as JSON (its type, stream id and fields; for `finished` the summary).
END_FIELD = "vlmq_end"
# A finished job's end is not there but in its end hash (keys.job_end), field END_EVENT
# beside MOVED_DATA_FIELD (RQ's payload; the job hash keeps C.MOVED_DATA): revision 3,
# so a finished job hash holds only values of at most 64 B (compact in Redis).
END_EVENT = "event"
MOVED_DATA_FIELD = "data"
TERMINAL_EVENTS = ("finished", "failed", "canceled")
# Stream/hash lifetime after a job ends with result_ttl 0 ("keep nothing"): long enough
# for a follower of the events stream to see the terminal event.
ENDED_MIN_TTL_S = 60


def event_fields(event: Mapping[str, Any]) -> dict[str, str]:
    """Stream fields are strings: text as is, anything else (numbers, labels) as JSON."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in event.items()}


def ended_ttl(ttl_s: int | None, default: int) -> int:
    """How long a job's events and items live once it ended: as long as the job hash
    (RQ's result_ttl or failure_ttl; -1 keeps them)."""
    if ttl_s is None:
        return default
    if ttl_s == 0:
        return ENDED_MIN_TTL_S
    return ttl_s if ttl_s > 0 else -1


def end_job_event(redis: Redis, keys: Keys, job_id: str, status: str, *, queue: str | None,
                  ttl_s: int, fields: Mapping[str, Any] | None = None,
                  pipeline: Pipeline | None = None) -> None:
    """The terminal event of a job's run, and the PUBLISH on the done channels.

    Written only when the job's status is `status` (finished, failed or canceled) and this
    run has no terminal event yet, so it exists exactly once whoever ends the job (a worker,
    `vlmq cancel`, a worker finding a job that RQ's cleanup failed). Queue it in the same
    MULTI as the status change, after it. The item results get `ttl_s` (see ended_ttl) so
    they expire with the job; the event stays in the job hash, the stream
    C.ENDED_EVENTS_S more.
    """
    if status not in TERMINAL_EVENTS:
        raise ValueError(f"not a terminal status: {status!r}")
    args: list[str | int] = [job_id, status, ttl_s, keys.done_channel,
                             keys.done_queue_channel(queue) if queue else ""]
    for k, v in event_fields(fields or {}).items():
        args += [k, v]
    job_keys = [Keys.rq_job(job_id), keys.job_events(job_id), keys.job_items(job_id)]
    lua.script(redis, lua.END_JOB)(keys=job_keys, args=args, client=pipeline or redis)


def ended_event(raw: bytes | str | None) -> dict[str, Any] | None:
    """The terminal event kept in a job hash's END_FIELD, or None: the job has not ended,
    or ended before vlmq kept it there (the field then held only the event's stream id,
    and RQ's results stream holds the job's end)."""
    if not raw:
        return None
    try:
        event = json.loads(raw)
    except ValueError:
        return None
    return event if isinstance(event, dict) and event.get("type") in TERMINAL_EVENTS else None


def read_end(redis: Redis, keys: Keys, job_id: str) -> dict[str, Any] | None:
    """The terminal event of the job's run, or None: from its end hash (a finished job),
    else from its job hash (failed, canceled, or finished before revision 3)."""
    pipe = redis.pipeline(transaction=False)
    pipe.hget(keys.job_end(job_id), END_EVENT)
    pipe.hget(Keys.rq_job(job_id), END_FIELD)
    moved, kept = pipe.execute()
    return ended_event(moved) or ended_event(kept)


def moved_data(redis: Redis, keys: Keys, job_id: str) -> bytes | None:
    """RQ's payload of a finished job, which end_job.lua moved out of its job hash."""
    raw = redis.hget(keys.job_end(job_id), MOVED_DATA_FIELD)
    return raw if isinstance(raw, bytes) else None


def stored_data(redis: Redis, keys: Keys, job_id: str,
                data: bytes | str | None) -> bytes | str | None:
    """A job hash's `data` as RQ stored it: for a finished job's stub (C.MOVED_DATA), the
    payload end_job.lua moved to its end hash (or the stub, when that is gone)."""
    if data not in (C.MOVED_DATA, C.MOVED_DATA.encode()):
        return data
    return moved_data(redis, keys, job_id) or data


def count_done(redis: Redis, keys: Keys, job_id: str) -> int:
    return int(redis.hlen(keys.job_items(job_id)))


def read_items(redis: Redis, keys: Keys, job_id: str) -> list[ItemResult]:
    """All results written so far, in item order. An entry that is no item result (a
    foreign writer's) is left out: it is not a result, and a worker computes the item."""
    raw = redis.hgetall(keys.job_items(job_id))
    out = [r for r in map(item_result, raw.values()) if r is not None]
    return sorted(out, key=lambda r: r.index)


def item_result(raw: bytes | str) -> ItemResult | None:
    """One stored item result, or None where the entry cannot be one. Not bounded like a
    job hash: a model's JSON answer may hold a long number, and this reads it back."""
    try:
        value = json.loads(raw)
        return ItemResult.from_dict(value) if isinstance(value, Mapping) else None
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
        return None
