"""An item's own prompt (`items[].prompt`, PROTOCOL.md section 3): enqueue.lua and
parse_payload take and refuse it alike, naming the same field, by the `prompt` setting's
row; the worker runs each item with its own prompt and keys its result-cache entry on it.
"""

from __future__ import annotations

from typing import Any

import pytest
from redis import Redis

from tests.support.factories import SHA
from tests.support.lua_calls import call, refused, store_blob
from vlmq.shared import constants as C
from vlmq.shared import settings as S
from vlmq.shared.errors import PayloadError
from vlmq.shared.messages import Item, parse_payload
from vlmq.worker.job_settings import resolve_job


def payload(*items: dict[str, Any]) -> dict[str, Any]:
    return {"v": C.PROTOCOL_VERSION, "task": "generate", "prompt": "Describe it.",
            "items": list(items)}


def test_items_with_prompts_of_their_own_are_enqueued_and_read(redis: Redis) -> None:
    store_blob(redis)
    data = payload({"kind": "text", "custom_id": "a", "prompt": "Say one."},
                   {"kind": "image", "blob": SHA, "custom_id": "b"},
                   {"kind": "text", "custom_id": "c", "prompt": "é" * 20_000})
    assert call(redis, data=data, queue="generate") == 1
    items = parse_payload(data).items
    assert [i.prompt for i in items] == ["Say one.", None, "é" * 20_000]
    assert items[0].to_dict() == {"kind": "text", "source": "text", "custom_id": "a",
                                  "prompt": "Say one."}
    assert "prompt" not in items[1].to_dict()


MAX = S.BY_NAME["prompt"].max_len


@pytest.mark.parametrize(("prompt", "needle"), [
    ("", "items[0].prompt: must not be empty"),
    (5, "items[0].prompt: must be a string"),
    ("x" * ((MAX or 0) + 1), f"items[0].prompt: is longer than {MAX} characters"),
])
def test_bad_item_prompts_are_refused_alike(redis: Redis, prompt: Any, needle: str) -> None:
    data = payload({"kind": "text", "prompt": prompt})
    refused(redis, needle, data=data)
    with pytest.raises(PayloadError) as info:
        parse_payload(data)
    assert needle in str(info.value)


def test_an_item_runs_with_its_own_prompt_and_keys_the_cache_on_it() -> None:
    job = parse_payload(payload({"kind": "text", "prompt": "Say one."}, {"kind": "text"}))
    settings = resolve_job(job, "qwen2_vl", None)
    own, shared = (settings.for_item(i) for i in job.items)
    assert (own.prompt, shared.prompt) == ("Say one.", "Describe it.")
    assert shared is settings and own.max_tokens == settings.max_tokens
    assert own.deciding_text("text")["prompt"] == "Say one."
    assert settings.for_item(Item(kind="text", blob=None, source="t")) is settings
