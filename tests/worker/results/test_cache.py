"""The shared result cache: real Redis, a real worker process, the real tiny model.

Entries point at stored item results (the text is kept once); these tests write the
targets through the same code path as the worker's results and check what a lookup
makes of them when they vanish, change, or move.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.factories import job_payload
from tests.support.helpers import finish, make_images
from tests.support.lua_calls import write_items
from vlmq.producer.client import Client
from vlmq.producer.options import JobOptions
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult, JobPayload, parse_payload
from vlmq.worker.item_order import JobState
from vlmq.worker.job_settings import resolve_job
from vlmq.worker.results.cache import (
    ResultCache,
    cached_results,
    cached_results_many,
    store_results,
    store_results_many,
    text_hash,
)


def _stats(redis: Redis, name: str) -> dict[str, str]:
    raw = redis.hgetall(Keys().worker_stats(name))
    return {k.decode(): v.decode() for k, v in raw.items()}


@pytest.mark.slow
def test_second_run_of_a_folder_is_served_from_the_result_cache(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        procs: list[subprocess.Popen[str]]) -> None:
    folder = tmp_path / "photos"
    make_images(folder, 3)
    client = Client(redis_url)
    opts = JobOptions(max_tokens=6, max_side=112)
    first = client.submit("caption", [folder], opts)
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst", name="w1"))
    rc, out = finish(procs[-1])
    assert rc == 0, out
    generated = list(first.results())
    assert all(r.ok and not r.result_cache_hit for r in generated), generated
    assert int(_stats(redis, "w1")["result_cache_stores"]) == 3

    again = client.submit("caption", [folder], opts)
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst", name="w2"))
    rc, out = finish(procs[-1])
    assert rc == 0, out
    hits = list(again.results())
    assert [r.result_cache_hit for r in hits] == [True] * 3
    assert [r.text for r in hits] == [r.text for r in generated]
    assert [r.source for r in hits] == ["img0.png", "img1.png", "img2.png"]
    stats = _stats(redis, "w2")
    assert stats["tokens"] == "0" and stats["result_cache_hits"] == "3", stats
    assert again.summary() == {**(again.summary() or {}), "result_cache_hits": 3,
                               "completion_tokens": 0}

    other_prompt = client.submit("caption", [folder], opts.with_(prompt="Name one colour."))
    opted_out = client.submit("caption", [folder], opts.with_(result_cache="off"))
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst", name="w3"))
    rc, out = finish(procs[-1])
    assert rc == 0, out
    for job in (other_prompt, opted_out):
        results = list(job.results())
        assert len(results) == 3 and not any(r.result_cache_hit for r in results), results
        assert (job.summary() or {})["completion_tokens"] > 0
    stats = _stats(redis, "w3")
    assert stats["result_cache_hits"] == "0" and int(stats["tokens"]) > 0, stats

    # The cache held no text of its own: once the results it pointed at are deleted,
    # the same folder is generated again (and the dangling entries make way).
    client.delete([first.id, again.id])
    fourth = client.submit("caption", [folder], opts)
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst", name="w4"))
    rc, out = finish(procs[-1])
    assert rc == 0, out
    assert not any(r.result_cache_hit for r in fourth.results())
    assert [r.text for r in fourth.results()] == [r.text for r in generated]
    assert int(_stats(redis, "w4")["result_cache_stores"]) == 3


def test_no_result_cache_flag_reaches_the_payload(tmp_path: Path) -> None:
    item = {"kind": "image", "blob": "a" * 64, "source": "x.png"}
    base = {"v": 1, "task": "caption", "items": [item]}
    assert parse_payload(base).get("result_cache") == "on"
    assert "result_cache" not in parse_payload(base).to_dict()
    assert parse_payload({**base, "result_cache": False}).to_dict()["result_cache"] is False
    assert parse_payload({**base, "result_cache": "sampled"}).get("result_cache") == "sampled"
    with pytest.raises(PayloadError, match="result_cache"):
        parse_payload({**base, "result_cache": "yes"})


def test_cli_no_result_cache_is_sent_to_redis(redis_url: str, redis: Redis,
                                              tmp_path: Path) -> None:
    make_images(tmp_path / "p", 1)
    out = subprocess.run([helpers.VLMQ, "--redis-url", redis_url, "enqueue", "caption",
                          str(tmp_path / "p"), "--no-result-cache", "--json"],
                         capture_output=True, text=True, check=True).stdout
    job = Client(redis_url).job(json.loads(out)["id"])
    assert job.payload().get("result_cache") == "off"


def _payload(n: int, first: int = 0) -> JobPayload:
    """`n` images, each of its own content: a job whose results the cache keys apart."""
    return job_payload(n, task="caption", blob=None, name="img{}.png", first=first)


def _state(job_id: str, payload: JobPayload) -> JobState:
    state = JobState(job_id=job_id, payload=payload)
    state.settings = resolve_job(payload, "qwen2_vl", None)
    return state


def _done(redis: Redis, keys: Keys, state: JobState, texts: list[str], *,
          ttl_s: int = 3600, hit: bool = False) -> list[ItemResult]:
    """Write each item's result as a worker does (one item result per index)."""
    out = []
    for i, text in enumerate(texts):
        item = state.payload.items[i]
        res = ItemResult(index=i, source=item.source, page=None, text=text,
                         finish_reason="stop", prompt_tokens=0 if hit else 9,
                         completion_tokens=0 if hit else 4, vision_cache_hit=False,
                         error=None, timings={"generate_s": 0.123456789},
                         result_cache_hit=hit)
        write_items(redis, keys, state.job_id, res, ttl_s=ttl_s)
        out.append(res)
    return out


