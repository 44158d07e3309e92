"""What does the vision-feature cache save? The same job cold, after a restart, and in-process.

1. cold: a burst worker with an empty --cache-dir.
2. disk: a new burst worker on the same --cache-dir (features come from the disk tier).
3. a long-lived (non-burst) worker on the same dir gets the job twice, one after the
   other: its first copy hits the disk tier again, its second the memory tier.

Figures come from the job summaries (worker-side wall time, model load excluded) and the
worker's stats hash `vlmq:worker:<name>:stats` (tower calls, PDF renders, image decodes).

    .venv/bin/python benchmarks/cache.py
    .venv/bin/python benchmarks/cache.py --max-tokens 8     # generation small: cache share big
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import common as C
from redis import Redis

COUNTED = ("tower_calls", "pdf_renders", "pdf_opens", "image_decodes", "cache_hits",
           "cache_misses", "items_ok")


@dataclass
class Row:
    label: str
    job: C.JobRun
    counts: dict[str, int]
    spawn_to_last_s: float | None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(p)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3,
                   help="whole sequences, each on a fresh cache dir; medians are reported")
    return p.parse_args(argv)


def counts_of(stats: dict[str, str]) -> dict[str, int]:
    return {k: int(float(stats.get(k, "0"))) for k in COUNTED}


def wait_stats(redis: Redis, name: str, items_ok: int, timeout: float = 30) -> dict[str, str]:
    """The worker publishes stats every 2 s; wait for the snapshot that counts this job."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = C.read_stats(redis, name)
        if int(stats.get("items_ok", "0")) >= items_ok:
            return stats
        time.sleep(0.2)
    raise RuntimeError(f"worker {name} stats never reached {items_ok} items")


def burst(args: argparse.Namespace, model: str, inputs: list[Path], cache: Path,
          label: str, tag: str) -> Row:
    run = C.run_burst_worker(args.redis_url, model, inputs, max_batch=args.max_batch,
                             cache_dir=cache, max_tokens=args.max_tokens, side=args.side,
                             label=tag)
    return Row(label, run.jobs[0], counts_of(run.stats), run.to_last_item_s)


def long_lived(args: argparse.Namespace, model: str, inputs: list[Path],
               cache: Path) -> list[Row]:
    """Two identical jobs, one after the other, to one worker process."""
    from vlmq.producer.client import Client

    name = f"live-{uuid.uuid4().hex[:6]}"
    queue = f"bench-{name}"
    redis = Redis.from_url(args.redis_url)
    rows: list[Row] = []
    first = C.enqueue_job(args.redis_url, inputs, queue=queue, max_tokens=args.max_tokens,
                          side=args.side)
    started = time.time()
    proc = subprocess.Popen(
        C.worker_cmd(args.redis_url, model, queue, max_batch=args.max_batch, cache_dir=cache,
                     name=name, burst=False),
        env=C.worker_env(cache.parent), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    try:
        before = dict.fromkeys(COUNTED, 0)
        job_id = first
        for n, label in enumerate(("disk (same process, 1st)", "memory (same process, 2nd)")):
            if n:
                job_id = C.enqueue_job(args.redis_url, inputs, queue=queue,
                                       max_tokens=args.max_tokens, side=args.side)
            with Client(args.redis_url) as client:
                client.job(job_id).wait(timeout=300, check=True)
            job = C.job_run(args.redis_url, job_id)
            after = counts_of(wait_stats(redis, name, before["items_ok"] + job.ok))
            delta = {k: after[k] - before[k] for k in COUNTED}
            rows.append(Row(label, job, delta, job.last_item_at - started if not n else None))
            before = after
    finally:
        C.stop(proc)
        redis.close()
    return rows


def report(runs: list[list[Row]]) -> None:
    """Median times over repeats; counts from the first sequence (they do not vary)."""
    table = []
    walls: list[float] = []
    spawns: list[float | None] = []
    for i, r in enumerate(runs[0]):
        c = r.counts
        wall = C.median([seq[i].job.wall_s for seq in runs])
        spawn_values = [s for seq in runs if (s := seq[i].spawn_to_last_s) is not None]
        spawn = C.median(spawn_values) if spawn_values else None
        walls.append(wall)
        spawns.append(spawn)
        table.append([r.label, f"{r.job.ok}/{r.job.items}", r.job.tokens, wall,
                      r.job.items / wall, "" if spawn is None else spawn, r.job.cache_hits,
                      c["tower_calls"], c["pdf_renders"], c["image_decodes"],
                      r.job.timings.get("vision_s", 0.0), r.job.timings.get("preprocess_s", 0.0)])
    print()
    print(f"medians of {len(runs)} sequence(s):")
    print(C.table(["run", "ok", "tokens", "job s", "items/s", "spawn->last s", "cache hits",
                   "tower calls", "pdf renders", "image decodes", "sum vision s",
                   "sum preprocess s"], table))
    print()
    for i, r in enumerate(runs[0][1:], start=1):
        line = f"ratio cold/{r.label}: job time x{walls[0] / walls[i]:.2f}"
        if spawns[i] and spawns[0]:
            line += f", spawn->last item x{spawns[0] / spawns[i]:.2f}"
        print(line)
    print("(job s: worker-side, model load excluded; a hit skips blob fetch, decode/render, "
          "processor and tower, but not prefill or decoding, so the saving is bounded by "
          "the share of time those take)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with C.redis_url_or_private(args.redis_url) as args.redis_url:
        return run(args)


def run(args: argparse.Namespace) -> int:
    model = C.ensure_model(args.model)
    C.connect(args.redis_url).close()
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-cache-") as tmp:
        workdir = args.workdir or Path(tmp)
        inputs = C.make_inputs(workdir / "inputs", args.items, args.side)
        C.print_header(model, args.items, args.side,
                       f"max {args.max_tokens} new tokens, --max-batch {args.max_batch}")
        runs: list[list[Row]] = []
        for n in range(args.repeat):
            cache = workdir / f"cache-{n}-{uuid.uuid4().hex[:6]}" / "vision"
            rows = [burst(args, model, inputs, cache, "cold", "cold")]
            rows.append(burst(args, model, inputs, cache, "disk (restarted worker)", "disk"))
            rows.extend(long_lived(args, model, inputs, cache))
            print(f"  sequence {n + 1}: " + ", ".join(
                f"{r.label.split(' ')[0]} {r.job.wall_s:.2f} s" for r in rows), flush=True)
            runs.append(rows)
    report(runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
