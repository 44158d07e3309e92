"""How fast a worker drains one-item jobs, and how soon an idle worker takes a new one.

Producers in other languages often send one photo per job. When the photo's text is
already in the result cache no model runs at all: what is left is the worker's
bookkeeping per job (take, start, write, end), which this measures.

    python benchmarks/small_jobs.py                 # 2,000 one-item jobs, result-cache hits
    python benchmarks/small_jobs.py --jobs 500 --pickups 10
    python benchmarks/small_jobs.py --py-spy /tmp/drain.svg   # profile the drain

`drain_rate(...)` and `pickup_latency(...)` are importable (benchmarks/scale.py uses
them); both return a dict, and the script prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # benchmarks/ is not a package

# Distinct images cycled through the jobs: each one's text is cached once, in the warm-up.
DISTINCT = 50
# py-spy's output format by the profile file's suffix (raw: collapsed stacks, one a line).
_PROFILE_FORMATS = {".json": "speedscope", ".txt": "raw"}


def _images(folder: Path, n: int, side: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        p = folder / f"photo{i:03d}.png"
        common._page(i, (side, side)).save(p)
        out.append(p)
    return out


def _enqueue(redis_url: str, paths: Sequence[Path], n: int, *, queue: str,
             max_tokens: int, side: int) -> tuple[list[str], float]:
    """n one-item caption jobs cycling `paths`; the ids and the enqueue rate (jobs/s)."""
    from vlmq.producer.client import Client

    ids = []
    with Client(redis_url) as client:
        t0 = time.perf_counter()
        for i in range(n):
            job = client.caption([paths[i % len(paths)]], queue=queue, max_side=side,
                                 max_tokens=max_tokens)
            ids.append(job.id)
        took = time.perf_counter() - t0
    return ids, n / took if took else 0.0


def _stamp(raw: bytes | None) -> float | None:
    if not raw:
        return None
    return datetime.fromisoformat(raw.decode().replace("Z", "+00:00")).timestamp()


def _ends(redis: Redis, ids: Sequence[str]) -> list[tuple[str, float | None, float | None,
                                                         float | None]]:
    """(status, enqueued_at, started_at, ended_at) of each job, from RQ's hashes."""
    with redis.pipeline(transaction=False) as pipe:
        for jid in ids:
            pipe.hmget(f"rq:job:{jid}", ["status", "enqueued_at", "started_at", "ended_at"])
        rows = pipe.execute()
    return [((s or b"?").decode(), _stamp(q), _stamp(a), _stamp(b)) for s, q, a, b in rows]


def _run_worker(cmd: list[str], env: dict[str, str], profile: Path | None,
                timeout: float, *, cpu_only: bool = False, redis: Redis | None = None,
                queue: str = "", jobs: int = 0) -> tuple[float, str, dict[str, float]]:
    """Run a burst worker to its end; with `redis`, also measure the drain itself: the
    worker's CPU seconds and Redis's commands from its first job's start to its last
    job's end (sampled every 10 ms from /proc and INFO)."""
    if profile is not None:
        cmd = [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
               "record", "--rate", "200", *([] if cpu_only else ["--idle"]),
               "--subprocesses", "-o", str(profile),
               "--format", _PROFILE_FORMATS.get(profile.suffix, "flamegraph"),
               "--", *cmd]
    t0 = time.perf_counter()
    # The log goes to a file: a pipe nobody reads while the drain is watched would fill
    # and stop the worker.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        drain: dict[str, float] = {}
        try:
            if redis is not None and profile is None:
                drain = _watch_drain(proc, redis, queue, jobs, time.monotonic() + timeout)
            proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        out = log.read()
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"worker exited {proc.returncode}:\n{out[-4000:]}")
    return took, out, drain


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _commands(redis: Redis) -> int:
    return int(redis.info("stats")["total_commands_processed"])