def _entries(redis: Redis, cache: ResultCache) -> dict[str, tuple[int, str]]:
    """digest -> (generation, pointer) over every live generation."""
    out = {}
    for g in cache.generations():
        for d, ptr in redis.hgetall(cache.keys.result_cache_gen(g)).items():
            out[d.decode()] = (g, ptr.decode())
    return out


@pytest.fixture
def cache(redis: Redis) -> ResultCache:
    return ResultCache(redis, Keys("vlmqrc"), "tiny@fp", ttl_s=30 * 86400)


def test_a_hit_gives_the_stored_text_and_the_text_is_kept_once(
        redis: Redis, cache: ResultCache) -> None:
    keys = cache.keys
    first = _state("job-a", _payload(4))
    texts = ["a cat", "two dogs", "ünïcode 文字", "a lone \udc80 surrogate"]
    assert store_results(cache, first, _done(redis, keys, first, texts)) == 4
    entries = _entries(redis, cache)
    assert sorted(p for _, p in entries.values()) == [
        f"job-a {i} {text_hash(t)}" for i, t in enumerate(texts)]
    # The entries hold pointers only: the text is nowhere in the cache.
    assert all(len(d) == 22 and len(p) < 64 for d, (_, p) in entries.items())
    again = _state("job-b", _payload(4))
    hits = cached_results(cache, again, [0, 1, 2, 3])
    assert [hits[i].text for i in range(4)] == texts
    assert all(h.result_cache_hit and h.finish_reason == "stop" and h.completion_tokens == 0
               for h in hits.values())
    assert [h.source for h in hits.values()] == [f"img{i}.png" for i in range(4)]
    other = _state("job-c", _payload(2, first=7))
    assert cached_results(cache, other, [0, 1]) == {}


def test_several_jobs_are_stored_and_looked_up_at_once(
        redis: Redis, cache: ResultCache) -> None:
    keys = cache.keys
    a, b = _state("job-a", _payload(2)), _state("job-b", _payload(1, first=5))
    done = [(a, _done(redis, keys, a, ["a0", "a1"])), (b, _done(redis, keys, b, ["b0"]))]
    assert store_results_many(cache, done) == 3
    asked = [(_state("x", _payload(2)), [0, 1]), (_state("y", _payload(2, first=4)), [0, 1])]
    found = cached_results_many(cache, asked)
    assert [{i: r.text for i, r in f.items()} for f in found] == [{0: "a0", 1: "a1"},
                                                                  {1: "b0"}]


