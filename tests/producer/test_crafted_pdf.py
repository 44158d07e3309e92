"""The crafted-PDF attack: one page of millions of drawing operations, on a real worker."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.helpers import make_pdf, wait_for
from tests.support.pdf_craft import drawing_bomb_pdf
from vlmq.producer.client import Client
from vlmq.shared.blobs import BlobStore
from vlmq.shared.enqueue import enqueue
from vlmq.shared.keys import Keys
from vlmq.shared.messages import Item, JobPayload

pytestmark = pytest.mark.slow
RENDER_MB = 256


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def test_drawing_bomb_fails_its_item_and_nothing_else(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        procs: list[subprocess.Popen[str]]) -> None:
    client = Client(redis_url)
    worker = helpers.start_worker(redis_url, tiny_model, tmp_path, "--max-batch", "4",
                                  "--render-mem-mb", str(RENDER_MB), "--render-timeout", "120",
                                  "--prep-threads", "2")
    procs.append(worker)
    wait_for(lambda: redis.exists(Keys().worker_stats("w1")) == 1, 120, "the worker to start")
    rss_ready_kb = _status_kb(worker.pid, "VmHWM")  # model loaded, nothing rendered yet

    bomb = drawing_bomb_pdf(2_000_000)  # ~50 KB compressed; > 600 MB and ~25 s to render
    sha, _ = BlobStore(redis, Keys()).put(bomb)
    bad_id = enqueue(redis, JobPayload(task="ocr", items=(
        Item(kind="pdf", blob=sha, source="bomb.pdf", page=1),),
        settings={"max_side": 112, "max_tokens": 4}), queue="ocr")
    innocent = client.ocr([make_pdf(tmp_path / "ok.pdf", 3)], max_side=112, max_tokens=4)

    bad = client.job(bad_id)
    assert bad.wait(timeout=240), "the bomb job never ended"
    assert innocent.wait(timeout=240), "the innocent job never ended"

    assert innocent.status() == "finished"
    assert innocent.summary()["ok"] == 3
    assert all(r.error is None for r in innocent.results())
    assert bad.status() == "finished"  # one bad item fails the item, not the job
    (item,) = bad.results()
    assert item.error is not None and "too complex to render" in item.error, item.error
    assert f"{RENDER_MB} MB" in item.error

    assert worker.poll() is None, "the worker died"
    peak_kb = _status_kb(worker.pid, "VmHWM")
    assert peak_kb < rss_ready_kb + RENDER_MB * 1024, (rss_ready_kb, peak_kb)
    print(f"worker VmHWM: {rss_ready_kb // 1024} MB when ready, {peak_kb // 1024} MB at the end")
    worker.terminate()
    out, _ = worker.communicate(timeout=300)
    assert out.count("ready: model") == 1, out  # the worker process never restarted
    assert "too complex to render" in out or bad_id in out
