"""What status reads cost as queues, batches and labels grow, side by side:

- the longest single Redis command during `vlmq status` with N queued jobs (SLOWLOG with
  slowlog-log-slower-than 0: every command is logged with its duration; target < 10 ms);
- `status BATCH` and the setup of `wait BATCH` (until its first look: a wait with timeout
  0) at a small and a large batch, and their ratio (target < 2);
- `status --label K=V` with every queued job carrying the label;
- `vlmq jobs --status stopped` (a state RQ keeps in no registry) over N jobs;
- `vlmq jobs --limit 20` and `vlmq --help` as commands (a fresh interpreter each, median
  of 3) with the N jobs in Redis.

Run: `python benchmarks/status_costs.py` (100k queued jobs, batches of 1k and 90k jobs),
or `--quick` (20k, 1k and 9k: a few minutes on two cores). It starts a private
redis-server, fills it through vlmq's own enqueue (pipelined), and ends with one JSON
line. The script uses only APIs older checkouts have too: run it with another checkout's
package first on PYTHONPATH to get that checkout's figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import emit_json, redis_url_or_private, table
from benchmarks.listing import time_cli

CHUNK = 1000
DATA = b"status benchmark input"


def _fill(redis: Redis, n: int, *, queue: str, labels: dict[str, str] | None = None,
          batch: str | None = None) -> list[str]:
    """`n` one-item jobs through vlmq's enqueue, a pipelined MULTI per CHUNK."""
    from vlmq.shared.blobs import sha256_hex
    from vlmq.shared.enqueue import enqueue
    from vlmq.shared.keys import Keys
    from vlmq.shared.messages import Item, JobPayload

    keys = Keys.from_env()
    sha = sha256_hex(DATA)
    redis.set(keys.blob(sha), DATA)
    settings: dict[str, Any] = {"labels": labels} if labels else {}
    if batch:
        settings["batch"] = batch
    payload = JobPayload(task="caption", items=(Item(kind="image", blob=sha, source="a.png"),),
                         settings=settings)
    ids: list[str] = []
    for start in range(0, n, CHUNK):
        pipe = redis.pipeline(transaction=True)
        ids += [enqueue(redis, payload, queue=queue, pipeline=pipe, keys=keys)
                for _ in range(min(CHUNK, n - start))]
        pipe.execute()
    return ids


def _batch(redis: Redis, n: int) -> str:
    """A batch of `n` one-item jobs: its jobs enqueued, then its record naming them (as
    job_sets writes it, order aside)."""
    from vlmq.shared.keys import Keys

    keys = Keys.from_env()
    batch_id = "b-" + uuid.uuid4().hex
    ids = _fill(redis, n, queue=f"bq{n}", batch=batch_id)
    pipe = redis.pipeline(transaction=False)
    pipe.hset(keys.batch(batch_id), mapping={"task": "caption", "created_at": "",
                                             "labels": "{}", "items": n, "jobs": n,
                                             "ttl": 3600})
    for start in range(0, n, CHUNK):
        part = ids[start:start + CHUNK]
        pipe.rpush(keys.batch_jobs(batch_id), *part)
        pipe.sadd(keys.batch_pending(batch_id), *part)
        for job_id in part:
            pipe.set(keys.job_batch(job_id), batch_id)
    pipe.execute()
    return batch_id


