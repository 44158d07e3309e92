"""One input's cost stays its own, through real workers: real Redis, the
Python client, the tiny model, render processes.

- a one-image job behind a job of a 20,000-page TIFF's last 2,000 pages finishes between
  its pages (before: each of those pages cost its prep thread 2-3 s of Pillow's frame walk);
- a 1 GiB referenced file (a small PNG and a sparse tail) costs the worker its image, not
  its size (before: 2.2 GB of peak RSS), and one past this worker's limit for a
  reference fails alone naming it;
- an image past the decode time limit fails alone, naming the limit, and the job behind
  it goes on.

No clock is asserted: benchmarks/input_costs.py measures what these cost.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import helpers
from tests.support.factories import slow_png
from tests.support.tiff_craft import many_pages
from vlmq.producer.client import Client, Job
from vlmq.stores.backends import FolderStore, Stores

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="reads peak RSS from /proc")]

FAST = {"max_tokens": 4, "result_cache": "off"}
REF_MB = 1536  # the worker's render memory, so also its limit for one reference
SIDE = 2048  # images at the default image side: decoded whole, not resized
DECODED = SIDE * SIDE * 3


@dataclass
class Served:
    redis_url: str
    store: Path
    worker: subprocess.Popen[str]

    def client(self) -> Client:
        return Client(self.redis_url, stores=Stores([FolderStore("shared", self.store)]))


@pytest.fixture(scope="module")
def served(module_redis_url: str, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("contain-inputs")
    store = tmp / "store"
    store.mkdir()
    # One prep thread and one render process: what each job waits behind is plain, and
    # the memory figures come from the same thread (malloc arena) and child every time.
    proc = helpers.start_worker(module_redis_url, tiny_model, tmp, "--store",
                                f"shared={store}", "--render-mem-mb", str(REF_MB),
                                "--render-procs", "1", "--prep-threads", "1",
                                "--queues", "caption,ocr", name="wcontain")
    try:
        yield Served(module_redis_url, store, proc)
    finally:
        helpers.stop_all([proc])


def _finished(job: Job, timeout: float = 300) -> None:
    """Once the job finished (its error fails the test)."""
    assert job.wait(timeout=timeout) == "finished", job.error()


def _hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def _children(pid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError):
            continue  # gone meanwhile
    return out


def _sparse(path: Path, image_index: int, tail: int) -> Path:
    helpers.page_image(image_index, (SIDE, SIDE)).save(path)
    os.truncate(path, path.stat().st_size + tail)
    if path.stat().st_blocks * 512 > 64 << 20:
        pytest.skip("this file system does not keep sparse files sparse")
    return path


def test_a_gigabyte_reference_costs_the_worker_its_image_not_its_size(served: Served) -> None:
    for i in range(2):  # the same work on other pixels first: imports, tower, child, arena
        helpers.page_image(i, (SIDE, SIDE)).save(served.store / f"warm{i}.png")
    sparse = _sparse(served.store / "sparse.png", 2, 1 << 30)
    with served.client() as client:
        for i in range(2):
            _finished(client.caption([served.store / f"warm{i}.png"], **FAST))
        pids = [served.worker.pid, *_children(served.worker.pid)]
        assert len(pids) == 2  # the worker and its one render process
        before = [_hwm(p) for p in pids]
        job = client.caption([sparse], **FAST)
        assert job.uploaded == 0  # by reference: nothing of it went to Redis
        _finished(job)
        [result] = list(job.results())
        after = [_hwm(p) for p in pids]  # the same child: none was replaced
    assert result.ok, result.error
    growth = [a - b for a, b in zip(after, before, strict=True)]
    # Before: the worker's peak grew by 2.1 GB (the file's chunks, then their join).
    assert max(growth) < 2 * DECODED, (growth, DECODED)


def test_a_reference_past_the_workers_limit_fails_alone_naming_it(served: Served) -> None:
    big = _sparse(served.store / "huge.png", 3, REF_MB << 20)
    good = served.store / "fine.png"
    helpers.page_image(4, (96, 96)).save(good)
    with served.client() as client:
        job = client.caption([big, good], **FAST)
        _finished(job)
        results = sorted(job.results(), key=lambda r: r.index)
    assert results[1].ok
    error = results[0].error or ""
    assert f"over the {REF_MB} MiB ({REF_MB << 20}-byte) limit for a referenced input on " \
           "this worker" in error and "--render-mem-mb" in error, error


def test_a_one_image_job_behind_a_deep_tiff_job_finishes_at_once(served: Served,
                                                                 tmp_path: Path) -> None:
    fax = tmp_path / "deep.tif"
    # 32 px pages: the vision processor refuses under 28 px, and a refused page is quick.
    fax.write_bytes(many_pages(20_000, size=(32, 32)))
    photos = helpers.make_images(tmp_path / "photos", 2, [(96, 96)])
    with Client(served.redis_url) as client:
        _finished(client.caption([photos[0]], **FAST))
        tiff_job = client.ocr([fax], pages="18001-20000", **FAST)
        helpers.wait_for(lambda: any(True for _ in tiff_job.results()), 300,
                         "the TIFF job's first page")
        _finished(client.caption([photos[1]], **FAST))
        # It went in between the TIFF job's pages, not after them. (What a deep page costs
        # is compared in tests/media/test_tiff_index.py and benchmarks/input_costs.py.)
        assert tiff_job.status() != "finished"
        _finished(tiff_job, timeout=600)
        pages = sorted(tiff_job.results(), key=lambda r: r.index)
    assert [r.page for r in pages] == list(range(18001, 20001))
    assert all(r.ok for r in pages), next(r.error for r in pages if not r.ok)


@pytest.fixture(scope="module")
def strict(module_redis_url: str, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A worker with a 0.3 s decode time limit and one prep thread."""
    tmp = tmp_path_factory.mktemp("contain-strict")
    proc = helpers.start_worker(module_redis_url, tiny_model, tmp, "--render-timeout", "0.3",
                                "--prep-threads", "1", "--queues", "strict",
                                name="wstrict")
    try:
        yield module_redis_url
    finally:
        helpers.stop_all([proc])


def test_an_image_past_the_decode_time_limit_fails_alone(strict: str, tmp_path: Path) -> None:
    slow = []
    for i in range(2):
        slow.append(tmp_path / f"slow{i}.png")
        slow[-1].write_bytes(slow_png(seed=i))
    photos = helpers.make_images(tmp_path / "photos", 2, [(96, 96)])
    with Client(strict) as client:
        _finished(client.caption([photos[0]], queue="strict", **FAST))
        heavy = client.caption([*slow, photos[1]], queue="strict", **FAST)
        helpers.wait_for(lambda: heavy.status() == "started", 300, "the heavy job to start")
        _finished(client.caption([photos[1]], queue="strict", **FAST))  # not stuck behind
        _finished(heavy)
        results = sorted(heavy.results(), key=lambda r: r.index)
    assert [r.ok for r in results] == [False, False, True]
    for r in results[:2]:
        assert r.error is not None
        assert "image too complex to decode: over the 0.3 s decode time limit " \
               "(--render-timeout)" in r.error, r.error
