"""Redis bytes a finished job leaves behind, counted with MEMORY USAGE.

Jobs are enqueued by the real Python client (uploaded PNGs), taken, written and finished by
the real worker path without a model: JobLifecycle, ResultWriter and the scripts they run
(write_items.lua, end_job.lua), given engine outputs of a fixed text. Every key in the db
is then counted with `MEMORY USAGE key SAMPLES 0`, before and after, so the figures hold
everything a finished job leaves: its hash, RQ's records, its results, events, index
entries, running counts and registry members. Inputs (blobs and their holders, which
expire `keep_inputs` after the job) are counted apart, and the worker's own keys not at all.

    .venv/bin/python benchmarks/job_bytes.py                 # 200 one-item jobs, one 500-item job
    .venv/bin/python benchmarks/job_bytes.py --jobs 50 --items 100

benchmarks/costs.py imports `measure`.
"""

from __future__ import annotations

import argparse
import io
import random
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from PIL import Image
from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import common as BC
from vlmq.producer.client import Client
from vlmq.shared import constants as C
from vlmq.shared.keys import Keys
from vlmq.worker.engine.batcher import Finished
from vlmq.worker.item_order import ItemOrder
from vlmq.worker.jobs.rq_jobs import BatchWorker, JobLifecycle, Running
from vlmq.worker.results.writer import ResultWriter
from vlmq.worker.stats import WorkerStats

# An OCR-like answer; its bytes are taken off the per-item figure ("+ text").
TEXT = ("Invoice 2026-11-0417. Total due: 1,284.50 EUR. Payment within 30 days of the "
        "invoice date to the account below. Thank you for your business.")
TAKE_AT_ONCE = 100


