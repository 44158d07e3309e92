"""Clock skew: expiry and takeover follow Redis's clock, not a worker's.

A worker whose clock runs 300 s ahead (libfaketime) beside a normal one: before the fix its
registry maintenance saw the normal worker's live job as expired and requeued it ("dropped
(taken over by ...)", a retry spent); and its own heartbeats scored its jobs 300 s into the
future, so when it was killed nobody took them over for five minutes. Now neither happens.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from redis import Redis

from tests.support.helpers import VLMQ, finish, make_pdf, wait_for
from vlmq.producer.client import Client, Job
from vlmq.shared.keys import Keys

pytestmark = pytest.mark.slow
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
TTL = "6"  # --heartbeat-ttl: maintenance every 10 s


def _spawn(procs: list[subprocess.Popen[str]], redis_url: str, model: Path, folder: Path,
           name: str, queues: str, skew: str | None = None) -> subprocess.Popen[str]:
    """A real worker; with `skew`, under libfaketime (the library itself, so that the pid
    is the worker's: the faketime wrapper does not forward signals)."""
    env = dict(os.environ, REDIS_URL=redis_url, PYTHONUNBUFFERED="1",
               VLMQ_CACHE=str(folder / "cache"))
    if skew is not None:
        env.update(LD_PRELOAD=str(LIBFAKETIME), FAKETIME=skew, FAKETIME_DONT_FAKE_MONOTONIC="1")
    proc = subprocess.Popen(
        [VLMQ, "worker", "--model", str(model), "--name", name, "--queues", queues,
         "--cache-dir", str(folder / "vision"), "--heartbeat-ttl", TTL, "--max-batch", "1",
         "--result-cache-mb", "0", "--repetition-repeats", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    procs.append(proc)
    return proc


def _owner(redis: Redis, job: Job) -> str:
    raw = redis.get(Keys().job_owner(job.id))
    return raw.decode().split(" ", 1)[1] if raw else ""


def _long_job(client: Client, folder: Path, queue: str, pages: int) -> Job:
    return client.ocr([make_pdf(folder / f"{queue}.pdf", pages)], queue=queue, max_side=112,
                      max_tokens=256)


@pytest.mark.skipif(not LIBFAKETIME.exists() and shutil.which("faketime") is None,
                    reason="needs Debian's faketime (apt-get install -y faketime)")
def test_a_skewed_worker_takes_no_live_job_and_its_own_are_taken_when_it_dies(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        procs: list[subprocess.Popen[str]]) -> None:
    client = Client(redis_url)
    live = _long_job(client, tmp_path, "qa", 80)
    healthy = _spawn(procs, redis_url, tiny_model, tmp_path / "a", "healthy", "qa")
    wait_for(lambda: _owner(redis, live) == "healthy", 300, "the healthy worker's job")
    retries = redis.hget(f"rq:job:{live.id}", "retries_left")
    ahead = _long_job(client, tmp_path, "qb", 12)
    skewed = _spawn(procs, redis_url, tiny_model, tmp_path / "b", "ahead", "qa,qb", "+300s")
    wait_for(lambda: _owner(redis, ahead) == "ahead", 300, "the skewed worker's job")
    assert live.status() == "started", "the live job ended too soon: make it longer"
    # The skewed worker's maintenance ran at its start; kill it mid-job.
    os.kill(skewed.pid, signal.SIGKILL)
    _, out_skewed = finish(skewed)
    assert "clock is -300" in out_skewed or "clock is +300" in out_skewed, out_skewed

    wait_for(lambda: live.status() == "finished", 300, "the live job to finish")
    assert redis.hget(f"rq:job:{live.id}", "retries_left") == retries
    rescuer = _spawn(procs, redis_url, tiny_model, tmp_path / "c", "rescuer", "qb")
    wait_for(lambda: ahead.status() == "finished", 300, "the dead skewed worker's job")
    for proc in (healthy, rescuer):
        os.kill(proc.pid, signal.SIGTERM)
    (_, out_healthy), (_, out_rescuer) = finish(healthy), finish(rescuer)
    assert f"job {live.id} finished" in out_healthy, out_healthy
    assert "dropped" not in out_healthy, out_healthy
    assert f"job {ahead.id} finished" in out_rescuer, out_rescuer
