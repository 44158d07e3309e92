"""Per-item results and progress events: the worker writes them, producers read them.

Each finished item is one HSET into `<prefix>:job:<id>:items` plus one XADD to the
job's events stream, in one pipeline, so a reader never sees an event without its result.
"""

from __future__ import annotations

import json
from typing import Any

from redis import Redis
from redis.client import Pipeline

from vlmq.shared import constants as C
from vlmq.shared.keys import Keys
from vlmq.shared.schema import ItemResult

EVENTS_MAXLEN = 10_000


def write_item(redis: Redis, keys: Keys, job_id: str, result: ItemResult, *,
               ttl_s: int = C.RESULT_TTL_S, pipeline: Pipeline | None = None) -> None:
    pipe = pipeline if pipeline is not None else redis.pipeline(transaction=True)
    items_key = keys.job_items(job_id)
    pipe.hset(items_key, str(result.index), json.dumps(result.to_dict()))
    pipe.expire(items_key, ttl_s)
    add_event(redis, keys, job_id, {"type": "item", "index": result.index,
                                    "ok": int(result.ok)}, ttl_s=ttl_s, pipeline=pipe)
    if pipeline is None:
        pipe.execute()


def add_event(redis: Redis, keys: Keys, job_id: str, event: dict[str, Any], *,
              ttl_s: int = C.RESULT_TTL_S, pipeline: Pipeline | None = None) -> None:
    conn: Any = pipeline if pipeline is not None else redis
    key = keys.job_events(job_id)
    conn.xadd(key, {k: str(v) for k, v in event.items()}, maxlen=EVENTS_MAXLEN,
              approximate=True)
    conn.expire(key, ttl_s)


def done_indexes(redis: Redis, keys: Keys, job_id: str) -> set[int]:
    return {int(k) for k in redis.hkeys(keys.job_items(job_id))}


def count_done(redis: Redis, keys: Keys, job_id: str) -> int:
    return int(redis.hlen(keys.job_items(job_id)))


def read_items(redis: Redis, keys: Keys, job_id: str) -> list[ItemResult]:
    """All results written so far, in item order."""
    raw = redis.hgetall(keys.job_items(job_id))
    out = [ItemResult.from_dict(json.loads(v)) for v in raw.values()]
    return sorted(out, key=lambda r: r.index)
