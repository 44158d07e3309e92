"""Prefix reuse through a real `vlmq worker` and Redis: two jobs with the same image in one
window prefill its prefix once, and --prefix-cache-mb 0 turns reuse off. Counts tokens."""

from __future__ import annotations

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
