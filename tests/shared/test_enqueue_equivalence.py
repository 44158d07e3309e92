"""The two enqueue paths write one state: shared/enqueue.py (RQ's enqueue_call, then the
indexes, fair share and blob holds in one MULTI) and enqueue.lua (what a producer in any
language calls) are run on the same generated payloads, and the Redis each leaves behind is
compared key by key, modulo what is each call's own (its timestamps, its description);
payloads that break one rule are refused by both in the same words."""

from __future__ import annotations

import json
import math
import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import Redis
from redis.exceptions import ResponseError

from tests.conftest import CLAIM_KEY
from tests.support.factories import sha
from vlmq.shared import constants as C
from vlmq.shared.enqueue import enqueue, enqueue_lua
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import MAX_REF_SIZE, PAYLOAD_MESSAGES, REF_PATH_PROBLEMS, parse_payload
from vlmq.stores.backends import ref_path_problem

KEYS = Keys("eq")
JOB = "j-eq"
BLOBS = [sha(i) for i in range(3)]
# Fields of the job hash that are each call's own: when it ran, and the description its
# caller chose (enqueue_lua writes its own, as another language's producer would).
OWN_FIELDS = {b"created_at", b"enqueued_at", b"description"}
# Fields one path writes and the other leaves out, with the value written; RQ reads a
# missing one as this same value (RQ writes retry_intervals, enqueue.lua an empty meta).
DEFAULTS = {b"retry_intervals": b"[0]", b"meta": b"{}"}
PROFILE = settings(max_examples=50, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.function_scoped_fixture,
                                          HealthCheck.too_slow])

words = st.text(alphabet="abcdefghijklmnopqrstuvwxyzé0123456789 -_", min_size=1, max_size=12)
ids = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=16)


@st.composite
def items(draw: st.DrawFn, task: str) -> dict[str, Any]:
    kinds = list(C.ITEM_KINDS) if task in C.TEXT_TASKS else [
        k for k in C.ITEM_KINDS if k != C.TEXT_KIND]
    kind = draw(st.sampled_from(kinds))
    out: dict[str, Any] = {"kind": kind}
    if kind != C.TEXT_KIND:
        if draw(st.booleans()):
            out["blob"] = draw(st.sampled_from(BLOBS))
        else:
            out["ref"] = {"store": draw(ids), "path": draw(ids) + "/" + draw(ids) + ".png"}
            out["sha256"] = draw(st.sampled_from(BLOBS))
            out["size"] = draw(st.integers(1, MAX_REF_SIZE))
    if kind in C.PAGED_KINDS:
        out["page"] = draw(st.integers(1, C.MAX_TIFF_PAGES))
    for name in ("source", "custom_id", "prompt"):
        if draw(st.booleans()):
            out[name] = draw(words)
    return out


@st.composite
def payloads(draw: st.DrawFn) -> dict[str, Any]:
    """A valid wire payload: any task, item kinds, settings, labels (a tenant among them
    at times), a batch, job and item prompts."""
    task = draw(st.sampled_from(C.TASKS))
    out: dict[str, Any] = {"v": C.PROTOCOL_VERSION, "task": task,
                           "items": draw(st.lists(items(task), min_size=1, max_size=4))}
    if task == C.PROMPT_TASK or draw(st.booleans()):
        out["prompt"] = draw(words)
    if task == "extract":
        out["schema"] = {"type": "object", "properties": {draw(ids): {"type": "string"}}}
    labels = draw(st.dictionaries(st.sampled_from(["team", "run", C.TENANT_LABEL]), words,
                                  max_size=3))
    if labels:
        out["labels"] = labels
    if draw(st.booleans()):
        out["batch"] = "b-" + draw(ids)
    if draw(st.booleans()):
        out["generation"] = {"max_tokens": draw(st.integers(1, C.MAX_TOKENS_LIMIT)),
                             "temperature": draw(st.sampled_from([0, 0.5, 1.25]))}
    for name, values in (("max_side", st.integers(*C.MAX_SIDE_RANGE)),
                         ("result_cache", st.sampled_from([True, False, "sampled"])),
                         ("text_layer", st.sampled_from(["off", "fallback", "prefer"])),
                         ("blob_ttl", st.integers(3600, 7200)),
                         ("keep_inputs", st.integers(60, 600)), ("model", ids)):
        if draw(st.booleans()):
            out[name] = draw(values)
    return out