def _watch_drain(proc: subprocess.Popen[str], redis: Redis, queue: str, jobs: int,
                 deadline: float) -> dict[str, float]:
    wip, done = f"rq:wip:{queue}", f"rq:finished:{queue}"
    start: tuple[float, int] | None = None
    polls = 0
    base = int(redis.zcard(done))
    while proc.poll() is None and time.monotonic() < deadline:
        polls += 1
        if start is None and (redis.zcard(wip) or int(redis.zcard(done)) > base):
            start = (_cpu_s(proc.pid), _commands(redis))
            polls = 0
        elif start is not None and int(redis.zcard(done)) - base >= jobs:
            cpu, cmds = _cpu_s(proc.pid), _commands(redis)
            ours = 2 * polls + 2  # this loop's own ZCARDs and INFOs
            return {"worker_cpu_ms_per_job": round(1000 * (cpu - start[0]) / jobs, 3),
                    "redis_commands_per_job": round((cmds - start[1] - ours) / jobs, 1)}
        time.sleep(0.01)
    return {}


def drain_rate(redis_url: str, *, jobs: int = 2000, model: str | None = None,
               workdir: Path | None = None, distinct: int = DISTINCT, max_tokens: int = 8,
               side: int = 64, profile: Path | None = None, cpu_only: bool = False,
               flush: bool = True, timeout: float = 900) -> dict[str, Any]:
    """One-item jobs drained per second by one `vlmq worker --burst` when every item is a
    result-cache hit: warm the cache with `distinct` images, enqueue `jobs` jobs cycling
    them, start the worker, and time the first job's start to the last job's end (RQ's
    own started_at/ended_at), so model load and shutdown are left out."""
    model = common.ensure_model(model)
    redis = common.connect(redis_url, flush=flush)
    work = workdir or Path(tempfile.mkdtemp(prefix="vlmq-small-"))
    paths = _images(work / "inputs", distinct, side)
    queue = f"small-{uuid.uuid4().hex[:6]}"
    env = common.worker_env(work / "cache")
    cache_dir = work / "vision-cache"

    warm_ids, _ = _enqueue(redis_url, paths, distinct, queue=queue, max_tokens=max_tokens,
                           side=side)
    name = f"warm-{uuid.uuid4().hex[:6]}"
    _run_worker(common.worker_cmd(redis_url, model, queue, max_batch=8, cache_dir=cache_dir,
                                  name=name), env, None, timeout)
    warm = _ends(redis, warm_ids)
    if any(s != "finished" for s, *_ in warm):
        raise RuntimeError(f"warm-up jobs did not all finish: {[s for s, *_ in warm]}")

    ids, enqueue_rate = _enqueue(redis_url, paths, jobs, queue=queue, max_tokens=max_tokens,
                                 side=side)
    name = f"drain-{uuid.uuid4().hex[:6]}"
    process_s, output, drain = _run_worker(
        common.worker_cmd(redis_url, model, queue, max_batch=8, cache_dir=cache_dir,
                          name=name), env, profile, timeout, cpu_only=cpu_only, redis=redis,
        queue=queue, jobs=jobs)
    rows = _ends(redis, ids)
    statuses: dict[str, int] = {}
    for s, *_ in rows:
        statuses[s] = statuses.get(s, 0) + 1
    starts = [a for _, _, a, _ in rows if a is not None]
    ends = [b for _, _, _, b in rows if b is not None]
    span = max(ends) - min(starts) if starts and ends else 0.0
    stats = common.read_stats(redis, name)
    redis.close()
    return {
        "jobs": jobs,
        "statuses": statuses,
        "drain_jobs_per_s": round(jobs / span, 1) if span else None,
        "drain_s": round(span, 3),
        "ms_per_job": round(1000 * span / jobs, 3) if jobs else None,
        "worker_process_s": round(process_s, 2),
        **drain,
        "enqueue_jobs_per_s": round(enqueue_rate, 1),
        "result_cache_hits": int(stats.get("result_cache_hits", "0")),
        "log_tail": output.strip().splitlines()[-3:],
    }


