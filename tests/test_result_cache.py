"""The shared result cache: real Redis, a real worker process, the real tiny model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from redis import Redis

from vlmq.producer.client import Client
from vlmq.producer.options import JobOptions
from vlmq.shared.errors import PayloadError
from vlmq.shared.keys import Keys
from vlmq.shared.schema import parse_payload
from vlmq.worker.result_cache import ResultCache

from . import helpers
from .helpers import finish, make_images


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


def test_entries_expire_and_stay_under_the_byte_budget(redis: Redis) -> None:
    keys = Keys()
    cache = ResultCache(redis, keys, "m@f", ttl_s=3600, max_bytes=600)
    for i in range(6):
        assert cache.store(f"{i:064x}", "x" * 100, "stop")
    assert not cache.store(f"{5:064x}", "other", "stop")  # already there: kept as it was
    total = int(redis.get(keys.result_cache_bytes) or 0)
    assert 0 < total <= 600
    found = cache.lookup([f"{i:064x}" for i in range(6)])
    # The oldest went first; the newest are still there, text intact.
    assert found[0] is None and found[-1] is not None and found[-1].text == "x" * 100
    assert sum(1 for f in found if f is not None) == redis.zcard(keys.result_cache_index)
    assert 0 < redis.ttl(keys.result_cache(f"{5:064x}")) <= 3600
    assert not cache.store("f" * 64, "y" * 1000, "stop")  # bigger than the whole budget