def _clear(redis: Redis) -> None:
    for key in redis.scan_iter(count=1000):
        if key != CLAIM_KEY.encode():
            redis.delete(key)
    for blob in BLOBS:  # uploaded, no job holding them yet
        redis.set(KEYS.blob(blob), blob.encode(), ex=600)


def _json(raw: bytes) -> Any:
    return json.loads(zlib.decompress(raw) if raw[:1] == b"x" else raw)


def _ttl(redis: Redis, key: bytes) -> int:
    """The key's lifetime to ten seconds (-1: none), so two runs apart compare equal."""
    ms = int(redis.pttl(key))
    return ms if ms < 0 else round(ms / 10_000)


def _value(redis: Redis, key: bytes) -> Any:
    kind = redis.type(key).decode()
    if kind == "string":
        return redis.get(key)
    if kind == "list":
        return redis.lrange(key, 0, -1)
    if kind == "set":
        return sorted(redis.smembers(key))
    if kind == "zset":  # an index is scored by the created time: only its members compare
        pairs = redis.zrange(key, 0, -1, withscores=True)
        return [(m, s if math.isinf(s) or s < 1e12 else "created") for m, s in pairs]
    if kind == "hash":
        fields = redis.hgetall(key)
        if key == Keys.rq_job(JOB).encode():
            fields = {**DEFAULTS, **fields}
            fields = {k: v for k, v in fields.items() if k not in OWN_FIELDS}
            fields[b"data"] = _json(fields[b"data"])
            fields[b"meta"] = _json(fields[b"meta"])
        elif key in (KEYS.jobs_meta.encode(), KEYS.jobs_tally.encode()):
            # a record's created time is the call's own; the count hashes it is in are a
            # set (Lua lists the labels in its table's order)
            fields = {k: {f: sorted(x) if f == "t" else x for f, x in _json(v).items()
                          if f not in ("created", "c")} for k, v in fields.items()}
        return fields
    return kind


def _state(redis: Redis) -> dict[bytes, Any]:
    return {key: (_value(redis, key), _ttl(redis, key)) for key in sorted(redis.scan_iter())
            if key != CLAIM_KEY.encode()}


def _python(redis: Redis, raw: dict[str, Any], queue: str) -> str | None:
    """The Python path; the refusal's text, or None when enqueued (a reference whose path
    would leave its store is refused by the store that reads it)."""
    for i, item in enumerate(raw.get("items") or []):
        problem = isinstance(item, dict) and "ref" in item and ref_path_problem(
            item["ref"]["path"])
        if problem:
            return f"items[{i}].ref.path: {problem}"
    try:
        enqueue(redis, parse_payload(raw), queue=queue, job_id=JOB, wire=raw, keys=KEYS)
    except PayloadError as exc:
        return str(exc)
    return None


def _lua(redis: Redis, raw: dict[str, Any], queue: str) -> str | None:
    try:
        enqueue_lua(redis, raw, queue=queue, job_id=JOB, keys=KEYS)
    except ResponseError as exc:
        return str(exc)
    return None


@PROFILE
@given(raw=payloads(), queue=st.sampled_from(["ocr", "q.1"]))
def test_both_paths_write_the_same_job(redis: Redis, raw: dict[str, Any], queue: str) -> None:
    _clear(redis)
    assert _python(redis, raw, queue) is None
    via_python = _state(redis)
    _clear(redis)
    assert _lua(redis, raw, queue) is None
    via_lua = _state(redis)
    assert via_lua.keys() == via_python.keys()
    for key, value in via_python.items():
        assert via_lua[key] == value, key


