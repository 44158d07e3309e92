"""enqueue.lua called by hand, as a producer in another language calls it: EVAL with the
five keys, the job id, the queue, the RQ job data and the job's settings; and item results
written through write_items.lua, the script a worker writes them with."""

from __future__ import annotations

import json
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import ResponseError

from tests.support.factories import SHA, item, payload
from vlmq.shared import constants as C
from vlmq.shared import lua
from vlmq.shared.enqueue import lua_script
from vlmq.shared.keys import RQ_QUEUES, Keys
from vlmq.shared.messages import ItemResult

PREFIX = "vlmq"


def good_payload() -> dict[str, Any]:
    """One pdf page and one image, both on SHA: what enqueue.lua takes (SHA stored)."""
    return payload(item("pdf", source="a.pdf", page=2),
                   item(source="b.png", custom_id="b"))


def call(redis: Redis, *, data: Any = None, keys: list[str] | None = None,
         job_id: str = "j1", queue: str = "ocr") -> Any:
    """EVAL enqueue.lua on `data` (a payload, or the raw RQ job data as a string; default
    good_payload()) under `keys` (default the five right ones for job_id and queue)."""
    k = Keys(PREFIX)
    raw = data if isinstance(data, str) else json.dumps(
        [C.TASK_FUNC, None, [data if data is not None else good_payload()], {}])
    key_list = keys if keys is not None else [
        Keys.rq_job(job_id), Keys.rq_queue(queue), RQ_QUEUES, k.job_items(job_id),
        k.job_events(job_id)]
    return redis.eval(lua_script(), len(key_list), *key_list, job_id, queue, raw, "d",
                      "60", "60", "60", "2026-11-29T12:00:00.000000Z", "3")


def refused(redis: Redis, needle: str, **kwargs: Any) -> None:
    """call(**kwargs) is refused with an error holding `needle`, and Redis is unchanged."""
    before = {k: redis.type(k) for k in redis.scan_iter()}
    with pytest.raises(ResponseError) as info:
        call(redis, **kwargs)
    assert needle in str(info.value), str(info.value)
    assert {k: redis.type(k) for k in redis.scan_iter()} == before


def store_blob(redis: Redis, sha: str = SHA) -> Redis:
    """The blob enqueue.lua checks for, stored under PREFIX."""
    redis.set(Keys(PREFIX).blob(sha), b"bytes")
    return redis


def write_items(redis: Redis, keys: Keys, job_id: str, *results: ItemResult,
                ttl_s: int = C.RESULT_TTL_S) -> None:
    """Store `results` for `job_id` through write_items.lua, as a worker does (its events,
    failed set and running counts move with them), whatever the job's state.

    The script writes only for the started job's owner, so in one MULTI the job is made
    started and owned by a test token, written, and put back as it was (status and owner
    key; a job hash that did not exist is removed again): the counts of its state never
    move, since the job's state is the same before and after the transaction.
    """
    rq_key, owner = Keys.rq_job(job_id), keys.job_owner(job_id)
    existed = redis.exists(rq_key)
    status = redis.hget(rq_key, "status")
    held, held_ms = redis.get(owner), redis.pttl(owner)
    token = f"test-writer-{job_id}"
    args: list[str | int] = [token, ttl_s, C.EVENTS_MAXLEN]
    for res in results:
        args += [res.index, res.to_json(), int(res.ok)]
    pipe = redis.pipeline(transaction=True)
    pipe.hset(rq_key, "status", "started")
    pipe.set(owner, token)
    lua.script(redis, lua.WRITE_ITEMS)(
        keys=[rq_key, owner, keys.job_items(job_id), keys.job_events(job_id)], args=args,
        client=pipe)
    if not existed:
        pipe.delete(rq_key)
    elif status is None:
        pipe.hdel(rq_key, "status")
    else:
        pipe.hset(rq_key, "status", status)
    if held is None:
        pipe.delete(owner)
    else:
        pipe.set(owner, held, px=held_ms if held_ms > 0 else None)
    assert pipe.execute()[2] == 1
