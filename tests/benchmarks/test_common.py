"""benchmarks/common.py reads what a finished job keeps: its end event and its items,
never its event stream, which expires a minute after the job's end."""

from __future__ import annotations

from pathlib import Path

from benchmarks import common
from tests.support.helpers import Spawn, finish, make_images
from vlmq.producer.client import Client
from vlmq.shared.results import read_end


def test_a_job_read_after_its_stream_expired(redis_url: str, tiny_model: Path,
                                             tmp_path: Path, start_worker: Spawn) -> None:
    client = Client(redis_url)
    job = client.caption(make_images(tmp_path / "in", 2), max_tokens=4)
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst"))
    assert rc == 0, out
    end = read_end(client.redis, client.keys, job.id)
    assert end is not None and end["type"] == "finished"
    ended_ms = int(end["id"].split("-")[0])
    assert client.redis.delete(client.keys.job_events(job.id)) == 1  # what expiry leaves
    run = common.job_run(redis_url, job.id)
    assert (run.items, run.ok) == (2, 2) and run.tokens > 0
    assert run.last_item_at == ended_ms / 1000
    client.close()
