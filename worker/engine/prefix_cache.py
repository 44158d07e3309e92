"""Prefix reuse: an image's key/value prefix is prefilled once and reused across rows and jobs.

The vision cache (worker/prep/vision_cache.py) skips the tower for an image seen before;
this skips the language model's prefill of that image's tokens. A row's prefix is its
prompt up to and including the token after its last image token (the image's end
marker): template, image and whatever text the family's template puts before the image.
Families whose template puts the prompt text before the image (mlx-vlm 0.7.10's qwen2_vl
and gemma3 formats) share that prefix only with the same prompt: a retry, a rerun with a
higher --max-tokens, the repetition guard's retry. Image-first families (qwen2_5_vl,
glm_ocr, idefics3, ...) share it across prompts too: a new caption prompt, extract after OCR.

What mlx-vlm's automatic prefix caching (mlx_vlm/apc.py) gives and what vlmq adds:
- Used as is: `APCManager` (exact prompt-cache snapshots, LRU, a byte budget, hits
  counted) and BatchGenerator's warm path (`apc_manager=`): at admission it looks each
  row up by token prefix and a salt (`_apc_semantic_hash` in prompt_kwargs), restores the
  K/V of a hit and prefills only the row's suffix, warm and cold rows in one batch.
- Added here: in block mode (dense K/V, every verified family) mlx-vlm never reuses a
  prefix that holds image tokens (apc_lookup_plan drops block hits with media, and exact
  snapshots are stored only by checkpoint-mode models), so an image prefix would never
  hit. The engine stores one itself: on a miss it prefills the row's prefix alone
  (`store`), once, and hands the snapshot to the manager; the row and every later row
  with that prefix then start from it. The salt is the vision cache's content key (model
  fingerprint, blob sha256, page, preprocessing), never a path. mlx-vlm's block pool is
  sized 0: its blocks of image prompts could never be reused, only hold memory.
- The byte budget is vlmq's option (--prefix-cache-mb, default from the machine's
  memory); mlx-vlm's own headroom reserve is 0 so the budget alone decides. No disk tier.

Families are opted in by parity: greedy output with a cached prefix equals output without
it, token for token, in batched runs (tests/worker/engine/test_prefix_parity.py). Where that is
not verified, or cannot hold, reuse is off and OFF says why. A verified family whose
template puts the prompt first (qwen2_vl) is off unless --prefix-cache-mb is given
(DEFAULT_OFF): storing each new image's prefix means prefilling it alone, apart from
its admission's other rows, and that costs a first pass more than later same-prompt runs
are likely to win back.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# Families with prefix reuse verified (parity test) and on by default.
VERIFIED = ("qwen2_vl", "qwen2_5_vl", "glm_ocr", "idefics3")
# Why reuse stays off for the other families vlmq serves.
OFF: dict[str, str] = {
    "gemma3": "its sliding-window layers (RotatingKVCache) make mlx-vlm's APC run in "
              "checkpoint mode, its get_input_embeddings returns a square attention mask "
              "that a suffix-only prefill cannot slice, and its template puts the prompt "
              "before the image",
    "qwen3_vl": "BatchGenerator pads deepstack_visual_embeds by the full prompt, so a "
                "suffix-only prefill would misplace them",
}
UNVERIFIED = "prefix reuse not yet verified token for token for this family"
# Verified families left off unless --prefix-cache-mb is given, and why.
DEFAULT_OFF: dict[str, str] = {
    "qwen2_vl": "its template puts the prompt before the image, so only the same prompt "
                "shares the prefix (a retry or rerun), while storing every new image's "
                "prefix cost a first pass 10-30% in vlmq's benchmark (`vlmq help "
                "workers-and-models`); give --prefix-cache-mb to turn it on",
}
MIN_PREFIX = 16  # shorter prefixes are not worth a snapshot (mlx-vlm's exact minimum)
_MIB = 1024 * 1024
_KV_STEP = 256  # mlx-vlm's KVCache.step: a snapshot holds whole steps


def reason_off(model_type: str, *, given: bool = True) -> str | None:
    """None when the family reuses prefixes; else why not. `given`: the budget was asked
    for (--prefix-cache-mb), which turns on a verified family that is off by default."""
    if model_type in VERIFIED:
        return None if given else DEFAULT_OFF.get(model_type)
    return OFF.get(model_type, UNVERIFIED)


def default_budget() -> int:
    """Bytes of prefix K/V held when --prefix-cache-mb is not given: a 16th of the
    machine's memory, at most 1 GiB (the vision cache's own default beside it)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 1024 * _MIB
    return int(min(1024 * _MIB, total // 16))


def salt(fingerprint: str, prefix_key: str) -> int:
    """The APC salt of a content key: a signed 64-bit integer, stable across processes."""
    digest = hashlib.sha256(f"{fingerprint}\0{prefix_key}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


@dataclass
class PrefixStats:
    hits: int = 0  # rows that started from a cached prefix
    misses: int = 0  # rows whose prefix was prefilled (and stored) for them
    tokens_skipped: int = 0  # prompt tokens hits did not prefill
    stores: int = 0
    refused: int = 0  # prefixes not stored (over the budget)


class PrefixCache:
    """The engine's prefix store (MLX thread only): an mlx-vlm APCManager bounded by bytes."""

    def __init__(self, model: Any, fingerprint: str, budget_bytes: int,
                 per_token_bytes: int) -> None:
        from mlx_vlm import apc

        self.fingerprint = fingerprint
        self.budget = budget_bytes
        self.per_token = max(1, per_token_bytes)
        self.lm = model.language_model
        self.media = apc.multimodal_token_ids_from_config(model.config)
        self.manager = apc.APCManager(num_blocks=0, disk=None, overrides={
            "memory_max_gb": budget_bytes / 1024**3, "memory_reserve_gb": 0.0,
            # entries are bounded by bytes, not by count
            "checkpoint_entries": 1 << 30,
        })
        self.stats = PrefixStats()

    def boundary(self, ids: list[int]) -> int:
        """Tokens of the shareable prefix: through the token after the last image token
        (0: no image, or too short to be worth it). At most len - 1, so that the row
        still prefills one token of its own and gets its first logits."""
        from mlx_vlm import apc

        end = apc.media_safe_prefix_min(ids, self.media)
        if end <= 0:
            return 0
        n = min(end + 1, len(ids) - 1)
        return n if n >= MIN_PREFIX else 0

    def held_bytes(self) -> int:
        return int(self.manager.resident_bytes())

    def prepare(self, ids: list[int], kwargs: dict[str, Any],
                prefix_key: str) -> tuple[bool, int]:
        """Before a row is inserted: salt its prompt kwargs so the generator finds its
        prefix, and make sure the prefix is cached (prefilling it here on a miss).
        Returns whether it was cached already, and the prompt tokens the generator will
        not prefill for this row (on a miss: those prefilled here, once)."""
        n = self.boundary(ids) if "inputs_embeds" in kwargs else 0
        if n <= 0:
            return False, 0
        key = salt(self.fingerprint, prefix_key)
        kwargs["_apc_semantic_hash"] = key
        _, found = self.manager.lookup_exact_cache(ids, extra_hash=key, min_prefix_tokens=n - 1)
        if found >= n:
            self.stats.hits += 1
            self.stats.tokens_skipped += n
            return True, n
        self.stats.misses += 1
        held = -(-n // _KV_STEP) * _KV_STEP  # a KVCache grows in steps of 256 tokens
        if held * self.per_token > self.budget or not self.store(ids, kwargs, n, key):
            self.stats.refused += 1
            return False, 0
        return False, n

    def store(self, ids: list[int], kwargs: dict[str, Any], n: int, key: int) -> bool:
        """Prefill the first `n` tokens alone and hand their K/V to the manager."""
        import mlx.core as mx
        from mlx_vlm.models import cache as kv

        prompt_cache = kv.make_prompt_cache(self.lm)
        extra: dict[str, Any] = {}
        if "position_ids" in kwargs:
            extra["position_ids"] = kwargs["position_ids"][..., :n]
        if "rope_deltas" in kwargs:
            extra["rope_deltas"] = kwargs["rope_deltas"]
        x = mx.array(ids[:n], dtype=mx.int32)[None]
        self.lm(x, cache=prompt_cache, inputs_embeds=kwargs["inputs_embeds"][:, :n], **extra)
        mx.eval([c.state for c in prompt_cache])
        ok = bool(self.manager.store_exact_cache(ids[:n], prompt_cache, extra_hash=key))
        if ok:
            self.stats.stores += 1
        return ok

    def close(self) -> None:
        self.manager.close()
