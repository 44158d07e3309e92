"""A Redis db holding vlmq jobs in every state, left as the real worker lifecycle leaves
them: finished, failed, queued, and one running on a busy worker. For the dashboard tests
(vlmq's own and rq-dashboard's)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from redis import Redis

from tests.support.helpers import make_images, pdf_bytes, worker_lifecycle
from tests.support.lua_calls import write_items
from vlmq.producer import Client, JobOptions
from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult
from vlmq.worker.jobs.rq_jobs import JobLifecycle, Running

# Page texts as a model might write them; page 3's is hostile.
PAGE_TEXTS = ["# Invoice 4711\n\nTotal: **42.00 EUR**",
              "| item | qty |\n|---|---|\n| bolts | 12 |\n\nSigned: Ada Lovelace",
              "<script>alert('x')</script> [click](javascript:alert(1)) ![t](http://evil/x.png)"]
CAPTIONS = ["a red square on white", None]


@dataclass(frozen=True)
class Dataset:
    finished: str  # OCR of a 3-page PDF, all pages done
    failed: str  # captions: one item ok, one failed, job failed
    running: str  # OCR, one of 3 pages done, held by the busy worker
    queued: str  # nobody took it
    life: JobLifecycle
    held: Running


def result(index: int, source: str, page: int | None, text: str | None,
           error: str | None = None, hit: bool = False) -> ItemResult:
    return ItemResult(index=index, source=source, page=page, text=text,
                      finish_reason=None if error else "stop", prompt_tokens=100 + index,
                      completion_tokens=0 if error else 20 + index, vision_cache_hit=hit,
                      error=error)


def _take(life: JobLifecycle, job_id: str) -> Running:
    running = life.take()
    assert isinstance(running, Running) and running.job_id == job_id, running
    return running


@contextmanager
def dataset(redis_url: str, redis: Redis, tmp_path: Path) -> Iterator[Dataset]:
    client = Client(redis_url)
    keys = Keys()
    pdf = tmp_path / "invoice.pdf"
    pdf.write_bytes(pdf_bytes(3))
    images = make_images(tmp_path / "imgs", 2)
    opts = JobOptions(queue="ocr", labels={"batch": "nov"})
    with worker_lifecycle(redis, ["ocr"]) as life:
        done = client.submit("ocr", [pdf], opts)
        running = _take(life, done.id)
        for i, text in enumerate(PAGE_TEXTS):
            write_items(redis, keys, done.id, result(i, "invoice.pdf", i + 1, text, hit=i == 0))
        life.succeed(running, {"items": 3, "ok": 3, "failed": 0})

        bad = client.submit("caption", images, opts.with_(labels={"batch": "dec"}))
        running = _take(life, bad.id)
        write_items(redis, keys, bad.id, result(0, images[0].name, None, CAPTIONS[0]))
        write_items(redis, keys, bad.id, result(1, images[1].name, None, None,
                                               error="image: cannot decode"))
        life.fail(running, "1 of 2 items failed")

        busy = client.submit("ocr", [pdf], opts)
        held = _take(life, busy.id)
        write_items(redis, keys, busy.id, result(0, "invoice.pdf", 1, PAGE_TEXTS[0]))
        stats = Keys().worker_stats(life.worker.name)
        redis.hset(stats, mapping={"model": "tiny", "tokens_per_s": "12.5",
                                   "items_per_s": "0.8", "batch_active": "1",
                                   "batch_occupancy": "0.125", "cache_hit_rate": "0.5",
                                   "blas": "openblas", "uptime_s": "42.0"})
        redis.sadd(keys.workers, life.worker.name)

        queued = client.submit("ocr", [pdf], opts.with_(queue="later"))
        yield Dataset(finished=done.id, failed=bad.id, running=busy.id, queued=queued.id,
                      life=life, held=held)


def png_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as im:
        return im.size
