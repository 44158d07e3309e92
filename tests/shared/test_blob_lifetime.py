"""A blob's life follows the jobs that use it: held while one lives, a short grace after
the last ends, a failed job's record long; an upload that never became a job goes soon.

Jobs end through the real worker lifecycle (helpers.worker_lifecycle), `vlmq cancel`'s and
`vlmq delete`'s code and enqueue.lua; the out-of-memory case runs its own redis-server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import Result
from redis import Redis
from redis.exceptions import OutOfMemoryError

from tests.support.helpers import make_images, worker_lifecycle
from vlmq.producer.client import Client
from vlmq.producer.inputs import prepare
from vlmq.shared import constants as C
from vlmq.shared import settings as S
from vlmq.shared.blobs import UPLOAD_TTL_S
from vlmq.shared.enqueue import enqueue_lua, lua_script
from vlmq.shared.keys import Keys
from vlmq.worker.redis_server import start_private

KEYS = Keys()
BLOB_TTL = 5000
KEEP = 40


@pytest.fixture
def client(redis_url: str) -> Iterator[Client]:
    with Client(redis_url) as c:
        yield c


def _images(tmp_path: Path, n: int = 2) -> Path:
    make_images(tmp_path / "in", n)
    return tmp_path / "in"


def _ttls(redis: Redis, shas: set[str]) -> list[int]:
    return [int(redis.ttl(KEYS.blob(sha))) for sha in sorted(shas)]


def _shas(job_blobs: object) -> set[str]:
    return {i.blob for i in job_blobs.payload().items if i.blob}  # type: ignore[attr-defined]


def test_a_job_holds_its_blobs_and_finishing_drops_them_to_the_grace(
        client: Client, redis: Redis, tmp_path: Path) -> None:
    job = client.caption([_images(tmp_path)], blob_ttl=BLOB_TTL, keep_inputs=KEEP)
    shas = _shas(job)
    assert all(BLOB_TTL - 5 < t <= BLOB_TTL for t in _ttls(redis, shas))
    for sha in shas:
        assert redis.zscore(KEYS.blob_jobs(sha), job.id) == float("inf")
    assert {k.decode() for k in redis.hkeys(KEYS.job_inputs(job.id))} == shas
    with worker_lifecycle(redis, ["caption"]) as life:
        running = life.take()
        assert running is not None and not isinstance(running, str)
        assert life.succeed(running, {"items": 2, "ok": 2, "failed": 0}) is None  # type: ignore[arg-type]
    assert job.status() == "finished"
    assert all(KEEP - 5 < t <= KEEP for t in _ttls(redis, shas))
    assert not redis.exists(KEYS.job_inputs(job.id))
    assert all(redis.zcard(KEYS.blob_jobs(sha)) == 0 for sha in shas)


def test_a_blob_another_live_job_uses_is_never_shortened(
        client: Client, redis: Redis, tmp_path: Path) -> None:
    folder = _images(tmp_path)
    first = client.caption([folder], blob_ttl=BLOB_TTL, keep_inputs=KEEP)
    second = client.caption([folder], blob_ttl=BLOB_TTL, keep_inputs=KEEP)
    shas = _shas(first)
    assert second.uploaded == 0
    first.cancel()
    assert all(t > BLOB_TTL - 5 for t in _ttls(redis, shas)), "the second job still uses them"
    second.cancel()
    assert all(KEEP - 5 < t <= KEEP for t in _ttls(redis, shas))


def test_a_failed_job_keeps_its_inputs_as_long_as_its_failure_record(
        client: Client, redis: Redis, tmp_path: Path) -> None:
    job = client.caption([_images(tmp_path)], blob_ttl=BLOB_TTL, keep_inputs=KEEP)
    shas = _shas(job)
    with worker_lifecycle(redis, ["caption"]) as life:
        running = life.take()
        assert running is not None and not isinstance(running, str)
        assert life.fail(running, "1 of 2 items failed") is None  # type: ignore[arg-type]
    assert job.status() == "failed"
    record = int(redis.ttl(Keys.rq_job(job.id)))
    assert record > C.FAILURE_TTL_S - 60
    assert all(abs(t - record) < 5 for t in _ttls(redis, shas))
    again = job.retry(failed_only=True)  # reads the failed job's inputs from Redis
    again.cancel()
    assert all(abs(t - record) < 5 for t in _ttls(redis, shas)), "the failure record holds"
    client.delete([job.id])
    assert all(KEEP - 5 < t <= KEEP for t in _ttls(redis, shas))


def test_deleting_a_queued_job_drops_its_blobs_to_the_grace(
        client: Client, redis: Redis, tmp_path: Path) -> None:
    job = client.caption([_images(tmp_path)], blob_ttl=BLOB_TTL, keep_inputs=KEEP)
    shas = _shas(job)
    client.delete([job.id])
    assert all(KEEP - 5 < t <= KEEP for t in _ttls(redis, shas))
    assert not redis.exists(KEYS.job_inputs(job.id))


def test_enqueue_lua_holds_blobs_like_a_python_producer(
        client: Client, redis: Redis, tmp_path: Path) -> None:
    prepared = prepare([_images(tmp_path, 1)])
    client.uploads.upload(list(prepared.blobs.values()))
    sha = next(iter(prepared.blobs))
    assert 0 < int(redis.ttl(KEYS.blob(sha))) <= UPLOAD_TTL_S  # no job holds it yet
    payload = {"v": 1, "task": "caption", "items": [{"kind": "image", "blob": sha}],
               "keep_inputs": KEEP}
    job_id = enqueue_lua(redis, payload, queue="caption", keys=KEYS)
    assert int(redis.ttl(KEYS.blob(sha))) > C.BLOB_TTL_S - 60
    assert redis.hget(KEYS.job_inputs(job_id), sha) == str(KEEP).encode()
    client.cancel(job_id)
    assert KEEP - 5 < int(redis.ttl(KEYS.blob(sha))) <= KEEP


def test_enqueue_lua_defaults_match_the_settings_table() -> None:
    """enqueue.lua holds blobs with the defaults of its generated settings rows (no copy
    of its own); those rows are the table's."""
    script = lua_script()
    for name in ("blob_ttl", "keep_inputs"):
        assert f"given('{name}')" in script
        assert f"default = {S.BY_NAME[name].default}}}" in script


