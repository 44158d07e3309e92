"""The item result's stored form: compact JSON with every key that holds its default left
out (PROTOCOL.md section 4), read back the same by every reader, in bytes that follow the
item's own text."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

from redis import Redis

from tests.support.lua_calls import write_items
from vlmq.shared import results
from vlmq.shared.keys import Keys
from vlmq.shared.messages import STORED_DEFAULTS, ItemResult

RESULT = ItemResult(index=3, source="scan.pdf", page=2, text="Zeile eins — 文字",
                    finish_reason="stop", prompt_tokens=312, completion_tokens=9,
                    vision_cache_hit=True, error=None,
                    timings={"queue_s": 0.012345678901, "generate_s": 1.98765432101,
                             "vision_s": 0.0000123},
                    custom_id="req-17")
DOCUMENTED = {"index", "source", "page", "text", "finish_reason", "prompt_tokens",
              "completion_tokens", "vision_cache_hit", "error", "timings", "custom_id",
              "result_cache_hit", "prefix_tokens"}
# What a reader in any language fills in for an absent key (PROTOCOL.md section 4).
READ_DEFAULTS = {"page": None, "text": None, "finish_reason": "stop", "prompt_tokens": 0,
                 "completion_tokens": 0, "vision_cache_hit": False, "error": None,
                 "timings": {}, "custom_id": None, "result_cache_hit": False,
                 "prefix_tokens": 0}


def test_the_stored_form_leaves_out_every_default() -> None:
    wire = RESULT.to_json()
    data = json.loads(wire)
    # finish_reason "stop", error null, result_cache_hit false and prefix_tokens 0 are
    # their defaults
    assert set(data) == DOCUMENTED - {"finish_reason", "error", "result_cache_hit",
                                      "prefix_tokens"}
    assert data["timings"] == {"queue_s": 0.012, "generate_s": 1.988}  # ms; 0 left out
    assert ", " not in wire and '": ' not in wire
    assert "文字" in wire  # UTF-8, not \\u escapes
    assert len(wire.encode()) < len(json.dumps(asdict(RESULT)).encode())
    assert dict(STORED_DEFAULTS) == READ_DEFAULTS  # the documented table is the code's


def test_a_failed_item_keeps_what_says_why() -> None:
    failed = ItemResult(index=0, source="a.png", page=None, text=None, finish_reason="error",
                        prompt_tokens=0, completion_tokens=0, vision_cache_hit=False,
                        error="unreadable image")
    assert json.loads(failed.to_json()) == {"index": 0, "source": "a.png",
                                            "finish_reason": "error",
                                            "error": "unreadable image"}


def test_exports_keep_the_full_form() -> None:
    """to_dict (what jsonl/json exports write) still holds every documented key."""
    assert set(RESULT.to_dict()) == DOCUMENTED


def test_the_stored_bytes_follow_the_text() -> None:
    """An item with tokens and six timings: the JSON around its text is at most 210 bytes
    (323 with every default spelled out and timings to 0.1 ms)."""
    res = replace(RESULT, page=None, custom_id=None, vision_cache_hit=False,
                  timings={n: 1.23456 for n in ("queue_s", "vision_s", "embed_s",
                                                "prefill_s", "generate_s", "preprocess_s")})
    wire = res.to_json().encode()
    assert len(wire) - len((res.text or "").encode()) <= 210, wire


def test_repetition_is_written_only_when_the_guard_did_something() -> None:
    assert "repetition" not in RESULT.to_dict()
    cut = replace(RESULT, finish_reason="repetition", repetition="cut at token 80")
    assert json.loads(cut.to_json())["repetition"] == "cut at token 80"


def test_every_form_reads_back() -> None:
    """The compact form, the older full form, and a bare one from another writer."""
    rounded = replace(RESULT, timings={"queue_s": 0.012, "generate_s": 1.988})
    assert ItemResult.from_dict(json.loads(RESULT.to_json())) == rounded
    assert ItemResult.from_dict(json.loads(json.dumps(asdict(RESULT)))) == RESULT
    bare = ItemResult.from_dict({"index": 0, "source": "a.png", "text": "hi"})
    assert (bare.page, bare.error, bare.repetition, bare.result_cache_hit, bare.timings,
            bare.finish_reason, bare.prompt_tokens) == (None, None, None, False, {}, "stop", 0)
    # a result that really has no finish reason keeps it, as null
    none = replace(RESULT, finish_reason=None)
    assert ItemResult.from_dict(json.loads(none.to_json())).finish_reason is None


def test_a_text_utf8_cannot_carry_is_escaped_instead() -> None:
    odd = replace(RESULT, text="broken \udc80 surrogate")
    wire = odd.to_json()
    wire.encode()  # no UnicodeEncodeError: Redis can store it
    assert json.loads(wire)["text"] == odd.text


def test_results_written_to_redis_read_back(redis: Redis) -> None:
    keys = Keys("vlmqir")
    write_items(redis, keys, "job-1", RESULT)
    (back,) = results.read_items(redis, keys, "job-1")
    assert back.text == RESULT.text and back.custom_id == "req-17"
    assert back.timings == {"queue_s": 0.012, "generate_s": 1.988}
