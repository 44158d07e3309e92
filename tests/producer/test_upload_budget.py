"""The producer's Redis budget (--max-pending-mb): a folder several times the budget goes
through a real worker while Redis holds about the budget; Ctrl-C leaves whole jobs, and the
same command run again finishes the set without generating the pages already done.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result
from PIL import Image
from redis import Redis

from tests.support.helpers import VLMQ, Spawn, wait_for
from vlmq.producer.client import Client
from vlmq.producer.upload import MB
from vlmq.shared.keys import SHA256_RE, Keys

KEYS = Keys()
FILES = 16
SIDE = 160  # 160 x 160 x 3 bytes of noise: a ~77 KB PNG
BUDGET_MB = 0.3  # about 4 files
KEEP_S = 1
JOB_ARGS = ("--job-size", "1", "--keep-inputs", str(KEEP_S), "--max-tokens", "2",
            "--temperature", "0", "--max-pending-mb", str(BUDGET_MB))


def _noise_folder(folder: Path, n: int = FILES) -> int:
    """`n` distinct incompressible PNGs; returns the largest file's size."""
    folder.mkdir(parents=True)
    rng = random.Random(7)
    for i in range(n):
        buf = io.BytesIO()
        Image.frombytes("RGB", (SIDE, SIDE), rng.randbytes(SIDE * SIDE * 3)).save(
            buf, "PNG", compress_level=0)
        (folder / f"noise{i:02d}.png").write_bytes(buf.getvalue())
    return max(p.stat().st_size for p in folder.iterdir())


class _Sampler:
    """Polls the bytes of input blobs in Redis while a run goes on. `held`: blobs not in
    their grace (uploaded, or held by a job not ended), which the budget bounds."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.held_max = self.total_max = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        conn = Redis(connection_pool=self.redis.connection_pool)
        while not self._stop.is_set():
            blobs = [k for k in conn.scan_iter(match="vlmq:blob:*", count=1000)
                     if SHA256_RE.fullmatch(k.decode().rsplit(":", 1)[-1])]
            pipe = conn.pipeline(transaction=False)
            for key in blobs:
                pipe.strlen(key)
                pipe.pttl(key)
            replies = pipe.execute()
            sizes, ttls = replies[0::2], replies[1::2]
            self.total_max = max(self.total_max, sum(sizes))
            self.held_max = max(self.held_max, sum(
                s for s, t in zip(sizes, ttls, strict=True) if t > KEEP_S * 1000))
            time.sleep(0.02)


@pytest.fixture
def worker(redis_url: str, tiny_model: Path, tmp_path: Path, start_worker: Spawn) -> None:
    start_worker(redis_url, tiny_model, tmp_path, "--queues", "caption")
    redis = Redis.from_url(redis_url)
    wait_for(lambda: redis.scard(Keys.rq_queue_workers("caption")) > 0, 300, "the worker")


def _batch_done(redis_url: str, batch_id: str) -> Callable[[], bool]:
    client = Client(redis_url)

    def done() -> bool:
        jobs = client.batch(batch_id).jobs()
        return len(jobs) == FILES and all(j.status() == "finished" for j in jobs)

    return done


def test_a_folder_several_times_the_budget_goes_through_within_it(
        redis_url: str, redis: Redis, tmp_path: Path, worker: None,
        run_cli: Callable[..., Result]) -> None:
    largest = _noise_folder(tmp_path / "in")
    total = sum(p.stat().st_size for p in (tmp_path / "in").iterdir())
    assert total > 3 * BUDGET_MB * MB
    with _Sampler(redis) as sampler:
        res = run_cli("enqueue", "caption", str(tmp_path / "in"), *JOB_ARGS, "--json", code=0)
        batch_id = json.loads(res.stdout)["batch"]
        wait_for(_batch_done(redis_url, batch_id), 300, "the batch")
    assert "waiting for workers" in res.stderr
    assert sampler.held_max <= BUDGET_MB * MB + largest, (sampler.held_max, largest)
    assert sampler.held_max > BUDGET_MB * MB / 2  # it did fill the budget
    results = [r for _, r in Client(redis_url).batch(batch_id).results()]
    assert len(results) == FILES and all(r.ok for r in results)


def test_ctrl_c_leaves_whole_jobs_and_a_rerun_resumes(
        redis_url: str, redis: Redis, tmp_path: Path, worker: None,
        run_cli: Callable[..., Result]) -> None:
    _noise_folder(tmp_path / "in")
    cmd = [VLMQ, "enqueue", "caption", str(tmp_path / "in"), *JOB_ARGS]
    env = {**os.environ, "REDIS_URL": redis_url}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for(lambda: _finished(redis) >= 3, 300, "three finished jobs")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, err
    first = _finished(redis)
    for job_key in redis.scan_iter(match="rq:job:*", _type="HASH"):
        job = Client(redis_url).job(job_key.decode().split(":", 2)[2])
        assert job.items == 1 and job.problem is None  # whole, never half-written
        assert redis.exists(KEYS.blob(job.payload().items[0].blob))
    assert first < FILES, "interrupted before the end"

    res = run_cli("enqueue", "caption", str(tmp_path / "in"), *JOB_ARGS, "--json", code=0)
    batch_id = json.loads(res.stdout)["batch"]
    wait_for(_batch_done(redis_url, batch_id), 300, "the rerun")
    results = [r for _, r in Client(redis_url).batch(batch_id).results()]
    assert len(results) == FILES and all(r.ok for r in results)
    assert sum(r.result_cache_hit for r in results) >= first  # done pages not generated


def _finished(redis: Redis) -> int:
    return sum(redis.zcard(k) for k in redis.scan_iter(match="rq:finished:*"))
