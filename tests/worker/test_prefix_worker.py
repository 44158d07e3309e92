"""Prefix reuse through a real `vlmq worker` and Redis: two jobs with the same image in one
window prefill its prefix once, and --prefix-cache-mb 0 turns reuse off. Counts tokens, in
the worker's stats hash, each item result and each job's summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis import Redis

from tests.support.helpers import Spawn, finish, make_images
from vlmq.producer.client import Client
from vlmq.shared.keys import Keys

pytestmark = pytest.mark.slow


def _stats(redis: Redis, name: str) -> dict[str, int]:
    raw = redis.hgetall(Keys().worker_stats(name))
    wanted = ("prefix_hits", "prefix_tokens_skipped", "prefill_tokens")
    return {k: int(float(raw[k.encode()].decode())) for k in wanted}


@pytest.mark.parametrize("budget", ["64", "0"])
def test_two_jobs_of_one_image_prefill_its_prefix_once(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn, budget: str) -> None:
    (img,) = make_images(tmp_path / "a", 1)
    twin = tmp_path / "b" / "copy.png"
    twin.parent.mkdir()
    twin.write_bytes(img.read_bytes())
    with Client(redis_url) as client:
        jobs = [client.caption([path], max_side=112, max_tokens=8, result_cache="off")
                for path in (img, twin)]
    name = f"prefix-{budget}"
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst",
                                  "--prefix-cache-mb", budget, name=name))
    assert rc == 0, out
    (a,), (b,) = (job.results() for job in jobs)
    assert a.text == b.text and a.prompt_tokens == b.prompt_tokens
    s = _stats(redis, name)
    n = a.prompt_tokens
    if budget == "0":
        assert s == {"prefix_hits": 0, "prefix_tokens_skipped": 0, "prefill_tokens": 2 * n}
    else:
        assert s["prefix_hits"] == 1 and 0 < s["prefix_tokens_skipped"] < n
        assert s["prefill_tokens"] == 2 * n - s["prefix_tokens_skipped"]
    # Each job's summary sums its items' prefix_tokens (its counts absent while 0): the one
    # hit is the job whose item came second, and the two jobs count what the worker did.
    items = {job.id: (a, b)[i] for i, job in enumerate(jobs)}
    summaries = {job.id: job.summary() or {} for job in jobs}
    for jid, res in items.items():
        m = summaries[jid]
        assert m["items"] == 1 and m.get("prefix_hits", 0) == (res.prefix_tokens > 0), m
        assert m.get("prefix_tokens_skipped", 0) == res.prefix_tokens, m
        assert ("prefix_hits" in m) == ("prefix_tokens_skipped" in m) == (res.prefix_tokens > 0)
    assert sorted(r.prefix_tokens for r in items.values()) == [0, s["prefix_tokens_skipped"]]
    assert sum(m.get("prefix_hits", 0) for m in summaries.values()) == s["prefix_hits"]
    # The stored result spells prefix_tokens out only on a hit (0 is its default).
    stored = [json.loads(redis.hget(Keys().job_items(jid), "0") or b"{}") for jid in items]
    assert sorted(m.get("prefix_tokens", 0) for m in stored) == \
        [0, s["prefix_tokens_skipped"]]
    assert sum("prefix_tokens" in m for m in stored) == s["prefix_hits"]