def pickup_latency(redis_url: str, *, samples: int = 20, model: str | None = None,
                   workdir: Path | None = None, gap_s: float = 0.3, flush: bool = True,
                   timeout: float = 300) -> dict[str, Any]:
    """How long an idle worker takes to start a job pushed while it waits: `samples`
    one-item jobs, each enqueued `gap_s` after the previous one ended, timed from RQ's
    enqueued_at to started_at (one machine, one clock)."""
    from vlmq.producer.client import Client

    model = common.ensure_model(model)
    redis = common.connect(redis_url, flush=flush)
    work = workdir or Path(tempfile.mkdtemp(prefix="vlmq-pickup-"))
    paths = _images(work / "inputs", samples, 64)
    queue = f"pickup-{uuid.uuid4().hex[:6]}"
    name = f"pickup-{uuid.uuid4().hex[:6]}"
    cmd = common.worker_cmd(redis_url, model, queue, max_batch=8,
                            cache_dir=work / "vision-cache", name=name, burst=False)
    proc = subprocess.Popen(cmd, env=common.worker_env(work / "cache"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    waits: list[float] = []
    try:
        deadline = time.monotonic() + timeout
        while not common.read_stats(redis, name):  # published once the worker is ready
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not become ready")
            time.sleep(0.05)
        time.sleep(1.0)  # let it settle into its idle wait
        with Client(redis_url) as client:
            for i in range(samples):
                job = client.caption([paths[i]], queue=queue, max_side=64, max_tokens=4)
                while True:
                    status, queued, started, _ = _ends(redis, [job.id])[0]
                    if status in ("finished", "failed"):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"job {job.id} still {status}")
                    time.sleep(0.02)
                if queued is not None and started is not None:
                    waits.append(started - queued)
                time.sleep(gap_s)
    finally:
        common.stop(proc)
        redis.close()
    waits.sort()
    return {
        "samples": len(waits),
        "pickup_ms_median": round(1000 * waits[len(waits) // 2], 1) if waits else None,
        "pickup_ms_max": round(1000 * waits[-1], 1) if waits else None,
        "pickup_ms_p95": round(1000 * waits[min(len(waits) - 1, int(0.95 * len(waits)))], 1)
        if waits else None,
    }


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"bench": "small_jobs"}
    out.update(drain_rate(args.redis_url, jobs=args.jobs, model=args.model,
                          workdir=args.workdir, profile=args.py_spy,
                          cpu_only=args.cpu_only))
    print(f"drain: {out['drain_jobs_per_s']} one-item jobs/s "
          f"({out['ms_per_job']} ms each; worker CPU "
          f"{out.get('worker_cpu_ms_per_job')} ms and "
          f"{out.get('redis_commands_per_job')} Redis commands per job), "
          f"statuses {out['statuses']}")
    if args.pickups:
        out.update(pickup_latency(args.redis_url, samples=args.pickups, model=args.model))
        print(f"idle pickup: median {out['pickup_ms_median']} ms, "
              f"max {out['pickup_ms_max']} ms")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=common.DEFAULT_REDIS_URL,
                        help=f"Redis db to use; it is FLUSHED first "
                             f"(default {common.DEFAULT_REDIS_URL})")
    parser.add_argument("--private", action="store_true",
                        help="start a private redis-server for the run (the commands-per-job "
                             "figure then counts this worker's only)")
    parser.add_argument("--model", default=None, help="default: the tiny random-weight model")
    parser.add_argument("--jobs", type=int, default=2000, help="one-item jobs to drain")
    parser.add_argument("--pickups", type=int, default=20,
                        help="idle pick-ups to time (0: skip)")
    parser.add_argument("--py-spy", type=Path, default=None,
                        help="profile the drain into this file (.json: speedscope, .txt: collapsed "
                             "stacks, else an svg flame graph)")
    parser.add_argument("--cpu-only", action="store_true",
                        help="profile on-CPU time only (py-spy without --idle)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    private = None
    if args.private:
        from vlmq.worker.redis_server import start_private

        private = start_private()
        args.redis_url = private.url
    try:
        out = _measure(args)
    finally:
        if private is not None:
            private.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
