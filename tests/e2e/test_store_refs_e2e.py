"""Hostile references through a real worker, a folder store and a real S3 API
(moto's standalone server on 127.0.0.1):

- refs with a wrong sha, a wrong size, a missing file, a symlink out, a directory, sent
through enqueue.lua, fail with errors that reveal the same about each: nothing.
- an AWS_ENDPOINT_URL with credentials in it never reaches a stored item error.
- no cache (result, vision) answers for a reference before it is verified.
"""

from __future__ import annotations

import hashlib
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
from vlmq.shared.enqueue import enqueue_lua
from vlmq.shared.messages import Item, ItemResult, Ref
from vlmq.stores.backends import changed, unreadable
from vlmq.worker.redis_server import free_port

pytestmark = pytest.mark.slow

BUCKET = "vlmq-trust"
SECRET = "s3cr3t-trust-2b91"
QUEUE = "trust"


@dataclass
class World:
    redis_url: str
    folder: Path  # the folder store "shared"
    outside: Path  # beside it, never to be read
    s3: Any
    tmp: Path
    worker: subprocess.Popen[str]


@pytest.fixture(scope="module")
def world(module_redis_url: str, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("trust")
    procs: list[subprocess.Popen[str]] = []
    with moto_s3(BUCKET, SECRET) as s3:
        try:
            folder, outside = tmp / "shared", tmp / "outside"
            folder.mkdir()
            outside.mkdir()
            procs.append(store_worker(
                s3, module_redis_url, tiny_model, tmp, name="wtrust", queues=QUEUE,
                stores=f"shared=file://{folder},scans=s3://{BUCKET}/scans"))
            yield World(module_redis_url, folder, outside, s3.client, tmp, procs[0])
        finally:
            helpers.stop_all(procs)


def _image(path: Path, size: tuple[int, int]) -> bytes:
    """A fresh image of a size no other test uses (so no cache knows it by chance)."""
    helpers.page_image(7, size).save(path)
    return path.read_bytes()


def _ref(store: str, path: str, data: bytes, *, sha: str | None = None,
         size: int | None = None) -> dict[str, Any]:
    return Item(kind="image", blob=None, source=Path(path).name, ref=Ref(store, path),
                size=len(data) if size is None else size,
                ref_sha256=sha or hashlib.sha256(data).hexdigest()).to_dict()


def _run(redis_url: str, items: list[dict[str, Any]], queue: str = QUEUE,
         **settings: Any) -> list[ItemResult]:
    with Client(redis_url) as client:
        job_id = enqueue_lua(client.redis, {"v": 1, "task": "caption", "items": items,
                                            "generation": {"max_tokens": 4}, **settings},
                             queue=queue)
        return helpers.finished_results(client, job_id)


def test_failed_references_reveal_the_same_whatever_is_wrong(world: World) -> None:
    data = _image(world.folder / "real.png", (111, 143))
    real = hashlib.sha256(data).hexdigest()
    (world.outside / "secret.png").write_bytes(data)
    (world.folder / "out-link.png").symlink_to(world.outside / "secret.png")
    (world.folder / "a-dir.png").mkdir()
    cases = {
        "sha": _ref("shared", "real.png", data, sha="ab" * 32),
        "size": _ref("shared", "real.png", data, size=len(data) + 1),
        "missing": _ref("shared", "nope.png", data, sha="cd" * 32),
        "symlink": _ref("shared", "out-link.png", data, sha="cd" * 32),
        "directory": _ref("shared", "a-dir.png", data, sha="cd" * 32),
        "escaped": _ref("shared", "%2e%2e/outside/secret.png", data, sha="cd" * 32)}
    results = _run(world.redis_url, list(cases.values()), result_cache=False)
    said = {}
    for (why, raw), res in zip(cases.items(), results, strict=True):
        assert res.error is not None and res.text is None, why
        for leak in (real[:8], str(len(data)), str(len(data) + 1), str(world.folder),
                     "symlink", "no such", "directory", "regular"):
            assert leak not in res.error, (why, leak, res.error)
        said[why] = res.error.replace(raw["ref"]["path"], "P")
    assert said["sha"] == said["size"] == changed(Ref("shared", "P"))
    assert said["missing"] == said["symlink"] == said["directory"] == said["escaped"] \
        == unreadable(Ref("shared", "P"))


def test_a_missing_reference_is_not_answered_from_the_result_cache(world: World) -> None:
    data = _image(world.tmp / "cached.png", (113, 149))
    with Client(world.redis_url) as client:  # the same bytes uploaded: their text is cached
        job = client.caption([world.tmp / "cached.png"], queue=QUEUE, max_tokens=4)
        first = helpers.finished_results(client, job.id)
    assert first[0].ok
    (world.folder / "cached-dir.png").mkdir()
    (world.folder / "here.png").write_bytes(data)
    results = _run(world.redis_url, [
        _ref("shared", "%2e%2e/outside/secret.png", data),
        _ref("shared", "cached-dir.png", data),
        _ref("shared", "here.png", data)])  # present and verified: the cache may answer
    assert [r.result_cache_hit for r in results] == [False, False, True]
    assert results[0].error == unreadable(Ref("shared", "%2e%2e/outside/secret.png"))
    assert results[1].error == unreadable(Ref("shared", "cached-dir.png"))
    assert results[2].text == first[0].text


def test_an_s3_object_replaced_after_enqueue_is_not_answered_from_a_cache(
        world: World) -> None:
    old = _image(world.tmp / "old.png", (117, 151))
    new = _image(world.tmp / "new.png", (119, 153))
    world.s3.put_object(Bucket=BUCKET, Key="scans/trust/v.png", Body=old)
    item = _ref("scans", "trust/v.png", old)
    for settings in ({"result_cache": False}, {}):  # the vision cache, then both caches
        warm = _run(world.redis_url, [item], **settings)
        assert warm[0].ok, warm[0].error
    again = _run(world.redis_url, [item], result_cache=False)
    assert again[0].ok and again[0].vision_cache_hit  # verified: the cache answers
    world.s3.put_object(Bucket=BUCKET, Key="scans/trust/v.png", Body=new)
    for settings in ({"result_cache": False}, {}):
        replaced = _run(world.redis_url, [item], **settings)
        assert replaced[0].error == changed(Ref("scans", "trust/v.png"))
        assert not replaced[0].vision_cache_hit and not replaced[0].result_cache_hit


def test_credentials_in_the_endpoint_url_never_reach_an_item_error(world: World,
                                                                   tiny_model: Path) -> None:
    dead = free_port()
    env = {**os.environ, "REDIS_URL": world.redis_url, "PYTHONUNBUFFERED": "1",
           "AWS_ENDPOINT_URL": f"http://AKIAUSER:{SECRET}@127.0.0.1:{dead}/",
           "AWS_ACCESS_KEY_ID": "AKIAUSER", "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1",
           "VLMQ_STORES": f"scans=s3://{BUCKET}/scans"}
    data = b"not read"
    with Client(world.redis_url) as client:
        job_id = enqueue_lua(client.redis, {
            "v": 1, "task": "caption", "generation": {"max_tokens": 4}, "result_cache": False,
            "items": [_ref("scans", "trust/any.png", data)]}, queue="trust10")
    proc = subprocess.Popen(
        [helpers.VLMQ, "worker", "--model", str(tiny_model), "--name", "wtrust10",
         "--cache-dir", str(world.tmp / "vision-cache-10"), "--queues", "trust10", "--burst"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        code, out = helpers.finish(proc, timeout=300)
    finally:
        helpers.stop_all([proc])
    assert code == 0, out
    with Client(world.redis_url) as client:
        results = helpers.finished_results(client, job_id)
    assert results[0].error == unreadable(Ref("scans", "trust/any.png"))
    assert SECRET not in out and "AKIAUSER:" not in out
    with Redis.from_url(world.redis_url) as r:
        for key in r.scan_iter("vlmq:job:*"):
            if r.type(key) == b"hash":
                assert not any(SECRET.encode() in v for v in r.hvals(key))
