"""The result cache: which stored item result already answers an item, fleet-wide.

An item whose key was seen before (same model weights, same input bytes and page, same
prompt, stop strings, max_tokens, max_side and preprocessing) gets the stored text with
no fetch, decode, render or generation. Only deterministic items (temperature 0) are
stored, unless a job opts in with `result_cache: "sampled"`; failed items never are.

The text is kept once, in the item result that produced it (`<prefix>:job:<id>:items`).
A cache entry only points at it: "<job id> <index> <text hash>". A lookup reads the
pointed-at result; a pointer whose target expired, was deleted, or now holds other text
(a job id reused with other inputs) is a miss, and is removed. A hit's text is written
into the new job's own results like any other; when the entry's target is near its end,
the entry then moves to that newest copy, which lives longest.

Entries live in generation hashes (`Keys.result_cache_gen`), one per span of target
expiry times, each expiring one span after the last target it can point at: an entry
never outlives its target by more than a span, and nothing has to count what expires.
The byte budget is what Redis reports the generations really use (MEMORY USAGE); over
it, entries of the oldest generation are evicted at random (shared/result_cache_store.lua).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import RedisError

from vlmq.shared import lua
from vlmq.shared.keys import Keys
from vlmq.shared.messages import TEXT_FROM_MODEL, Item, ItemResult
from vlmq.worker import options
from vlmq.worker.item_order import JobState
from vlmq.worker.job_settings import JobSettings
from vlmq.worker.prep.preparer import PREPROCESS_VERSION, Readable

log = logging.getLogger("vlmq.worker")

DEFAULT_TTL_S = options.DEFAULT_RESULT_CACHE_TTL_S  # the table of worker options owns them
DEFAULT_MAX_BYTES = options.DEFAULT_RESULT_CACHE_BYTES
# One generation per day of target expiry: a lookup probes ttl/span + 1 hashes (31 by
# default) in one script call. Every worker of a fleet must use the same span.
GEN_SPAN_S = 24 * 3600
# Bump when anything that changes an item's text without changing its key changes.
# 2: keys carry the settings an item really ran with (a checkpoint's preset included).
# 3: entries point at stored item results (128-bit digests in generation hashes).
KEY_VERSION = 3
# Digests per script call: Lua's unpack() takes a few thousand values at most.
CHUNK = 1000
# Hits whose generation is remembered until they are stored (bounded: cleared when full).
MAX_REMEMBERED = 100_000


@dataclass(frozen=True)
class CachedText:
    text: str
    finish_reason: str | None
    text_source: str = TEXT_FROM_MODEL
    json: Any = None  # an extract item's value


def text_hash(text: str) -> str:
    """32 bits of the text's sha256: enough to tell a rewritten target from the one an
    entry was made for (it must also sit at the same job id and index)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def pointer(job_id: str, index: int, text: str) -> str:
    return f"{job_id} {index} {text_hash(text)}"


def _target(ptr: bytes) -> tuple[str, int, str] | None:
    parts = ptr.decode(errors="replace").split(" ")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2]


