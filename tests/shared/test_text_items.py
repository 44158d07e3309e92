"""Text items (kind `text`: the prompt alone, no input), as enqueue.lua and parse_payload
both take and refuse them, with the same field named (PROTOCOL.md, item kinds)."""

from __future__ import annotations

from typing import Any

import pytest
from redis import Redis

from tests.support.factories import SHA
from tests.support.lua_calls import call, refused, store_blob
from vlmq.shared import constants as C
from vlmq.shared.errors import PayloadError
from vlmq.shared.messages import EMPTY_SHA256, parse_payload


def text_payload(*items: dict[str, Any], task: str = "generate") -> dict[str, Any]:
    out: dict[str, Any] = {"v": C.PROTOCOL_VERSION, "task": task,
                           "items": list(items) or [{"kind": "text", "custom_id": "t"}]}
    if task == "generate":
        out["prompt"] = "Hello world!"
    if task == "extract":
        out["schema"] = {"type": "object"}
    return out


def test_a_text_item_needs_no_blob_beside_image_items(redis: Redis) -> None:
    store_blob(redis)
    data = text_payload({"kind": "text", "custom_id": "t"},
                        {"kind": "image", "blob": SHA, "source": "b.png"})
    assert call(redis, data=data, queue="generate") == 1
    payload = parse_payload(data)
    text = payload.items[0]
    assert (text.kind, text.blob, text.ref, text.source, text.custom_id) == (
        "text", None, None, "text", "t")
    assert text.sha256 == EMPTY_SHA256 and text.to_dict() == {
        "kind": "text", "source": "text", "custom_id": "t"}
    assert parse_payload(text_payload(task="extract")).items[0].kind == "text"


@pytest.mark.parametrize(("data", "needle"), [
    (text_payload({"kind": "text", "blob": SHA}),
     "items[0].blob: is not allowed on a text item"),
    (text_payload({"kind": "text", "page": 1}), "items[0].page: is not allowed on a text item"),
    (text_payload({"kind": "text", "ref": {"store": "s", "path": "a.png"}}),
     "items[0].ref: is not allowed on a text item"),
    (text_payload({"kind": "text", "sha256": SHA}),
     "items[0].sha256: is not allowed on a text item"),
    (text_payload(task="ocr"), "items[0].kind: text is for tasks generate, extract: ocr"),
    (text_payload(task="caption"), "items[0].kind: text is for tasks generate, extract"),
])
def test_bad_text_items_are_refused_alike(redis: Redis, data: dict[str, Any],
                                          needle: str) -> None:
    store_blob(redis)
    refused(redis, needle, data=data)
    with pytest.raises(PayloadError) as info:
        parse_payload(data)
    assert needle in str(info.value)