def _png(folder: Path, i: int) -> Path:
    """A distinct small PNG (its own bytes, so its own blob)."""
    rng = random.Random(i)
    img = Image.new("RGB", (8, 8), tuple(rng.randrange(256) for _ in range(3)))
    img.putpixel((i % 8, (i // 8) % 8), (i % 256, (i // 256) % 256, 7))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    path = folder / f"scan-{i:06d}.png"
    path.write_bytes(buf.getvalue())
    return path


def _finished(job_id: str, idx: int, rng: random.Random) -> Finished:
    """What the engine hands back for an item: the fixed text, tokens, five timings."""
    timings = {name: rng.uniform(0.001, 2.0) for name in
               ("queue_s", "vision_s", "embed_s", "prefill_s", "generate_s")}
    return Finished(key=(job_id, idx), text=TEXT, finish_reason="stop", prompt_tokens=312,
                    completion_tokens=41, vision_cache_hit=False, error=None, timings=timings)


def _usage(redis: Redis) -> dict[str, tuple[int, int]]:
    """Every key's (MEMORY USAGE, TTL in s)."""
    out: dict[str, tuple[int, int]] = {}
    for key in redis.scan_iter(count=1000):
        n = redis.memory_usage(key, samples=0)
        if n is not None:
            out[key.decode()] = (int(n), int(redis.ttl(key)))
    return out


def _family(key: str, prefix: str, ttl: int) -> str:
    """Which part of a job's cost a key is: 'inputs', 'worker' (not counted), 'transient'
    (gone within C.ENDED_EVENTS_S: a finished job's events stream) or 'job'."""
    if key.startswith((f"{prefix}:blob:", f"{prefix}:blob-jobs:")):
        return "inputs"
    if 0 < ttl <= C.ENDED_EVENTS_S:
        return "transient"
    if key.startswith(("rq:worker", f"{prefix}:worker", "rq:clean_registries")):
        return "worker"
    return "job"


def _delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]],
           prefix: str) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes by family, bytes by key shape) the work between the snapshots added."""
    families: dict[str, int] = {}
    shapes: dict[str, int] = {}
    for key in set(before) | set(after):
        now, ttl = after.get(key, (0, -2))
        d = now - before.get(key, (0, -2))[0]
        if not d:
            continue
        fam = _family(key, prefix, ttl)
        families[fam] = families.get(fam, 0) + d
        if fam == "job":
            shape = _shape(key, prefix)
            shapes[shape] = shapes.get(shape, 0) + d
    return families, shapes


def _shape(key: str, prefix: str) -> str:
    """A key with its job id taken out: `rq:job:<id>`, `<prefix>:job:<id>:items`..."""
    parts = key.split(":")
    if key.startswith("rq:job:") or key.startswith("rq:results:"):
        return ":".join(parts[:2]) + ":<id>"
    if key.startswith(f"{prefix}:job:") and len(parts) >= 4:
        return "<prefix>:job:<id>:" + ":".join(parts[3:])
    return key.replace(prefix, "<prefix>", 1)


def _run(client: Client, redis: Redis, keys: Keys, queue: str,
         enqueue: Callable[[], list[str]]) -> list[str]:
    """Enqueue with `enqueue`, then take, write and finish every job as a worker does."""
    ids = enqueue()
    worker = BatchWorker([queue], connection=redis, name=f"jb-{uuid.uuid4().hex[:8]}")
    life = JobLifecycle(worker, keys=keys)
    life.register_birth()
    order: ItemOrder[Running] = ItemOrder()
    writer = ResultWriter(redis, keys, life, order, WorkerStats(worker.name, 16, None))
    rng = random.Random(0)
    try:
        left = len(ids)
        while left:
            taken, _ = life.take_many(min(TAKE_AT_ONCE, left))
            assert taken and all(isinstance(t, Running) for t in taken), taken
            for state in taken:
                assert isinstance(state, Running)
                state.pending.extend(range(state.total))
                order.add(state)
            while (nxt := order.next_item()) is not None:
                state, idx = nxt
                writer.record_finished(state.job_id, idx, _finished(state.job_id, idx, rng),
                                       0.0123)
            writer.flush()
            writer.finish_complete()
            left -= len(taken)
    finally:
        life.register_death()
    for jid in ids:
        status = redis.hget(Keys.rq_job(jid), "status")
        assert status == b"finished", (jid, status)
    return ids


def measure(redis_url: str, *, jobs: int = 200, items: int = 500) -> dict[str, float]:
    """Bytes per finished one-item job and per finished item of an `items`-item job.

    `redis_url`: a db nothing else writes to meanwhile (every key in it is counted before
    and after; nothing is flushed, and the keys the run made are deleted at the end).
    Keys of the result: one_item_job (all it leaves), item (per item of the big job,
    less its text), item_text (the text's bytes),
    item_json (the stored item result's bytes), one_item_inputs and item_inputs (the
    blobs and holders, which expire keep_inputs after the job), one_item_transient and
    item_transient (keys gone within C.ENDED_EVENTS_S: the events streams), and
    `one_item <shape>` / `item <shape>` for each key shape's share.
    """
    redis = Redis.from_url(redis_url)
    prefix = f"jb{uuid.uuid4().hex[:8]}"
    keys = Keys(prefix)
    queue = f"jb-{uuid.uuid4().hex[:8]}"
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="vlmq-job-bytes-") as tmp, \
            Client(redis_url, prefix=prefix) as client:
        files = [_png(Path(tmp), i) for i in range(jobs + items)]
        before = _usage(redis)
        ids = _run(client, redis, keys, queue, lambda: [
            client.caption([f], queue=queue).id for f in files[:jobs]])
        middle = _usage(redis)
        fam, shapes = _delta(before, middle, prefix)
        out["one_item_job"] = fam.get("job", 0) / jobs
        out["one_item_inputs"] = fam.get("inputs", 0) / jobs
        out["one_item_transient"] = fam.get("transient", 0) / jobs
        out.update({f"one_item {k}": v / jobs for k, v in shapes.items()})
        big = _run(client, redis, keys, queue, lambda: [
            client.caption(files[jobs:], queue=queue).id])
        fam, shapes = _delta(middle, _usage(redis), prefix)
        text = len(TEXT.encode())
        out["item"] = fam.get("job", 0) / items - text
        out["item_text"] = text
        out["item_inputs"] = fam.get("inputs", 0) / items
        out["item_transient"] = fam.get("transient", 0) / items
        raw = redis.hvals(keys.job_items(big[0]))
        out["item_json"] = sum(len(v) for v in raw) / max(1, len(raw))
        out.update({f"item {k}": v / items for k, v in shapes.items()})
        assert len(ids) == jobs
        _clean(redis, before, queue)
    redis.close()
    return out


def _clean(redis: Redis, before: dict[str, tuple[int, int]], queue: str) -> None:
    """Delete the keys the run made; the queue leaves rq:queues if that was there."""
    made = [k for k in (key.decode() for key in redis.scan_iter(count=1000))
            if k not in before]
    for i in range(0, len(made), 500):
        redis.delete(*made[i:i + 500])
    redis.srem("rq:queues", Keys.rq_queue(queue))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=None,
                        help="a db nothing else uses meanwhile (nothing is flushed; "
                             "default: a private redis-server on a free port)")
    parser.add_argument("--jobs", type=int, default=200, help="one-item jobs (default 200)")
    parser.add_argument("--items", type=int, default=500,
                        help="items of the one big job (default 500)")
    args = parser.parse_args(argv)
    with BC.redis_url_or_private(args.redis_url) as url:
        version = Redis.from_url(url).info("server")["redis_version"]
        got = measure(url, jobs=args.jobs, items=args.items)
    print(f"Redis {version}: {args.jobs} one-item jobs, one {args.items}-item job; "
          f"MEMORY USAGE of every key, after minus before")
    print(BC.table(("figure", "bytes"), [
        ("per finished one-item job (all it leaves)", f"{got['one_item_job']:.0f}"),
        (f"per finished item of the {args.items}-item job, less its text",
         f"{got['item']:.0f}"),
        ("  its text", f"{got['item_text']:.0f}"),
        ("  the stored item result JSON", f"{got['item_json']:.0f}"),
        ("inputs per one-item job (expire after keep_inputs)",
         f"{got['one_item_inputs']:.0f}"),
        ("inputs per item", f"{got['item_inputs']:.0f}"),
        (f"gone within {C.ENDED_EVENTS_S} s, per one-item job (events stream)",
         f"{got['one_item_transient']:.0f}"),
        (f"gone within {C.ENDED_EVENTS_S} s, per item", f"{got['item_transient']:.0f}")]))
    _floor(got)
    for part in ("one_item", "item"):
        rows = sorted(((k.split(" ", 1)[1], v) for k, v in got.items()
                       if k.startswith(part + " ")), key=lambda kv: -kv[1])
        print(f"\n{part.replace('_', '-')} share by key:")
        print(BC.table(("key", "bytes"), [(k, f"{v:.1f}") for k, v in rows]))


# What a finished one-item job keeps for a feature, by key shape: its end (the summary that
# section 5 of PROTOCOL.md keeps, and RQ's payload that result, export, retry and the
# dashboard read), the listing summary, and the per-queue listing index. The rest is what
# RQ, the item result and the running counts need whatever vlmq keeps besides.
FEATURES = {"<prefix>:job:<id>:end": "the kept end and payload",
            "<prefix>:jobs:meta": "the listing summary"}


def _floor(got: dict[str, float]) -> None:
    """The one-item figure without what it keeps for features: how close any layout of
    the rest can come to the 1,500 B target."""
    shares = {k.split(" ", 1)[1]: v for k, v in got.items() if k.startswith("one_item ")}
    kept = {k: v for k, v in shares.items()
            if k in FEATURES or k.startswith("<prefix>:jobs:queue:")}
    rows = [(FEATURES.get(k, "the per-queue listing index"), f"{v:.0f}")
            for k, v in sorted(kept.items(), key=lambda kv: -kv[1])]
    rows.append(("left: RQ's hash and entry, items, time index, count record",
                 f"{got['one_item_job'] - sum(kept.values()):.0f}"))
    print("\none-item job, what it keeps for features:")
    print(BC.table(("part", "bytes"), rows))


if __name__ == "__main__":
    main()