class ResultCache:
    """One worker's handle on the fleet's cache; every worker must use the same span."""

    def __init__(self, redis: Redis, keys: Keys, model_identity: str, *,
                 ttl_s: int = DEFAULT_TTL_S, max_bytes: int = DEFAULT_MAX_BYTES,
                 span_s: int = GEN_SPAN_S) -> None:
        self.redis = redis
        self.keys = keys
        self.model_identity = model_identity
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.span_s = span_s
        self._store = lua.script(redis, lua.RESULT_CACHE_STORE)
        self._lookup = lua.script(redis, lua.RESULT_CACHE_LOOKUP)
        # Generation of each entry a lookup verified, until its hit is stored (see
        # needs_moving).
        self._hit_gens: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.ttl_s > 0

    def applies(self, settings: JobSettings) -> bool:
        """Whether this job's items are looked up and stored at all."""
        if not self.enabled or settings.result_cache == "off":
            return False
        return settings.temperature == 0 or settings.result_cache == "sampled"

    def digest(self, item: Item, settings: JobSettings) -> str:
        """128 bits of the key's sha256, base64url: 22 characters per entry."""
        parts: dict[str, Any] = {
            "v": KEY_VERSION, "model": self.model_identity, "kind": item.kind,
            "blob": item.sha256, "page": item.page, "preprocess": PREPROCESS_VERSION,
            "settings": _deciding(settings, item.kind),
        }
        raw = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()[:16]
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    def generations(self, now_s: float | None = None) -> list[int]:
        """The generations that can hold a live entry now, oldest first."""
        now = time.time() if now_s is None else now_s
        first = math.floor(now / self.span_s)
        return list(range(first, math.floor((now + self.ttl_s) / self.span_s) + 1))

    def used_bytes(self, samples: int = 5) -> int:
        """What the budget counts: the live generations' MEMORY USAGE, plus 8 bytes per
        field of a hash-table generation (see result_cache_store.lua). samples=0 is exact
        (and reads every field)."""
        gens = [self.keys.result_cache_gen(g) for g in self.generations()]
        pipe = self.redis.pipeline(transaction=False)
        for g in gens:
            pipe.memory_usage(g, samples=samples)
            pipe.object("encoding", g)
            pipe.hlen(g)
        got = pipe.execute()
        total = 0
        for i in range(0, len(got), 3):
            usage, encoding, fields = got[i:i + 3]
            total += int(usage or 0) + (8 * int(fields) if encoding == b"hashtable" else 0)
        return total

    def lookup(self, digests: Sequence[str]) -> list[CachedText | None]:
        """Each digest's text, read from the item result its entry points at, or None.
        Two round trips whatever the count: the entries, then their targets."""
        numbers = list(reversed(self.generations()))
        gens = [self.keys.result_cache_gen(g) for g in numbers]
        found: list[tuple[bytes, int] | None] = []
        for i in range(0, len(digests), CHUNK):
            flat = self._lookup(keys=gens, args=list(digests[i:i + CHUNK]))
            found += [None if flat[j] is None else (flat[j], int(flat[j + 1]))
                      for j in range(0, len(flat), 2)]
        targets = [None if f is None else _target(f[0]) for f in found]
        stored = self._read_targets([t for t in targets if t is not None])
        out: list[CachedText | None] = []
        stale = self.redis.pipeline(transaction=False)
        for d, f, t in zip(digests, found, targets, strict=True):
            hit = None if t is None else _verified(stored.get((t[0], t[1])), t)
            out.append(hit)
            if f is not None and hit is None:
                # The target is gone or changed: a miss, and the entry goes.
                stale.hdel(gens[f[1] - 1], d)
            elif f is not None:
                self._remember(d, numbers[f[1] - 1])
        if len(stale):
            stale.execute()
        return out

    def _read_targets(self, targets: Sequence[tuple[str, int, str]]
                      ) -> dict[tuple[str, int], bytes | None]:
        """The pointed-at item results: one HMGET per job, all in one round trip."""
        by_job: dict[str, list[int]] = {}
        for job_id, index, _ in targets:
            by_job.setdefault(job_id, []).append(index)
        if not by_job:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for job_id, indexes in by_job.items():
            pipe.hmget(self.keys.job_items(job_id), [str(i) for i in indexes])
        out: dict[tuple[str, int], bytes | None] = {}
        for (job_id, indexes), values in zip(by_job.items(), pipe.execute(), strict=True):
            out.update(((job_id, i), v) for i, v in zip(indexes, values, strict=True))
        return out

    def _remember(self, digest: str, gen: int) -> None:
        if len(self._hit_gens) >= MAX_REMEMBERED:
            self._hit_gens.clear()  # hits never stored (their jobs were dropped)
        self._hit_gens[digest] = gen

    def needs_moving(self, digest: str) -> bool:
        """Whether a hit's entry should move to the copy just written: only when its
        entry expires within two spans (days), so an entry moves about once a span
        however often it is hit, and a hit costs no write otherwise."""
        gen = self._hit_gens.pop(digest, None)
        return gen is not None and gen <= self.generations()[0] + 1

    def store(self, job_id: str, entries: Sequence[tuple[str, int, str]], *,
              pipeline: Pipeline | None = None) -> int:
        """Point entries (digest, item index, its text) at `job_id`'s stored results;
        how many digests were new to the cache (nothing is stored when the results are
        gone). With `pipeline`, the script calls are queued there and their replies (the
        counts) come from its execute(); this returns 0."""
        now = time.time()
        gens = [self.keys.result_cache_gen(g) for g in self.generations(now)]
        first = math.floor(now / self.span_s)
        fresh = 0
        for i in range(0, len(entries), CHUNK):
            args: list[str | int] = [int(now * 1000), self.span_s * 1000, first,
                                     self.max_bytes, self.ttl_s * 1000]
            for digest, index, text in entries[i:i + CHUNK]:
                args += [digest, pointer(job_id, index, text)]
            keys = [self.keys.job_items(job_id), *gens]
            if pipeline is not None:
                self._store(keys=keys, args=args, client=pipeline)
            else:
                fresh += int(self._store(keys=keys, args=args))
        return fresh


@functools.lru_cache(maxsize=64)
def _deciding(settings: JobSettings, kind: str) -> dict[str, Any]:
    """Once per job and kind, not per item: asdict() costs more than the hash."""
    return settings.deciding_text(kind)


def _verified(raw: bytes | None, target: tuple[str, int, str]) -> CachedText | None:
    """The target's text, if it still is the text the entry was made for."""
    if raw is None:
        return None
    try:
        res = ItemResult.from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError):
        return None
    if (res.index != target[1] or res.text is None or not cacheable(res)
            or text_hash(res.text) != target[2]):
        return None
    return CachedText(text=res.text, finish_reason=res.finish_reason,
                      text_source=res.text_source, json=res.json)


def cacheable(res: ItemResult) -> bool:
    """Only items that ended normally are kept: never a failure, an item cut short, or a
    text layer standing in for a model that failed (the failure may not recur)."""
    return (res.error is None and res.finish_reason in ("stop", "length")
            and res.model_error is None and res.model_text is None)