def test_a_pointer_whose_target_is_gone_is_a_miss_and_is_removed(
        redis: Redis, cache: ResultCache) -> None:
    keys = cache.keys
    first = _state("job-a", _payload(2))
    store_results(cache, first, _done(redis, keys, first, ["one", "two"]))
    redis.delete(keys.job_items("job-a"))  # deleted, or expired with its job
    assert cache.lookup([cache.digest(i, first.resolved) for i in first.payload.items]) == [
        None, None]
    assert _entries(redis, cache) == {}


def test_a_reused_job_id_or_a_rewritten_item_is_a_miss_and_is_removed(
        redis: Redis, cache: ResultCache) -> None:
    keys = cache.keys
    first = _state("job-a", _payload(3))
    store_results(cache, first, _done(redis, keys, first, ["one", "two", "three"]))
    # The id is reused by a job over other inputs: item 0 now holds other text.
    reused = _state("job-a", _payload(3, first=50))
    _done(redis, keys, reused, ["other"])
    # Item 1 was rewritten as a failure; item 2 is still the text the entry was made for.
    failed = ItemResult(index=1, source="x", page=None, text=None, finish_reason="error",
                        prompt_tokens=0, completion_tokens=0, vision_cache_hit=False,
                        error="boom")
    write_items(redis, keys, "job-a", failed)
    digests = [cache.digest(i, first.resolved) for i in first.payload.items]
    found = cache.lookup(digests)
    assert found[0] is None and found[1] is None
    assert found[2] is not None and found[2].text == "three"
    assert set(_entries(redis, cache)) == {digests[2]}


def test_a_hit_moves_its_entry_to_the_newest_copy_which_lives_longest(
        redis: Redis, cache: ResultCache) -> None:
    keys = cache.keys
    old = _state("job-old", _payload(1))
    store_results(cache, old, _done(redis, keys, old, ["kept"], ttl_s=600))
    (digest, (gen_old, _)), = _entries(redis, cache).items()
    new = _state("job-new", _payload(1))
    hits = cached_results(cache, new, [0])
    written = _done(redis, keys, new, [hits[0].text or ""], ttl_s=10 * 86400, hit=True)
    assert store_results(cache, new, written) == 0  # moved, not new
    (d, (gen_new, ptr)), = _entries(redis, cache).items()
    assert d == digest and ptr.startswith("job-new 0 ") and gen_new > gen_old
    redis.delete(keys.job_items("job-old"))
    assert [h.text if h else None for h in cache.lookup([digest])] == ["kept"]


def test_a_hit_whose_entry_has_long_to_live_writes_nothing(
        redis: Redis, cache: ResultCache) -> None:
    """An entry moves about once a span however often it is hit: a hit costs no write."""
    keys = cache.keys
    old = _state("job-old", _payload(1))
    store_results(cache, old, _done(redis, keys, old, ["kept"], ttl_s=9 * 86400))
    before = _entries(redis, cache)
    new = _state("job-new", _payload(1))
    hits = cached_results(cache, new, [0])
    written = _done(redis, keys, new, [hits[0].text or ""], ttl_s=10 * 86400, hit=True)
    assert store_results(cache, new, written) == 0
    assert _entries(redis, cache) == before


def test_an_entry_expires_with_its_target_within_one_span(
        redis: Redis, cache: ResultCache) -> None:
    keys = cache.keys
    span_ms = cache.span_s * 1000
    for job, ttl in (("short", 3600), ("long", 9 * 86400), ("past-cache", 60 * 86400)):
        state = _state(job, _payload(1, first=len(job)))
        store_results(cache, state, _done(redis, keys, state, [job], ttl_s=ttl))
        target_end = redis.pexpiretime(keys.job_items(job))
        (gen, _), = [v for v in _entries(redis, cache).values() if v[1].startswith(job)]
        gen_end = redis.pexpiretime(keys.result_cache_gen(gen))
        # Never past the cache's own ttl, and never more than a span past its target.
        life_end = min(target_end, int(time.time() * 1000) + cache.ttl_s * 1000)
        assert life_end <= gen_end <= life_end + span_ms, job
        assert gen_end % span_ms == 0


