"""How long listings take as jobs pile up: `vlmq jobs --limit 20` (the whole command, a
fresh interpreter, as a user runs it) and the dashboard's `/` (Flask's test client).

Run: `python benchmarks/listing.py [--sizes 1000,100000]`. It starts a private
redis-server (timings of a shared one would blur), fills it with one-item jobs up to each
size, times the listings, and ends with one JSON line. benchmarks/scale.py imports `fill`
and `time_listings`.
Compare a checkout with another by running it with that checkout's package first on
PYTHONPATH (the command's subprocesses inherit it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from redis import Redis

SHA_DATA = b"listing benchmark input"
CHUNK = 1000
CLI = "from vlmq.cli.main import main; main()"


def fill(redis: Redis, upto: int, *, labels: int = 10, queues: int = 4) -> int:
    """Enqueue one-item jobs (through vlmq's own enqueue, pipelined) until `upto` jobs
    exist in this db; returns how many were added."""
    from vlmq.shared.blobs import sha256_hex
    from vlmq.shared.enqueue import enqueue
    from vlmq.shared.keys import Keys
    from vlmq.shared.messages import Item, JobPayload

    keys = Keys.from_env()
    sha = sha256_hex(SHA_DATA)
    redis.set(keys.blob(sha), SHA_DATA)
    have = int(redis.get("listing-bench:jobs") or 0)
    added = 0
    while have + added < upto:
        pipe = redis.pipeline(transaction=False)
        for i in range(have + added, min(upto, have + added + CHUNK)):
            p = JobPayload(task="ocr", items=(Item(kind="image", blob=sha, source=f"{i}.png"),),
                           settings={"labels": {"set": str(i % labels)}})
            enqueue(redis, p, queue=f"bench{i % queues}", keys=keys, pipeline=pipe)
            added += 1
        pipe.execute()
    redis.set("listing-bench:jobs", have + added)
    return added


def time_cli(redis_url: str, *args: str, repeats: int = 3) -> float:
    """Median wall seconds of one `vlmq ARGS` command, interpreter start included."""
    env = {**os.environ, "REDIS_URL": redis_url}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", CLI, *args], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_rq_info(redis_url: str, *, repeats: int = 3) -> float:
    """Median wall seconds of `rq info`: the same start-up, RQ's own counting."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "rq.cli", "info", "--url", redis_url],
                       check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_in_process(redis_url: str, *, repeats: int = 3) -> dict[str, float]:
    """The listings' own cost, without an interpreter's start: Client.jobs(limit=20) and
    Client.group_status, median seconds."""
    from vlmq.producer.client import Client

    client = Client(redis_url)
    out = {}
    for name, call in (("jobs_limit_20_in_process_s", lambda: client.jobs(limit=20)),
                       ("status_label_in_process_s",
                        lambda: client.group_status({"set": "3"}))):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def time_dashboard(redis_url: str, path: str = "/", *, repeats: int = 3) -> float:
    """Median seconds of one GET of a dashboard page (in process, warm)."""
    from vlmq.server.dashboard.app import Settings, create_app

    app = create_app(Settings(redis_url=redis_url))
    client = app.test_client()
    client.get(path)  # warm: templates compiled, scripts loaded
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        resp = client.get(path, headers={"Host": "127.0.0.1:9191"})
        times.append(time.perf_counter() - t0)
        if resp.status_code != 200:
            raise RuntimeError(f"dashboard {path} answered {resp.status_code}")
    return statistics.median(times)


def time_listings(redis_url: str, *, repeats: int = 3) -> dict[str, float]:
    """The listing figures at the jobs the db holds now (seconds, medians)."""
    return {
        "jobs_limit_20_s": time_cli(redis_url, "jobs", "--limit", "20", repeats=repeats),
        "jobs_label_limit_20_s": time_cli(redis_url, "jobs", "--label", "set=3", "--limit",
                                          "20", repeats=repeats),
        "status_label_s": time_cli(redis_url, "status", "--label", "set=3",
                                   repeats=repeats),
        "status_overview_s": time_cli(redis_url, "status", "--allow-eviction",
                                      repeats=repeats),
        "dashboard_overview_s": time_dashboard(redis_url, "/", repeats=repeats),
        "dashboard_jobs_s": time_dashboard(redis_url, "/jobs", repeats=repeats),
        **time_in_process(redis_url, repeats=repeats),
        "rq_info_s": time_rq_info(redis_url, repeats=repeats),
        "python_start_s": time_python(repeats=repeats),
    }


def time_python(*, repeats: int = 3) -> float:
    """Median seconds of `python -c pass` here: the floor under every command's figure."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(sizes: list[int], *, repeats: int = 3) -> dict[str, Any]:
    from vlmq.worker.redis_server import start_private

    server = start_private()
    try:
        redis = Redis.from_url(server.url)
        out: dict[str, Any] = {"sizes": {}}
        for n in sorted(sizes):
            t0 = time.perf_counter()
            added = fill(redis, n)
            fill_s = time.perf_counter() - t0
            figures = time_listings(server.url, repeats=repeats)
            out["sizes"][str(n)] = {**figures, "enqueue_jobs_per_s":
                                    round(added / fill_s) if fill_s else None}
            print(f"{n} jobs: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()),
                  file=sys.stderr, flush=True)
        # `vlmq jobs --help`: the start-up of `vlmq jobs` alone (the root's --help would
        # load every command module, cli/main.py's LATER).
        out["jobs_startup_s"] = time_cli(server.url, "jobs", "--help", repeats=repeats)
        return out
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,100000",
                        help="job counts to measure at, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args()
    print(json.dumps(run([int(s) for s in ns.sizes.split(",")], repeats=ns.repeats)))


if __name__ == "__main__":
    main()