def _digests(cache: ResultCache, state: JobState, indexes: Sequence[int]) -> list[str] | None:
    settings = state.resolved
    if not cache.applies(settings):
        return None
    items = state.payload.items
    return [cache.digest(items[i], settings.for_item(items[i])) for i in indexes]


def cached_results(cache: ResultCache, state: JobState,
                   indexes: Sequence[int]) -> dict[int, ItemResult]:
    """The items of a job starting now whose text is already cached, as ready results."""
    return cached_results_many(cache, [(state, indexes)])[0]


def cached_results_many(cache: ResultCache, jobs: Sequence[tuple[JobState, Sequence[int]]]
                        ) -> list[dict[int, ItemResult]]:
    """cached_results for several jobs starting at once, in the same two round trips."""
    asked: list[tuple[int, int, str]] = []  # (job's position, item index, digest)
    for pos, (state, indexes) in enumerate(jobs):
        digests = _digests(cache, state, indexes) or []
        asked += [(pos, i, d) for i, d in zip(indexes, digests, strict=False)]
    out: list[dict[int, ItemResult]] = [{} for _ in jobs]
    if not asked:
        return out
    found = [(pos, idx, hit) for (pos, idx, _), hit in
             zip(asked, cache.lookup([d for _, _, d in asked]), strict=True) if hit is not None]
    allowed = _verified_hits(jobs, found)
    for pos, idx, hit in found:
        if (pos, idx) not in allowed:
            continue
        item = jobs[pos][0].payload.items[idx]
        out[pos][idx] = ItemResult(
            index=idx, source=item.source, page=item.page, text=hit.text,
            finish_reason=hit.finish_reason, prompt_tokens=0, completion_tokens=0,
            vision_cache_hit=False, error=None, timings={}, custom_id=item.custom_id,
            result_cache_hit=True, text_source=hit.text_source, json=hit.json)
    return out


def _verified_hits(jobs: Sequence[tuple[JobState, Sequence[int]]],
                   found: Sequence[tuple[int, int, CachedText]]) -> set[tuple[int, int]]:
    """(job's position, item index) of the hits that may be used: a hit on a referenced
    item only once its file verified (Readable.confirm, worker/prep/preparer.py), so a
    missing or changed reference is never answered for the content it claims. Indexes
    that cannot confirm keep blob hits only."""
    allowed: set[tuple[int, int]] = set()
    for pos, (state, indexes) in enumerate(jobs):
        mine = [idx for p, idx, _ in found if p == pos]
        if isinstance(indexes, Readable):
            ok = indexes.confirm(mine) if mine else set()
        else:
            ok = {idx for idx in mine if state.payload.items[idx].ref is None}
        allowed |= {(pos, idx) for idx in ok}
    return allowed


def store_results(cache: ResultCache, state: JobState, results: Sequence[ItemResult]) -> int:
    """Point the cache at a job's written, successful results; how many were new.

    Hits whose entry is near its end move it to this newest copy. Best effort: the results
    are already written, so a Redis error here costs only the cache entries (logged),
    never the job.
    """
    return store_results_many(cache, [(state, results)])


def store_results_many(cache: ResultCache,
                       jobs: Sequence[tuple[JobState, Sequence[ItemResult]]]) -> int:
    """store_results for several jobs' written results, in one round trip."""
    todo: list[tuple[str, list[tuple[str, int, str]]]] = []
    for state, results in jobs:
        entries = _entries_to_store(cache, state, results)
        if entries:
            todo.append((state.job_id, entries))
    if not todo:
        return 0
    return _store_all(cache, todo)


def _entries_to_store(cache: ResultCache, state: JobState, results: Sequence[ItemResult]
                      ) -> list[tuple[str, int, str]]:
    """(digest, index, text) of a job's results the cache should point at: each cacheable
    one it did not answer itself, and a hit whose entry is near its end (it moves here)."""
    kept = [r for r in results
            if r.text is not None and cacheable(r)]
    digests = _digests(cache, state, [r.index for r in kept]) or []
    return [(d, r.index, r.text or "") for d, r in zip(digests, kept, strict=False)
            if not r.result_cache_hit or cache.needs_moving(d)]


def _store_all(cache: ResultCache, todo: Sequence[tuple[str, list[tuple[str, int, str]]]]
               ) -> int:
    """One pipeline of store calls; how many entries were new. A Redis error is logged and
    costs only the entries, as the results are already written."""
    pipe = cache.redis.pipeline(transaction=False)
    for job_id, entries in todo:
        cache.store(job_id, entries, pipeline=pipe)
    try:
        replies = pipe.execute(raise_on_error=False)
    except RedisError as exc:
        log.warning("result cache: %d item(s) not stored: %s",
                    sum(len(e) for _, e in todo), exc)
        return 0
    failed = [r for r in replies if isinstance(r, Exception)]
    if failed:
        log.warning("result cache: %d of %d store call(s) failed: %s", len(failed),
                    len(replies), failed[0])
    return sum(int(r) for r in replies if not isinstance(r, Exception))