def test_results_of_a_job_already_gone_are_not_pointed_at(
        redis: Redis, cache: ResultCache) -> None:
    state = _state("job-a", _payload(1))
    results = _done(redis, cache.keys, state, ["text"])
    redis.delete(cache.keys.job_items("job-a"))
    assert store_results(cache, state, results) == 0
    assert _entries(redis, cache) == {}


def test_expired_generations_leave_nothing_counted(redis: Redis) -> None:
    """There is no counter to drift: what the budget sees is the live generations'
    MEMORY USAGE, so entries that expired stop counting the moment they are gone."""
    keys = Keys("vlmqrc")
    cache = ResultCache(redis, keys, "tiny@fp", ttl_s=1, span_s=1, max_bytes=10_000)
    state = _state("job-a", _payload(20))
    assert store_results(cache, state, _done(redis, keys, state, ["t"] * 20, ttl_s=1)) == 20
    gens = [keys.result_cache_gen(g) for g in cache.generations()]
    assert sum(int(redis.memory_usage(g) or 0) for g in gens) > 0
    deadline = time.monotonic() + 30
    while any(redis.exists(g) for g in gens) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(redis.exists(g) for g in gens)
    # A budget that only fits a few entries is not blocked by what expired.
    tight = ResultCache(redis, keys, "tiny@fp", ttl_s=3600, max_bytes=600)
    again = _state("job-b", _payload(3, first=100))
    assert store_results(tight, again, _done(redis, keys, again, ["u"] * 3)) == 3


def _used(redis: Redis) -> int:
    """used_memory, read twice: the first INFO after a burst of writes still counts
    buffers the server frees lazily."""
    redis.info("memory")
    return int(redis.info("memory")["used_memory"])


@pytest.mark.parametrize("entries", [500, 6000])  # a listpack, and a hash table
def test_the_budget_counts_what_redis_really_uses(own_redis: Redis, entries: int) -> None:
    redis = own_redis
    keys = Keys("vlmqrc")
    budget = 256 * 1024
    cache = ResultCache(redis, keys, "tiny@fp", ttl_s=30 * 86400, max_bytes=budget)
    # Ballast keys (with a TTL, as the jobs' keys have) keep the keyspace and expires
    # dicts dense, so the server's cron never shrinks them between the two readings
    # below: such a shrink frees bucket memory (256 B and up) that is not the entries'.
    ballast = redis.pipeline(transaction=False)
    for i in range(400):
        ballast.set(f"vlmqrc:ballast:{i}", "x", ex=3600)
    ballast.execute()
    per_job = 500
    for j in range(math.ceil(entries / per_job)):
        state = _state(f"0f1e2d3c-{j:04d}-4b5a-8899-aabbccddeeff", _payload(per_job,
                                                                          first=j * per_job))
        results = _done(redis, keys, state, [f"text {j} {i}" for i in range(per_job)])
        store_results(cache, state, results)
    for j in range(math.ceil(entries / per_job)):
        redis.delete(keys.job_items(f"0f1e2d3c-{j:04d}-4b5a-8899-aabbccddeeff"))
        redis.delete(keys.job_events(f"0f1e2d3c-{j:04d}-4b5a-8899-aabbccddeeff"))
    gens = [k for k in redis.scan_iter(keys.result_cache_gen(0)[:-1] + "*")]
    kept = sum(int(redis.hlen(g)) for g in gens)
    exact = cache.used_bytes(samples=0)
    before = _used(redis)
    redis.delete(*gens)
    real = before - _used(redis)
    # What the budget counts is what deleting the entries gave back, to within the
    # generation keys' own entries in the keyspace (under 100 B each) ...
    assert exact <= real <= exact + 100 * len(gens), (exact, real)
    if entries * 150 > budget:
        # ... and eviction kept it under the budget (the store script samples 5 fields
        # per generation: 5% slack for that estimate), evicting no more than needed.
        assert kept < entries and 0.8 * budget <= exact <= 1.05 * budget, (kept, exact)
    else:
        assert kept == entries and exact < budget