@pytest.fixture
def small_redis() -> Iterator[str]:
    """A redis-server of its own with 3 MB of maxmemory, refusing writes past it."""
    try:
        server = start_private()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    try:
        conn = Redis.from_url(server.url)
        conn.config_set("maxmemory", "3mb")
        conn.config_set("maxmemory-policy", "noeviction")
        conn.close()
        yield server.url
    finally:
        server.stop()


def test_an_upload_that_runs_out_of_memory_leaves_only_short_lived_blobs(
        small_redis: str, tmp_path: Path) -> None:
    folder = tmp_path / "big"
    folder.mkdir()
    for i in range(12):  # 12 x 400 KB of incompressible bytes: far past 3 MB
        (folder / f"noise{i}.png").write_bytes(_noise_png(i))
    redis = Redis.from_url(small_redis)
    with Client(small_redis) as client, pytest.raises(OutOfMemoryError,
                                                      match="expires within 10 minutes"):
        client.caption([folder])
    blobs = [k for k in redis.scan_iter(match="vlmq:blob:*")]
    assert blobs, "some uploads got in before Redis was full"
    assert all(0 < int(redis.ttl(k)) <= UPLOAD_TTL_S for k in blobs)
    assert not list(redis.scan_iter(match="rq:job:*"))


def _noise_png(seed: int) -> bytes:
    import io
    import random

    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (370, 370), rng.randbytes(370 * 370 * 3))
    buf = io.BytesIO()
    img.save(buf, "PNG", compress_level=0)
    return buf.getvalue()


def test_status_says_how_long_inputs_and_results_are_kept(
        client: Client, tmp_path: Path, run_cli: Callable[..., Result]) -> None:
    job = client.caption([_images(tmp_path)], keep_inputs=KEEP, result_ttl=7200)
    out = run_cli("status", job.id, code=0).stdout
    assert ("kept: results 2 h after the job ends (30 d if it fails); inputs while the job "
            "is queued or "
            "running, then 40 s") in out
    job.cancel()
    out = run_cli("status", job.id, code=0).stdout
    assert "kept: results 2 h more; inputs 40 s more" in out
    assert "inputs while their jobs run, then 3600 s" in run_cli("status", code=0).stdout
