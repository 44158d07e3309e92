"""Bookkeeping at scale: Redis bytes, enqueue rate, listings at 100 k jobs, small jobs, RSS.

Everything runs against a private redis-server on a free port (worker/redis_server.py),
so used_memory is vlmq's alone and nothing touches a shared db. In order:

1. Redis bytes per queued item, by reference and by upload, and enqueue items/s
   (benchmarks/refs.py's measure, on a smaller set);
2. Redis bytes per finished item (benchmarks/memory.py's bytes_per_finished_item);
3. one-item jobs drained per second when every item is a result-cache hit, and how soon
   an idle worker takes a new job (benchmarks/small_jobs.py);
4. `vlmq jobs --limit 20` and the dashboard's `/` at 1 k, 10 k and 100 k queued jobs
   (benchmarks/listing.py's fill and timings), and the same listing in process;
5. a worker's RSS over a queue of 100 k one-item jobs (a real image, by reference): when
   it is ready, and while it works;
6. Redis memory for 1 M pages by reference, queued (in 500-page jobs, and as one-item
   jobs) and finished, extrapolated from 1, 4 and 2.

Targets are printed beside the figures, never asserted. The last line is JSON.

    .venv/bin/python benchmarks/scale.py            # under 10 minutes on 2 cores
    .venv/bin/python benchmarks/scale.py --sizes 200,1000 --small   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # benchmarks/ is not a package
import listing
import memory
import refs
import small_jobs
from redis import Redis

from vlmq.stores.backends import FolderStore, Stores

MB = 1024 * 1024
SIZES = (1_000, 10_000, 100_000)
QUEUE = "scale"
TARGETS = {
    "finished_item_bytes_ex_text": "<= 400 B plus the text",
    "listing_s": "< 0.3 s, jobs and / within 1.5x of each other, at 1 k and 100 k",
    "drain_jobs_per_s": ">= 500",
    "pickup_ms": "<= 20 ms",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the tiny model)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)),
                   help="queued-job counts the listings are timed at (default 1000,10000,"
                        "100000); the last one is the worker's backlog")
    p.add_argument("--small", action="store_true",
                   help="small sets for every other part too (a check, not the figures)")
    p.add_argument("--rss-window", type=float, default=30.0,
                   help="seconds the worker's RSS is sampled while it works (default 30)")
    p.add_argument("--repeat", type=int, default=3, help="timings per listing, median kept")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    return p.parse_args(argv)


# ---------------------------------------------------------------- 1. queued bytes, enqueue


def queued_bytes(url: str, work: Path, *, files: int, pages: int) -> dict[str, float]:
    """refs.py's figures on `files` distinct images and one PDF of `pages` pages."""
    images, pdf = work / "images", work / "pdf"
    refs.make_files(images, files, 384)
    refs.make_pdf(pdf / "doc.pdf", pages)
    out: dict[str, float] = {}
    for label, folder in (("image", images), ("page", pdf)):
        for how, stores in (("ref", Stores([FolderStore("bench", work)])),
                            ("upload", Stores())):
            _, per_item, rate = refs.measure(url, folder, stores, 1)
            out[f"queued_{label}_{how}_bytes"] = round(per_item, 1)
            out[f"enqueue_{label}_{how}_items_per_s"] = round(rate, 1)
    return out


# ---------------------------------------------------------------- 4. listings


def backlog(url: str, image: Path, stores: Stores, n: int, chunk: int = 1000) -> float:
    """Queue `n` one-item caption jobs of one real image by reference on QUEUE, through
    vlmq's own enqueue, `chunk` per pipeline; returns jobs/s. listing.fill's jobs name a
    blob that is no image (listings never open it); a worker needs items it can run."""
    from vlmq.producer.inputs import prepare
    from vlmq.producer.options import JobOptions
    from vlmq.shared.enqueue import enqueue
    from vlmq.shared.keys import Keys

    prepared = prepare([image], stores=stores)
    opts = JobOptions.build(queue=QUEUE, labels={"set": "scale"}, max_tokens=1)
    wire, payload = opts.payload("caption", prepared.items)
    keys = Keys.from_env()
    redis = Redis.from_url(url)
    t0 = time.perf_counter()
    done = 0
    while done < n:
        pipe = redis.pipeline(transaction=True)
        k = min(chunk, n - done)
        for _ in range(k):
            enqueue(redis, payload, queue=QUEUE, wire=wire, keys=keys, pipeline=pipe)
        pipe.execute()
        done += k
    took = time.perf_counter() - t0
    redis.close()
    return n / took if took else 0.0


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up (imports, connections, Lua script load)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def listings(url: str, sizes: Sequence[int], repeat: int) -> dict[str, Any]:
    """benchmarks/listing.py's fill and timings at each size, plus `Client.jobs(limit=20)`
    in process: the command's own work without the interpreter start-up."""
    from vlmq.producer.client import Client

    redis = Redis.from_url(url)
    out: dict[str, Any] = {}
    try:
        for n in sorted(sizes):
            t0 = time.perf_counter()
            added = listing.fill(redis, n)
            fill_s = time.perf_counter() - t0
            figures = listing.time_listings(url, repeats=repeat)
            with Client(url) as client:
                figures["jobs_in_process_s"] = _median_s(lambda: client.jobs(limit=20), repeat)
            out[str(n)] = {k: round(v, 4) for k, v in figures.items()}
            out[str(n)]["enqueue_jobs_per_s"] = round(added / fill_s) if fill_s else None
            print(f"   {n} jobs: {out[str(n)]}", flush=True)
        out["cli_startup_s"] = round(listing.time_cli(url, "--help", repeats=repeat), 3)
    finally:
        redis.close()
    return out


