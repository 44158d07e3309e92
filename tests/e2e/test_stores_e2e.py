"""Inputs by reference through a real worker: a shared folder and a real S3 API (moto's
standalone server on 127.0.0.1), references that try to leave their store, a file changed
after enqueue, and a schedule running incrementally over an S3 prefix.

One worker serves the module (its start is the slow part); it has two stores, a folder
and an S3 prefix, and its S3 settings come from the standard AWS environment only.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.moto_s3 import moto_s3, store_worker
from vlmq.producer.client import Client
from vlmq.producer.inputs import prepare
from vlmq.producer.ops.schedules import Schedule, ScheduleStore
from vlmq.producer.options import JobOptions
from vlmq.shared.enqueue import enqueue_lua
from vlmq.stores.backends import FolderStore, S3Store, Stores

pytestmark = pytest.mark.slow

BUCKET = "vlmq-test"
SECRET = "s3cr3t-never-printed-7f3a"
FAST = {"max_tokens": 4, "result_cache": "off"}


@dataclass
class World:
    redis_url: str
    folder: Path  # the folder store "shared"
    outside: Path  # beside it, never to be read
    endpoint: str
    aws_env: dict[str, str]
    s3: Any  # a boto3 client for this test's own puts
    worker: subprocess.Popen[str]

    def stores(self) -> Stores:
        return Stores([FolderStore("shared", self.folder),
                       S3Store("scans", BUCKET, "scans", client=self.s3)])


@pytest.fixture(scope="module")
def world(module_redis_url: str, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("stores")
    procs: list[subprocess.Popen[str]] = []
    with moto_s3(BUCKET, SECRET) as s3:
        try:
            folder, outside = tmp / "shared", tmp / "outside"
            folder.mkdir()
            outside.mkdir()
            procs.append(store_worker(
                s3, module_redis_url, tiny_model, tmp, name="wstores", queues="caption,ocr",
                stores=f"shared=file://{folder},scans=s3://{BUCKET}/scans"))
            yield World(module_redis_url, folder, outside, s3.endpoint, s3.aws_env,
                        s3.client, procs[0])
        finally:
            helpers.stop_all(procs)


_results = helpers.finished_results


def _blob_keys(redis_url: str) -> set[bytes]:
    with Redis.from_url(redis_url) as r:
        return set(r.scan_iter("vlmq:blob:*"))


def test_shared_folder_references_give_the_same_results_without_blobs(world: World) -> None:
    sub = world.folder / "set1"
    helpers.make_images(sub, 3)
    helpers.make_pdf(sub / "doc.pdf", 3)
    with Client(world.redis_url, stores=world.stores()) as client:
        by_ref = client.ocr([sub], recursive=True, **FAST)
        refs = _results(client, by_ref.id)
        assert not _blob_keys(world.redis_url)  # nothing of the inputs went into Redis
    assert by_ref.uploaded == 0 and len(refs) == 6 and all(r.ok and r.text for r in refs)
    assert [(r.source, r.page) for r in refs] == [
        ("doc.pdf", 1), ("doc.pdf", 2), ("doc.pdf", 3), ("img0.png", None),
        ("img1.png", None), ("img2.png", None)]
    with Client(world.redis_url, stores=Stores()) as client:  # the same bytes, uploaded
        uploaded = client.ocr([sub], recursive=True, **FAST)
        ups = _results(client, uploaded.id)
    assert uploaded.uploaded == 4
    assert [r.text for r in ups] == [r.text for r in refs]
    # The vision cache keys on content: the uploaded copies hit the referenced ones' entries.
    assert all(r.vision_cache_hit for r in ups)


def test_references_that_leave_the_store_fail_alone_and_open_nothing(world: World) -> None:
    fifo = world.outside / "trap.pdf"
    os.mkfifo(fifo)  # opening it to read would block: a worker that tried would hang
    (world.folder / "trap-link.pdf").symlink_to(fifo)
    (world.folder / "gone-link.png").symlink_to(world.outside / "nothing-here.png")
    good = helpers.make_images(world.folder / "ok", 1)[0]
    with Client(world.redis_url, stores=world.stores()) as client:
        item = prepare([good], stores=world.stores()).items[0]
        ok = item.to_dict()

        def leaving(path: str, kind: str = "pdf", store: str = "shared") -> dict[str, Any]:
            out = {**ok, "kind": kind, "ref": {"store": store, "path": path}, "source": path}
            return {**out, "page": 1} if kind == "pdf" else out

        # Through enqueue.lua, as another language would send them.
        lua_id = enqueue_lua(client.redis, {"v": 1, "task": "caption", "items": [
            leaving("trap-link.pdf"), leaving("gone-link.png", "image"),
            leaving("ok/img0.png", "image", store="nosuch"), ok]}, queue="caption")
        # Straight into Redis, past every producer-side check.
        raw_id = helpers.raw_enqueue(client.redis, {"v": 1, "task": "caption", "items": [
            leaving("../outside/trap.pdf"), leaving(str(fifo)),
            leaving("ok/../../outside/trap.pdf"), ok]}, queue="caption")
        lua_results = _results(client, lua_id)
        raw_results = _results(client, raw_id)
    assert [r.error is None for r in lua_results] == [False, False, False, True]
    # One answer for a link out, a missing file, a FIFO: no map of the store.
    assert "trap-link.pdf: the referenced file is missing or unreadable" \
        in str(lua_results[0].error)
    assert "gone-link.png: the referenced file is missing or unreadable" \
        in str(lua_results[1].error)
    assert "unknown store 'nosuch'" in str(lua_results[2].error)
    assert [r.error is None for r in raw_results] == [False, False, False, True]
    assert "'..' segment" in str(raw_results[0].error)
    assert "is absolute" in str(raw_results[1].error)
    assert "'..' segment" in str(raw_results[2].error)
    # Nobody has the FIFO open for reading: opening its write end without blocking fails.
    with pytest.raises(OSError) as exc:
        os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    assert exc.value.errno == errno.ENXIO


def test_a_file_changed_after_enqueue_fails_with_a_clear_message(world: World) -> None:
    folder = world.folder / "changing"
    # Sizes no other test uses: a vision-cache hit on the old content would read nothing.
    img, other = helpers.make_images(folder, 2, sizes=[(104, 136)])
    stores = world.stores()
    prepared = prepare([folder], stores=stores)
    other.write_bytes(img.read_bytes())  # edited after it was checked and hashed
    with Client(world.redis_url, stores=stores) as client:
        job = client.submit("caption", prepared, JobOptions.build(**FAST))
        results = _results(client, job.id)
    assert results[0].ok
    assert results[1].error is not None
    assert "shared:changing/img1.png changed since it was enqueued (its size or sha256 " \
        "differs)" in results[1].error


def _put(world: World, key: str, body: bytes) -> None:
    world.s3.put_object(Bucket=BUCKET, Key=key, Body=body)


def test_s3_references_are_read_by_the_worker(world: World, tmp_path: Path) -> None:
    helpers.make_pdf(tmp_path / "scan.pdf", 2)
    helpers.make_images(tmp_path, 2)
    _put(world, "scans/batch1/scan.pdf", (tmp_path / "scan.pdf").read_bytes())
    for i in range(2):
        _put(world, f"scans/batch1/img{i}.png", (tmp_path / f"img{i}.png").read_bytes())
    _put(world, "elsewhere/not-in-the-store.png", (tmp_path / "img0.png").read_bytes())
    blobs_before = _blob_keys(world.redis_url)  # earlier tests' uploads
    env = {**os.environ, **world.aws_env}
    out = subprocess.run(
        [helpers.VLMQ, "--redis-url", world.redis_url, "enqueue", "ocr", "--json",
         f"s3://{BUCKET}/scans/batch1/", "--recursive", "--max-tokens", "4",
         "--store", f"scans=s3://{BUCKET}/scans"],
        env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    with Client(world.redis_url) as client:
        job = client.job(json.loads(out.stdout)["id"])
        results = _results(client, job.id)
        assert job.payload().items[0].ref is not None
        assert [(r.source, r.page, r.ok) for r in results] == [
            ("img0.png", None, True), ("img1.png", None, True), ("scan.pdf", 1, True),
            ("scan.pdf", 2, True)]
        assert _blob_keys(world.redis_url) == blobs_before
        # A missing object fails its item only, and no error carries the secret.
        bad = enqueue_lua(client.redis, {"v": 1, "task": "caption", "items": [
            {**job.payload().items[0].to_dict(), "sha256": "cd" * 32,  # nothing caches it
             "ref": {"store": "scans", "path": "batch1/missing.png"}}]}, queue="caption")
        missing = _results(client, bad)
    assert "missing or unreadable in store scans" in str(missing[0].error)
    outside = subprocess.run(
        [helpers.VLMQ, "--redis-url", world.redis_url, "enqueue", "caption",
         f"s3://{BUCKET}/elsewhere/not-in-the-store.png", "--store",
         f"scans=s3://{BUCKET}/scans"], env=env, capture_output=True, text=True,
        timeout=60, check=False)
    assert outside.returncode == 2 and "is in no configured store" in outside.stderr
    for text in (out.stdout + out.stderr, outside.stderr, str(missing[0].error)):
        assert SECRET not in text
    with Redis.from_url(world.redis_url) as r:
        assert not any(SECRET.encode() in (r.hget(k, "data") or b"")
                       for k in r.scan_iter("rq:job:*"))


def test_a_schedule_runs_incrementally_over_an_s3_prefix(world: World, tmp_path: Path) -> None:
    helpers.make_images(tmp_path, 3)
    for i in range(2):
        _put(world, f"scans/nightly/img{i}.png", (tmp_path / f"img{i}.png").read_bytes())
    blobs_before = _blob_keys(world.redis_url)
    with Client(world.redis_url, stores=world.stores()) as client:
        store = ScheduleStore(client)
        store.add(Schedule(name="s3nightly", task="caption",
                           paths=(f"s3://{BUCKET}/scans/nightly/",), every=3600,
                           recursive=True, settings={"max_tokens": 4}))
        first = store.run("s3nightly")
        assert (first["items"], first["read"], first["files"]) == (2, 2, 2), first
        assert all(r.ok for r in _results(client, first["job_id"]))
        store.finish_pending("s3nightly")
        again = store.run("s3nightly")  # nothing changed: nothing read (size and ETag)
        assert (again["items"], again["read"], again["skipped"]) == (0, 0, 2), again
        _put(world, "scans/nightly/img1.png", (tmp_path / "img2.png").read_bytes())
        _put(world, "scans/nightly/img9.png", (tmp_path / "img2.png").read_bytes())
        third = store.run("s3nightly")
        assert (third["items"], third["read"]) == (2, 2), third
        items = client.job(third["job_id"]).payload().items
        assert sorted(str(i.ref) for i in items) == ["scans:nightly/img1.png",
                                                     "scans:nightly/img9.png"]
        assert all(r.ok for r in _results(client, third["job_id"]))
    assert _blob_keys(world.redis_url) == blobs_before
