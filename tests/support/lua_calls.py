"""enqueue.lua called by hand, as a producer in another language calls it: EVAL with the
five keys, the job id, the queue, the RQ job data and the job's settings."""

from __future__ import annotations

import json
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import ResponseError

from tests.support.factories import SHA, item, payload
from vlmq.shared import constants as C
from vlmq.shared.enqueue import lua_script
from vlmq.shared.keys import RQ_QUEUES, Keys

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
