"""The result cache: a finished item's text in Redis, shared by every worker of a fleet.

An item whose key was seen before (same model weights, same input bytes and page, same
prompt, stop strings, max_tokens, max_side and preprocessing) gets the stored text with
no fetch, decode, render or generation. Only deterministic items (temperature 0) are
stored, unless a job opts in with `result_cache: "sampled"`; failed items never are.

Bounds: every entry expires after `ttl_s`; the entries' total size is kept under
`max_bytes` by evicting the oldest first (an index zset scored by store time, whose
members carry each entry's size, and a byte counter, updated atomically in Lua).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.exceptions import RedisError

from vlmq.shared import lua
from vlmq.shared.keys import Keys
from vlmq.shared.schema import Item, ItemResult
from vlmq.worker.job_settings import JobSettings
from vlmq.worker.prepare import PREPROCESS_VERSION
from vlmq.worker.scheduler import JobState

log = logging.getLogger("vlmq.worker")

DEFAULT_TTL_S = 30 * 24 * 3600
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
# Bump when anything that changes an item's text without changing its key changes.
# 2: keys carry the settings an item really ran with (a checkpoint's preset included);
# version 1 keys of preset checkpoints described the model type's defaults instead.
KEY_VERSION = 2


@dataclass(frozen=True)
class CachedText:
    text: str
    finish_reason: str | None


class ResultCache:
    def __init__(self, redis: Redis, keys: Keys, model_identity: str, *,
                 ttl_s: int = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.redis = redis
        self.keys = keys
        self.model_identity = model_identity
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._store = lua.script(redis, lua.RESULT_CACHE_STORE)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.ttl_s > 0

    def applies(self, settings: JobSettings) -> bool:
        """Whether this job's items are looked up and stored at all."""
        if not self.enabled or settings.result_cache == "off":
            return False
        return settings.temperature == 0 or settings.result_cache == "sampled"

    def digest(self, item: Item, settings: JobSettings) -> str:
        parts: dict[str, Any] = {
            "v": KEY_VERSION, "model": self.model_identity, "kind": item.kind,
            "blob": item.sha256, "page": item.page, "preprocess": PREPROCESS_VERSION,
            "settings": settings.deciding_text(item.kind),
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    def lookup(self, digests: Sequence[str]) -> list[CachedText | None]:
        if not digests:
            return []
        raw = self.redis.mget([self.keys.result_cache(d) for d in digests])
        out: list[CachedText | None] = []
        for value in raw:
            if value is None:
                out.append(None)
                continue
            data = json.loads(value)
            out.append(CachedText(text=str(data["text"]), finish_reason=data.get("finish_reason")))
        return out

    def store(self, digest: str, text: str, finish_reason: str | None) -> bool:
        """Keep one successful item's text; False when it was already there or too big."""
        value = json.dumps({"text": text, "finish_reason": finish_reason})
        key = self.keys.result_cache(digest)
        size = len(value.encode()) + len(key)
        stored = self._store(
            keys=[key, self.keys.result_cache_index, self.keys.result_cache_bytes],
            args=[value, self.ttl_s, self.max_bytes, f"{time.time():.3f}", f"{size}:{digest}",
                  self.keys.result_cache("")])
        return bool(stored)


def cacheable(finish_reason: str | None, error: str | None) -> bool:
    """Only items that ended normally are kept: never a failure or an item cut short."""
    return error is None and finish_reason in ("stop", "length")


def _digests(cache: ResultCache, state: JobState, indexes: Sequence[int]) -> list[str] | None:
    settings = state.resolved
    if not cache.applies(settings):
        return None
    return [cache.digest(state.payload.items[i], settings) for i in indexes]


def cached_results(cache: ResultCache, state: JobState,
                   indexes: Sequence[int]) -> dict[int, ItemResult]:
    """The items of a job starting now whose text is already cached, as ready results."""
    digests = _digests(cache, state, indexes)
    if not digests:
        return {}
    out: dict[int, ItemResult] = {}
    for idx, hit in zip(indexes, cache.lookup(digests), strict=True):
        if hit is None:
            continue
        item = state.payload.items[idx]
        out[idx] = ItemResult(
            index=idx, source=item.source, page=item.page, text=hit.text,
            finish_reason=hit.finish_reason, prompt_tokens=0, completion_tokens=0,
            vision_cache_hit=False, error=None, timings={}, custom_id=item.custom_id,
            result_cache_hit=True)
    return out


def store_results(cache: ResultCache, state: JobState, results: Sequence[ItemResult]) -> int:
    """Keep the generated, successful ones among a job's written results; how many were new.

    Best effort: the results are already written, so a Redis error here costs only the
    cache entries (logged), never the job.
    """
    fresh = [r for r in results if not r.result_cache_hit and r.text is not None
             and cacheable(r.finish_reason, r.error)]
    digests = _digests(cache, state, [r.index for r in fresh])
    if not digests:
        return 0
    stored = 0
    try:
        for d, r in zip(digests, fresh, strict=True):
            stored += cache.store(d, r.text or "", r.finish_reason)
    except RedisError as exc:
        log.warning("result cache: %d item(s) not stored: %s", len(fresh) - stored, exc)
    return stored