def _break(raw: dict[str, Any], fault: str, at: int) -> tuple[dict[str, Any], str]:
    """`raw` with one rule broken, and the refusal both paths must give (a store path
    that leaves its store: enqueue.lua's, and the worker's when it reads the item, since
    parse_payload leaves that to the store, so that it fails the item alone)."""
    out = json.loads(json.dumps(raw))
    index = at % len(out["items"])
    item, where = out["items"][index], f"items[{index}]"
    m = PAYLOAD_MESSAGES
    if fault == "version":
        out["v"] = C.PROTOCOL_VERSION + 1
        return out, "v: " + m["version"] % (C.PROTOCOL_VERSION + 1)
    if fault == "task":
        out["task"] = "translate"
        return out, "task: " + m["task"]
    if fault == "no_items":
        out["items"] = []
        return out, "items: " + m["items"]
    if fault == "unknown":
        out["priority"] = 5
        return out, "payload: " + m["unknown_fields"] % ["priority"]
    if fault == "item_unknown":
        item["dpi"] = 300
        return out, f"{where}: " + m["unknown_fields"] % ["dpi"]
    if fault == "kind":
        item["kind"] = "video"
        return out, f"{where}.kind: " + m["kind"]
    if fault == "custom_id":
        item["custom_id"] = "x" * (C.MAX_CUSTOM_ID_CHARS + 1)
        return out, f"{where}.custom_id: " + m["custom_id"]
    if fault == "source":
        item["source"] = "x" * (C.MAX_SOURCE_CHARS + 1)
        return out, f"{where}.source: " + m["source"]
    if fault == "prompt_empty":
        item["prompt"] = ""
        return out, f"{where}.prompt: " + m["prompt_empty"]
    if item["kind"] == C.TEXT_KIND:
        item["blob"] = BLOBS[0]
        return out, f"{where}.blob: " + m["text_input"]
    if fault == "page":
        if item["kind"] in C.PAGED_KINDS:
            item["page"] = 0
            return out, f"{where}.page: " + m["page"]
        item["page"] = 2
        return out, f"{where}.page: " + m["page_not_paged"]
    if "blob" in item:
        item["blob"] = "g" + item["blob"][1:]  # not hex
        return out, f"{where}.blob: " + m["sha256"]
    problems = {"nul": "a\0b", "backslash": "a\\b", "absolute": "/a", "dotdot": "a/../b"}
    name = sorted(problems)[at % len(problems)]
    item["ref"]["path"] = problems[name]
    return out, f"{where}.ref.path: " + REF_PATH_PROBLEMS[name]


FAULTS = ["version", "task", "no_items", "unknown", "item_unknown", "kind", "custom_id",
          "source", "prompt_empty", "page", "input"]


@PROFILE
@given(raw=payloads(), fault=st.sampled_from(FAULTS), at=st.integers(0, 7))
def test_both_paths_refuse_a_broken_rule_in_the_same_words(
        redis: Redis, raw: dict[str, Any], fault: str, at: int) -> None:
    _clear(redis)
    broken, words = _break(raw, fault, at)
    assert _python(redis, broken, "ocr") == words
    assert _lua(redis, broken, "ocr") == words
    assert _state(redis) == {KEYS.blob(b).encode(): (b.encode(), 60) for b in BLOBS}


def test_the_comparison_sees_a_difference(redis: Redis) -> None:
    """The state compared is the state written: a label more on one side is a difference."""
    raw: dict[str, Any] = {"v": 1, "task": "ocr", "items": [{"kind": "image", "blob": BLOBS[0]}]}
    _clear(redis)
    enqueue(redis, parse_payload(raw), queue="ocr", job_id=JOB, wire=raw, keys=KEYS)
    plain = _state(redis)
    _clear(redis)
    enqueue_lua(redis, {**raw, "labels": {"team": "x"}}, queue="ocr", job_id=JOB, keys=KEYS)
    assert _state(redis) != plain


@pytest.mark.parametrize("fault", FAULTS)
def test_every_fault_is_refused_by_both(redis: Redis, fault: str) -> None:
    raw = {"v": 1, "task": "generate", "prompt": "p", "items": [
        {"kind": "pdf", "blob": BLOBS[0], "page": 1},
        {"kind": "image", "ref": {"store": "s", "path": "a.png"}, "sha256": BLOBS[1],
         "size": 3}]}
    for at in range(2):
        _clear(redis)
        broken, words = _break(raw, fault, at)
        assert _python(redis, broken, "ocr") == words
        assert _lua(redis, broken, "ocr") == words
