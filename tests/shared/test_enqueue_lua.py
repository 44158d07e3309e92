"""enqueue.lua's own checks: every one returns an error naming what is wrong, and writes
nothing. These are what a producer in another language gets back from EVAL at once."""

from __future__ import annotations

import json
from typing import Any

import pytest
from redis import Redis

from tests.support.factories import OTHER_SHA, SHA, with_path
from tests.support.lua_calls import PREFIX, call, good_payload, refused, store_blob
from vlmq.shared import constants as C
from vlmq.shared.keys import RQ_QUEUES, Keys
from vlmq.shared.messages import PAYLOAD_MESSAGES


@pytest.fixture
def blob(redis: Redis) -> Redis:
    return store_blob(redis)


def test_a_good_payload_is_enqueued(blob: Redis) -> None:
    assert call(blob) == 1
    assert blob.lrange("rq:queue:ocr", 0, -1) == [b"j1"]


def mutated(path: str, value: Any) -> dict[str, Any]:
    return with_path(good_payload(), path, value)


PAYLOAD_CASES = [
    ("version", mutated("v", 2), "v: unsupported protocol version 2"),
    ("no version", mutated("v", ...), "v: unsupported protocol version None"),
    ("task", mutated("task", "translate"), "task: must be one of ocr, caption, generate"),
    ("generate without prompt", mutated("task", "generate"),
     "prompt: is required for task generate"),
    ("prompt not a string", mutated("prompt", 5), "prompt: must be a string"),
    ("items empty", mutated("items", []), "items: must be a non-empty list"),
    ("items an object", mutated("items", {"a": 1}), "items: must be a non-empty list"),
    ("too many items", mutated("items", [{"kind": "image", "blob": SHA}] * 10_001),
     "items: has more than 10000 entries"),
    ("item kind", mutated("items.1.kind", "video"),
     "items[1].kind: must be one of image, pdf, tiff"),
    ("item sha format", mutated("items.0.blob", "AB" * 32), "items[0].blob: must be a lowercase"),
    ("pdf without page", mutated("items.0.page", ...),
     "items[0].page: " + PAYLOAD_MESSAGES["page_missing"] % "pdf"),
    ("page 0", mutated("items.0.page", 0), "items[0].page: " + PAYLOAD_MESSAGES["page"]),
    ("page fractional", mutated("items.0.page", 1.5), "items[0].page: " + PAYLOAD_MESSAGES["page"]),
    ("page on an image", mutated("items.1.page", 3), "items[1].page: is only allowed on pdf"),
    ("custom_id too long", mutated("items.1.custom_id", "x" * 257),
     "items[1].custom_id: must be a string of at most 256"),
    ("unknown item field", mutated("items.0.dpi", 300), "items[0]: unknown field(s) ['dpi']"),
    ("unknown top-level field", mutated("priority", 5),
     "payload: unknown field(s) ['priority']"),
    ("result_cache", mutated("result_cache", "yes"), 'result_cache: must be true, false or'),
    ("missing blob", mutated("items.1.blob", OTHER_SHA),
     f"items[1].blob: no blob {PREFIX}:blob:{OTHER_SHA}"),
]


@pytest.mark.parametrize(("data", "needle"), [c[1:] for c in PAYLOAD_CASES],
                         ids=[c[0] for c in PAYLOAD_CASES])
def test_payload_checks(blob: Redis, data: Any, needle: str) -> None:
    refused(blob, needle, data=data)


@pytest.mark.parametrize("value", [True, False, "sampled"])
def test_result_cache_values_are_accepted(blob: Redis, value: Any) -> None:
    assert call(blob, data=mutated("result_cache", value)) == 1


def test_custom_id_of_256_characters_is_accepted(blob: Redis) -> None:
    assert call(blob, data=mutated("items.1.custom_id", "é" * 256)) == 1


@pytest.mark.parametrize(("raw", "needle"), [
    ("not json", "data: must be the JSON array"),
    (json.dumps(["os.system", None, [good_payload()], {}]), "data: function must be"),
    (json.dumps([C.TASK_FUNC, None, [good_payload(), good_payload()], {}]),
     "data: args must be a list holding exactly one payload"),
    (json.dumps([C.TASK_FUNC, None, [], {}]), "data: args must be a list holding exactly one"),
])
def test_data_envelope_checks(blob: Redis, raw: str, needle: str) -> None:
    refused(blob, needle, data=raw)


def _keys(job_id: str = "j1", queue: str = "ocr", prefix: str = PREFIX) -> list[str]:
    k = Keys(prefix)
    return [Keys.rq_job(job_id), Keys.rq_queue(queue), RQ_QUEUES, k.job_items(job_id),
            k.job_events(job_id)]


KEY_CASES = [
    ("four keys", _keys()[:4], "KEYS: expected 5 keys, got 4"),
    ("job key of another id", [Keys.rq_job("old"), *_keys()[1:]],
     "KEYS[1]: must be rq:job:<job_id>"),
    ("queue key of another queue", [_keys()[0], Keys.rq_queue("x"), *_keys()[2:]],
     "KEYS[2]: must be rq:queue:<queue>"),
    ("queues set elsewhere", [*_keys()[:2], "rq:other", *_keys()[3:]],
     "KEYS[3]: must be rq:queues"),
    ("items key of another id", [*_keys()[:3], Keys(PREFIX).job_items("old"), _keys()[4]],
     "KEYS[4]: must be <prefix>:job:<job_id>:items"),
    ("events key under another prefix", [*_keys()[:4], Keys("other").job_events("j1")],
     "KEYS[5]: must be <prefix>:job:<job_id>:events"),
]


@pytest.mark.parametrize(("keys", "needle"), [c[1:] for c in KEY_CASES],
                         ids=[c[0] for c in KEY_CASES])
def test_key_checks(blob: Redis, keys: list[str], needle: str) -> None:
    refused(blob, needle, keys=keys)


def test_an_old_jobs_results_under_a_pointed_elsewhere_key_cannot_be_adopted(blob: Redis) -> None:
    # The case: keys 4-5 naming an older job's results would skip the id-reuse
    # check and let the new job "finish" with the old text.
    blob.hset(Keys(PREFIX).job_items("old"), "0", "{}")
    refused(blob, "KEYS[4]", keys=[*_keys()[:3], Keys(PREFIX).job_items("old"),
                                   Keys(PREFIX).job_events("old")])


@pytest.mark.parametrize(("index", "key"), [(1, "rq:job:j1"), (2, "rq:queue:ocr"),
                                            (3, "rq:queues"), (4, "vlmq:job:j1:items")])
def test_a_wrong_typed_key_is_refused_before_any_write(blob: Redis, index: int,
                                                       key: str) -> None:
    blob.set(key, "a string")
    refused(blob, f"KEYS[{index}]: {key} holds a string")