# ---------------------------------------------------------------- 5. worker RSS


def _rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB."""
    rss = hwm = 0.0
    with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    return rss, hwm


def worker_rss(url: str, model: str, work: Path, stores_spec: str, window_s: float,
               backlog: int) -> dict[str, float]:
    """A worker started over the queued backlog: RSS when it is ready (model loaded, stats
    published: about to take its first job) and while it works for `window_s`."""
    name = f"rss-{uuid.uuid4().hex[:6]}"
    cmd = [*C.worker_cmd(url, model, QUEUE, max_batch=16, cache_dir=work / "rss-vision",
                         name=name, burst=False), "--store", stores_spec]
    redis = Redis.from_url(url)
    proc = subprocess.Popen(cmd, env=C.worker_env(work / "rss-cache"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not C.read_stats(redis, name):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not become ready")
            time.sleep(0.05)
        ready, _ = _rss_mb(proc.pid)
        samples = []
        t_end = time.monotonic() + window_s
        while time.monotonic() < t_end and proc.poll() is None:
            samples.append(_rss_mb(proc.pid)[0])
            time.sleep(0.5)
        _, hwm = _rss_mb(proc.pid)
        stats = C.read_stats(redis, name)
        left = int(redis.llen(f"rq:queue:{QUEUE}"))
    finally:
        C.stop(proc)
        redis.close()
    return {"backlog_items": backlog, "rss_ready_mb": round(ready, 1),
            "rss_working_max_mb": round(max(samples, default=ready), 1),
            "rss_working_last_mb": round(samples[-1] if samples else ready, 1),
            "rss_hwm_mb": round(hwm, 1),
            "items_done_in_window": int(stats.get("items_ok", "0"))
            + int(stats.get("items_failed", "0")),
            "queue_left": left}


# ---------------------------------------------------------------- main


def run(args: argparse.Namespace, url: str, work: Path) -> dict[str, Any]:
    model = C.ensure_model(args.model)
    sizes = [int(x) for x in args.sizes.split(",")]
    small = args.small
    fig: dict[str, Any] = {}

    print("1. queued bytes and enqueue rate", flush=True)
    fig.update(queued_bytes(url, work / "refs", files=60 if small else 1000,
                            pages=40 if small else 500))

    print("2. bytes per finished item", flush=True)
    fin = memory.bytes_per_finished_item(url, model, items=40 if small else 400,
                                         per_job=20 if small else 100,
                                         workdir=work / "finished")
    fig["finished_item_bytes"] = round(fin["per_item"], 1)
    fig["finished_item_bytes_ex_text"] = round(fin["per_item_ex_text"], 1)
    fig["finished_item_text_bytes"] = round(fin["text"], 1)
    fig["finished_cached_item_bytes_ex_text"] = round(fin["cached_per_item_ex_text"], 1)

    print("3. one-item jobs", flush=True)
    drain = small_jobs.drain_rate(url, jobs=60 if small else 2000, model=model,
                                  workdir=work / "drain")
    fig["drain_jobs_per_s"] = drain["drain_jobs_per_s"]
    fig["drain_statuses"] = drain["statuses"]
    pickup = small_jobs.pickup_latency(url, samples=3 if small else 20, model=model,
                                       workdir=work / "pickup")
    fig["pickup_ms_median"] = pickup["pickup_ms_median"]
    fig["pickup_ms_p95"] = pickup["pickup_ms_p95"]

    print(f"4. listings at {', '.join(map(str, sizes))} jobs", flush=True)
    C.connect(url).close()  # flushed
    fig["listing"] = listings(url, sizes, args.repeat)

    have = max(sizes)
    redis = C.connect(url)  # flushed again: the worker's backlog is a queue of its own
    base = int(redis.info("memory")["used_memory"])
    folder = work / "backlog"
    folder.mkdir(parents=True, exist_ok=True)
    image = folder / "one.png"
    C._page(0, (96, 120)).save(image)
    fig["backlog_enqueue_jobs_per_s"] = round(
        backlog(url, image, Stores([FolderStore("scale", folder)]), have), 1)
    # used_memory, not MEMORY USAGE per key: a queued job also costs registry/index entries
    fig["queued_one_item_job_bytes"] = round(
        (int(redis.info("memory")["used_memory"]) - base) / have, 1)
    redis.close()

    print(f"5. worker RSS over a {have}-item backlog", flush=True)
    fig["worker"] = worker_rss(url, model, work, f"scale={folder}",
                               2.0 if small else args.rss_window, have)

    million = 1_000_000
    fig["extrapolated_1M_pages_queued_ref_mb"] = round(
        million * fig["queued_page_ref_bytes"] / MB, 1)
    fig["extrapolated_1M_one_item_jobs_queued_mb"] = round(
        million * fig["queued_one_item_job_bytes"] / MB, 1)
    fig["extrapolated_1M_pages_finished_mb"] = round(million * fin["per_item"] / MB, 1)
    fig["extrapolated_1M_pages_finished_ex_text_mb"] = round(
        million * fin["per_item_ex_text"] / MB, 1)
    return fig


def report(fig: dict[str, Any], sizes: Sequence[int]) -> None:
    rows: list[tuple[str, object, str]] = [
        ("Redis B / queued image, by reference", fig["queued_image_ref_bytes"], ""),
        ("Redis B / queued image, uploaded", fig["queued_image_upload_bytes"], ""),
        ("Redis B / queued PDF page, by reference", fig["queued_page_ref_bytes"], ""),
        ("Redis B / queued PDF page, uploaded", fig["queued_page_upload_bytes"], ""),
        ("enqueue images/s, by reference", fig["enqueue_image_ref_items_per_s"], ""),
        ("enqueue images/s, uploaded", fig["enqueue_image_upload_items_per_s"], ""),
        ("enqueue PDF pages/s, by reference", fig["enqueue_page_ref_items_per_s"], ""),
        ("Redis B / finished item", fig["finished_item_bytes"], ""),
        ("  of which not its text", fig["finished_item_bytes_ex_text"],
         TARGETS["finished_item_bytes_ex_text"]),
        ("  mean text", fig["finished_item_text_bytes"], ""),
        ("one-item jobs drained / s (result-cache hits)", fig["drain_jobs_per_s"],
         TARGETS["drain_jobs_per_s"]),
        ("idle worker pickup, median ms", fig["pickup_ms_median"], TARGETS["pickup_ms"]),
        ("idle worker pickup, p95 ms", fig["pickup_ms_p95"], ""),
        ("Redis B / queued one-item job (fill)", fig["queued_one_item_job_bytes"], ""),
        ("vlmq --help (start-up alone), s", fig["listing"]["cli_startup_s"], ""),
        ("backlog enqueue jobs/s (pipelined)", fig["backlog_enqueue_jobs_per_s"], ""),
    ]
    for n in sizes:
        t = fig["listing"][str(n)]
        rows += [(f"vlmq jobs --limit 20 at {n} jobs, s", t["jobs_limit_20_s"],
                  TARGETS["listing_s"]),
                 ("  Client.jobs(limit=20) in process, s", t["jobs_in_process_s"], ""),
                 (f"vlmq jobs --label K=V --limit 20 at {n} jobs, s",
                  t["jobs_label_limit_20_s"], ""),
                 (f"vlmq status --label K=V at {n} jobs, s", t["status_label_s"], ""),
                 (f"dashboard / at {n} jobs, s", t["dashboard_overview_s"],
                  TARGETS["listing_s"]),
                 (f"dashboard /jobs at {n} jobs, s", t["dashboard_jobs_s"], "")]
    w = fig["worker"]
    rows += [(f"worker RSS ready, {w['backlog_items']} items queued, MB", w["rss_ready_mb"], ""),
             ("worker RSS working (max), MB", w["rss_working_max_mb"], ""),
             ("  items done in the window", w["items_done_in_window"], ""),
             ("1 M pages queued by reference (500-page jobs), Redis MB",
              fig["extrapolated_1M_pages_queued_ref_mb"], ""),
             ("1 M one-item jobs queued by reference, Redis MB",
              fig["extrapolated_1M_one_item_jobs_queued_mb"], ""),
             ("1 M pages finished, Redis MB", fig["extrapolated_1M_pages_finished_mb"], "")]
    print(C.table(("figure", "measured", "target"), rows))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from vlmq.worker.redis_server import start_private

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vlmq-scale-") as tmp:
        work = args.workdir or Path(tmp)
        server = start_private()
        try:
            print(f"machine: {C.machine()}\nRedis: {server.binary} at {server.url}",
                  flush=True)
            fig = run(args, server.url, work)
        finally:
            server.stop()
    fig["harness_s"] = round(time.perf_counter() - t0, 1)
    fig["targets"] = TARGETS
    print()
    report(fig, [int(x) for x in args.sizes.split(",")])
    print(f"harness wall time: {fig['harness_s']:.0f} s")
    C.emit_json(fig, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
