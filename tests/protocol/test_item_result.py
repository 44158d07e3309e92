"""The item result's stored form: every documented key kept, only what nothing reads cut."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

from redis import Redis

from vlmq.shared import results as R
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult

RESULT = ItemResult(index=3, source="scan.pdf", page=2, text="Zeile eins — 文字",
                    finish_reason="stop", prompt_tokens=312, completion_tokens=9,
                    vision_cache_hit=True, error=None,
                    timings={"queue_s": 0.012345678901, "generate_s": 1.98765432101},
                    custom_id="req-17")
DOCUMENTED = {"index", "source", "page", "text", "finish_reason", "prompt_tokens",
              "completion_tokens", "vision_cache_hit", "error", "timings", "custom_id",
              "result_cache_hit"}


def test_the_stored_form_is_compact_json_with_every_documented_key() -> None:
    wire = RESULT.to_json()
    data = json.loads(wire)
    assert set(data) == DOCUMENTED  # null and false values stay: readers index them
    assert data["timings"] == {"queue_s": 0.0123, "generate_s": 1.9877}
    assert ", " not in wire and '": ' not in wire
    assert "文字" in wire  # UTF-8, not \\u escapes
    assert len(wire.encode()) < len(json.dumps(asdict(RESULT)).encode())


def test_repetition_is_written_only_when_the_guard_did_something() -> None:
    assert "repetition" not in RESULT.to_dict()
    cut = replace(RESULT, finish_reason="repetition", repetition="cut at token 80")
    assert json.loads(cut.to_json())["repetition"] == "cut at token 80"


def test_every_form_reads_back() -> None:
    """The compact form, the older full form, and a bare one from another writer."""
    rounded = replace(RESULT, timings={"queue_s": 0.0123, "generate_s": 1.9877})
    assert ItemResult.from_dict(json.loads(RESULT.to_json())) == rounded
    assert ItemResult.from_dict(json.loads(json.dumps(asdict(RESULT)))) == RESULT
    bare = ItemResult.from_dict({"index": 0, "source": "a.png", "text": "hi"})
    assert (bare.page, bare.error, bare.repetition, bare.result_cache_hit, bare.timings) == (
        None, None, None, False, {})


def test_a_text_utf8_cannot_carry_is_escaped_instead() -> None:
    odd = replace(RESULT, text="broken \udc80 surrogate")
    wire = odd.to_json()
    wire.encode()  # no UnicodeEncodeError: Redis can store it
    assert json.loads(wire)["text"] == odd.text


def test_results_written_to_redis_read_back(redis: Redis) -> None:
    keys = Keys("vlmqir")
    R.write_item(redis, keys, "job-1", RESULT)
    (back,) = R.read_items(redis, keys, "job-1")
    assert back.text == RESULT.text and back.custom_id == "req-17"
    assert back.timings == {"queue_s": 0.0123, "generate_s": 1.9877}
