"""Fair shares through a real worker: a one-item batch enqueued behind another batch's 3,000
one-item jobs finishes within 3x its time alone, and the share between batches shows in the
worker's stats and `vlmq status`.

Times are compared side by side in one run (the same job alone, then behind the backlog,
on the same worker; medians of a few), never against a fixed number. The worker decodes
one row at a time, so the measured job's own work costs the same alone and behind, and
the comparison measures its wait for a turn, which is what fair shares bound; how rows
share a batch is the batcher's, and on this CPU it would make the comparison depend on
how busy the machine is."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.support.helpers import Output, Spawn, make_images, wait_for
from vlmq.producer.client import Client, Job
from vlmq.shared import fair
from vlmq.shared.enqueue import enqueue
from vlmq.shared.keys import Keys
from vlmq.shared.messages import parse_payload

pytestmark = pytest.mark.slow

Q = "fair"
BACKLOG = 3000
# The measured job generates more tokens than a backlog job (the tiny model stops after
# about 100), so its own work, not the loop's fixed costs, is what its time alone measures.
OWN_TOKENS = 160
BACKLOG_TOKENS = 2
RUNS = 5  # one-item batches timed alone, then behind the backlog: medians are compared


def _stats(redis: Redis, keys: Keys, name: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in redis.hgetall(keys.worker_stats(name)).items()}


def _finish(job: Job, timeout: float) -> float:
    """Seconds until `job` finished (polled every 5 ms), or AssertionError after timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if job.status() == "finished":
            return time.monotonic() - t0
        time.sleep(0.005)
    raise AssertionError(f"job {job.id} not finished after {timeout} s (status "
                         f"{job.status()})")


def _seconds(times: list[float]) -> str:
    return ", ".join(f"{t:.3f}" for t in times) + " s"


def _one_item_batch(client: Client, image: Path) -> float:
    """Enqueue a one-item batch and return the seconds from before its enqueue to its end."""
    t0 = time.monotonic()
    job = client.caption([image], queue=Q, max_side=64, max_tokens=OWN_TOKENS,
                         result_cache="off", batch=f"b-{uuid.uuid4().hex}")
    return time.monotonic() - t0 + _finish(job, 30)


def _backlog(redis: Redis, keys: Keys, base: dict[str, Any], batch: str, n: int) -> None:
    """`n` one-item jobs of `batch`, enqueued as vlmq's Python producer does, 500 a MULTI."""
    wire = {**base, "batch": batch, "generation": {"max_tokens": BACKLOG_TOKENS}}
    wire.pop("created_at", None)
    payload = parse_payload(wire)
    for start in range(0, n, 500):
        with redis.pipeline(transaction=True) as pipe:
            for _ in range(min(500, n - start)):
                enqueue(redis, payload, queue=Q, job_id=uuid.uuid4().hex, fresh_id=True,
                        pipeline=pipe, keys=keys)
            pipe.execute()


def test_a_one_item_batch_behind_3000_jobs_finishes_within_3x_its_time_alone(
        redis_url: str, redis: Redis, keys: Keys, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn, run_cli: Callable[..., Any]) -> None:
    out = Output(start_worker(redis_url, tiny_model, tmp_path, "--queues", Q, "--max-batch",
                              "1", "--fixed-batch", name="fair1"))  # read: its log is long
    out.wait_for("worker fair1 ready", 120)
    client = Client(redis_url)
    image = make_images(tmp_path / "imgs", 1)[0]
    _one_item_batch(client, image)  # warm: vision cache, first-call costs
    alone = [_one_item_batch(client, image) for _ in range(RUNS)]

    warm = client.caption([image], queue=Q, max_side=64, max_tokens=1, result_cache="off")
    _finish(warm, 60)
    big = f"b-{uuid.uuid4().hex}"
    _backlog(redis, keys, warm.payload().to_dict(), big, BACKLOG)
    # The worker is busy with the backlog before the small batch arrives.
    wait_for(lambda: redis.llen(Keys.rq_queue(Q)) < BACKLOG - 20, 60, "the backlog to start")
    behind = [_one_item_batch(client, image) for _ in range(RUNS)]
    left = redis.llen(Keys.rq_queue(Q))
    assert left > BACKLOG // 2, "the backlog drained: it did not stand in the way"
    shown = (f"behind {BACKLOG} jobs of another batch: {_seconds(behind)}; alone: "
             f"{_seconds(alone)}")
    assert statistics.median(behind) <= 3 * statistics.median(alone), shown

    # The share between batches: the queue's waiting batches, the worker's batches in hand.
    waiting = fair.waiting(redis, keys, [Q])[Q]
    assert waiting.batches >= 1 and waiting.next[0][0] == big
    wait_for(lambda: big in _stats(redis, keys, "fair1").get("shares", ""), 30,
             "the worker's stats to name the backlog's batch")
    shares = json.loads(_stats(redis, keys, "fair1")["shares"])
    assert {s["batch"] for s in shares} >= {big} and all(s["jobs"] >= 1 for s in shares)
    shown = json.loads(run_cli("status", "--json", code=0).stdout)
    nxt = shown["queues"][Q]["shares"]["next"][0]
    assert nxt["batch"] == big and nxt["jobs"] > BACKLOG // 2, shown["queues"][Q]
    (worker,) = [w for w in shown["workers"] if w["name"] == "fair1"]
    assert any(s["batch"] == big and s["jobs"] >= 1 for s in worker["shares"]), worker
    text = run_cli("status", code=0).stdout
    assert f"{Q}: 1 batch(es) waiting, next in turn: {big}" in text, text
    assert f"fair1 shares: {big} " in text, text
