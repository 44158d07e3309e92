"""A job's settings are resolved once, with the checkpoint's preset, and everything reads
that one object: the engine request's budget and the result-cache key agree."""

from __future__ import annotations

from dataclasses import fields, replace

from redis import Redis

from tests.support.lua_calls import write_items
from vlmq.shared.chat import Message
from vlmq.shared.keys import Keys
from vlmq.shared.messages import Item, ItemResult, JobPayload
from vlmq.worker.item_order import JobState
from vlmq.worker.job_settings import (
    DEFAULT_IMAGE_MAX_SIDE,
    DEFAULT_PDF_MAX_SIDE,
    NOT_DECIDING_TEXT,
    JobSettings,
    resolve_job,
)
from vlmq.worker.model.defaults import defaults_for
from vlmq.worker.results.cache import ResultCache, cached_results, store_results

SHA = "ef" * 32
# A checkpoint whose preset (olmOCR-2) differs from its model type's (qwen2_5_vl) row.
MODEL_TYPE, MODEL_ID = "qwen2_5_vl", "/models/olmOCR-2-7B-1025-tiny"
ITEM = Item(kind="pdf", blob=SHA, source="a.pdf", page=1)


def _state(job_id: str, **settings: object) -> JobState:
    state = JobState(job_id=job_id, payload=JobPayload(task="ocr", items=(ITEM,),
                                                       settings=settings))
    state.settings = resolve_job(state.payload, MODEL_TYPE, MODEL_ID)
    return state


def _result(text: str) -> ItemResult:
    return ItemResult(index=0, source=ITEM.source, page=1, text=text, finish_reason="stop",
                      prompt_tokens=3, completion_tokens=2, vision_cache_hit=False, error=None)


def test_the_preset_fills_what_the_job_leaves_unset() -> None:
    preset = defaults_for(MODEL_TYPE, "ocr", MODEL_ID)
    settings = _state("a").resolved
    assert (settings.prompt, settings.max_tokens) == (preset.prompt, preset.max_tokens)
    assert settings.side_for("pdf") == DEFAULT_PDF_MAX_SIDE
    assert settings.side_for("image") == DEFAULT_IMAGE_MAX_SIDE
    own = _state("b", max_tokens=12, max_side=300, stop=("</x>",)).resolved
    assert (own.max_tokens, own.side_for("pdf")) == (12, 300)
    assert own.stop[-1] == "</x>" and set(preset.stop) <= set(own.stop)


def test_a_job_asking_for_the_type_defaults_misses_text_made_under_the_preset(
        redis: Redis) -> None:
    typed = defaults_for(MODEL_TYPE, "ocr")  # the model type's row, no checkpoint
    preset = defaults_for(MODEL_TYPE, "ocr", MODEL_ID)
    assert (typed.prompt, typed.max_tokens) != (preset.prompt, preset.max_tokens)
    cache = ResultCache(redis, Keys("vlmqrc"), "tiny@fingerprint")

    ran = _state("under-preset")
    made = _result("text generated under the preset")
    write_items(redis, cache.keys, ran.job_id, made)  # the cache points at stored results
    assert store_results(cache, ran, [made]) == 1

    explicit = _state("asks-type-defaults", prompt=typed.prompt, max_tokens=typed.max_tokens)
    assert explicit.resolved.max_tokens == typed.max_tokens
    assert cached_results(cache, explicit, [0]) == {}

    same = _state("same-as-first")
    hit = cached_results(cache, same, [0])
    assert hit[0].text == "text generated under the preset" and hit[0].result_cache_hit


def test_the_cache_is_skipped_as_each_job_asks(redis: Redis) -> None:
    cache = ResultCache(redis, Keys("vlmqrc"), "tiny@fingerprint")
    assert cache.applies(_state("on").resolved)
    assert not cache.applies(_state("off", result_cache="off").resolved)
    assert not cache.applies(_state("warm", temperature=0.7).resolved)
    assert cache.applies(_state("sampled", temperature=0.7, result_cache="sampled").resolved)


def test_every_setting_that_decides_text_is_in_the_result_cache_key(redis: Redis) -> None:
    cache = ResultCache(redis, Keys("vlmqrc"), "tiny@fingerprint")
    base = _state("k", max_side=500).resolved
    other = {"prompt": "Other.", "max_tokens": 9, "temperature": 0.5, "stop": ("</y>",),
             "max_side": 600, "result_cache": "sampled", "blob_ttl": 60, "text_layer": "off",
             "schema": '{"type":"object","properties":{"a":{"type":"integer"}}}',
             "messages": (Message("user", "Other?"),), "stream": True}
    assert set(other) == {f.name for f in fields(JobSettings)}, "a new field needs a value"
    image = Item(kind="image", blob="b" * 64, source="a.png", page=None)
    for item in (ITEM, image):
        for name, value in other.items():
            changed = (cache.digest(item, replace(base, **{name: value}))
                       != cache.digest(item, base))
            # Only a PDF page has a text layer: an image's key ignores the mode.
            decides = name not in NOT_DECIDING_TEXT and (name != "text_layer"
                                                         or item.kind == "pdf")
            assert changed == decides, (item.kind, name)