def _timed(fn: Callable[[], Any], repeat: int = 1) -> float:
    """The best of `repeat` runs (sub-ms reads are mostly noise otherwise)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _longest(redis: Redis, fn: Callable[[], Any]) -> tuple[float, str, float]:
    """(longest command in ms, its name, wall seconds) while `fn` runs."""
    redis.config_set("slowlog-log-slower-than", 0)
    redis.config_set("slowlog-max-len", 1_000_000)
    redis.slowlog_reset()
    wall = _timed(fn)
    entries = redis.slowlog_get(1_000_000)
    redis.config_set("slowlog-log-slower-than", 10_000)
    named = [(e["duration"], _name(e["command"])) for e in entries]
    duration, name = max((d, n) for d, n in named if n not in ("SLOWLOG", "CONFIG"))
    return duration / 1000, name, wall


def _name(command: Any) -> str:
    first = command.split()[0] if isinstance(command, bytes) else command[0]
    return (first.decode() if isinstance(first, bytes) else str(first)).upper()


def _status(url: str) -> None:
    from click.testing import CliRunner

    from vlmq.cli.main import main

    result = CliRunner().invoke(main, ["--redis-url", url, "status", "--json"])
    assert result.exit_code in (0, 1), result.output


def _batch_status(client: Any, batch_id: str) -> None:
    client.batch(batch_id).status()


def _wait_setup(client: Any, batch_id: str) -> None:
    from vlmq.producer.client import WaitTimeout

    try:
        client.batch(batch_id).wait(timeout=0)
    except WaitTimeout:
        return


def run(queued: int, small: int, large: int) -> dict[str, Any]:
    from vlmq.producer.client import Client

    figures: dict[str, Any] = {"queued": queued, "small": small, "large": large}
    with redis_url_or_private(None) as url:
        redis = Redis.from_url(url)
        _fill(redis, queued, queue="bulk", labels={"run": "big"})
        ms, name, wall = _longest(redis, lambda: _status(url))
        figures.update(status_longest_ms=ms, status_longest_cmd=name, status_s=wall)
        client = Client(url)
        figures["label_status_s"] = _timed(lambda: client.group_status({"run": "big"}))
        figures["jobs_stopped_s"] = _timed(lambda: client.jobs(status="stopped", limit=50))
        # The whole command, as a user runs it: a fresh interpreter, at `queued` jobs.
        figures["jobs_cli_s"] = time_cli(url, "jobs", "--limit", "20")
        figures["help_cli_s"] = time_cli(url, "--help")
        for size in (small, large):
            batch_id = _batch(redis, size)
            figures[f"batch_status_{size}_s"] = _timed(
                partial(_batch_status, client, batch_id), 3)
            figures[f"batch_wait_{size}_s"] = _timed(
                partial(_wait_setup, client, batch_id), 3)
        for what in ("status", "wait"):
            figures[f"batch_{what}_ratio"] = (figures[f"batch_{what}_{large}_s"]
                                              / max(figures[f"batch_{what}_{small}_s"], 1e-9))
        client.close()
        redis.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="20k queued jobs, batches of 1k and 9k")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    queued, small, large = (20_000, 1_000, 9_000) if args.quick else (100_000, 1_000, 90_000)
    f = run(queued, small, large)
    print(table(["figure", "value", "target"], [
        (f"longest command in `vlmq status` at {queued} queued (ms, {f['status_longest_cmd']})",
         f["status_longest_ms"], "< 10"),
        ("`vlmq status` wall (s)", f["status_s"], ""),
        (f"`status BATCH` at {small} / {large} jobs (s)",
         f"{f[f'batch_status_{small}_s']:.4f} / {f[f'batch_status_{large}_s']:.4f}", ""),
        ("`status BATCH` ratio", f["batch_status_ratio"], "< 2"),
        (f"`wait BATCH` setup at {small} / {large} jobs (s)",
         f"{f[f'batch_wait_{small}_s']:.4f} / {f[f'batch_wait_{large}_s']:.4f}", ""),
        ("`wait BATCH` setup ratio", f["batch_wait_ratio"], "< 2"),
        (f"`status --label` with {queued} matching (s)", f["label_status_s"], ""),
        (f"`jobs --status stopped` over {queued} (s)", f["jobs_stopped_s"], ""),
        (f"`vlmq jobs --limit 20` wall at {queued} jobs (s, interpreter start included)",
         f["jobs_cli_s"], ""),
        ("`vlmq --help` wall (s): the start-up alone", f["help_cli_s"], "< 0.15"),
    ]))
    emit_json(f, args.json_out)
    print(json.dumps({"ok": f["status_longest_ms"] < 10 and f["batch_status_ratio"] < 2
                      and f["batch_wait_ratio"] < 2}))


if __name__ == "__main__":
    main()
