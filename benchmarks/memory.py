"""Memory of a bulk run: the producer's peak RSS, and Redis before, during and after.

1. Producer peak RSS: `vlmq enqueue ocr` over a folder of 20 PDFs of 20 MB each (one page
   of incompressible image data each), as a subprocess (its own ru_maxrss).
2. Redis used_memory while a 10,000-page run goes through a real worker (the tiny model):
   before the enqueue, its peak during the run, when the last job has ended, and once the
   inputs' grace (--keep-inputs) has passed.
3. Redis bytes per finished item (--finished-only for this alone; scale.py imports
   bytes_per_finished_item): a real worker captions --finished images twice with the
   result cache on, and each key family's cost is what deleting it gives back.

Runs its own redis-server on a free port (used_memory is server-wide: a shared Redis that
others use would blur it), or --redis-url (a db that is FLUSHED).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import common as C
from redis import Redis

from vlmq.shared.keys import Keys
from vlmq.shared.messages import ItemResult
from vlmq.worker.redis_server import start_private
from vlmq.worker.results.cache import ResultCache

MB = 1024 * 1024


def noise_pdf(path: Path, size_bytes: int, seed: int) -> None:
    """A one-page PDF whose page is an uncompressed RGB image of random bytes: `size_bytes`
    of input that no compression shrinks, written without holding a copy in a library."""
    side = int((size_bytes / 3) ** 0.5)
    data = random.Random(seed).randbytes(side * side * 3)
    content = b"q 612 0 0 792 0 0 cm /Im0 Do Q\n"
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
        b"/Resources << /XObject << /Im0 4 0 R >> >> /Contents 5 0 R >>",
        b"<< /Type /XObject /Subtype /Image /Width %d /Height %d /ColorSpace /DeviceRGB "
        b"/BitsPerComponent 8 /Length %d >>\nstream\n%s\nendstream" % (side, side, len(data),
                                                                     data),
        b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content),
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for n, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (n, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1, xref)
    path.write_bytes(bytes(out))


def used(redis: Redis) -> int:
    """used_memory, read twice: the first INFO after a burst of commands still counts
    buffers the server frees lazily."""
    redis.info("memory")
    return int(redis.info("memory")["used_memory"])


def producer_rss(redis_url: str, folder: Path, *extra: str) -> tuple[float, float, str]:
    """(peak RSS in MB, seconds, stdout) of one `vlmq enqueue ocr FOLDER` subprocess."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([C.VLMQ, "--redis-url", redis_url, "enqueue", "ocr", str(folder),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out = proc.stdout.read().decode() if proc.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        err = proc.stderr.read().decode() if proc.stderr else ""
        raise RuntimeError(f"enqueue failed: {err}")
    return usage.ru_maxrss / 1024, wall, out.strip()


@contextmanager
def peak_memory(redis: Redis) -> Iterator[list[int]]:
    """used_memory every 0.1 s on a thread while the block runs; yields [peak so far]."""
    peak = [used(redis)]
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.1):
            peak[0] = max(peak[0], used(redis))

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


def pages_run(redis_url: str, work: Path, model: str, *, pdfs: int, pages: int,
              budget_mb: float, keep_s: int) -> dict[str, float]:
    folder = work / "pages"
    folder.mkdir()
    for k in range(pdfs):
        imgs = [C._page(k * pages + i, (153, 198)) for i in range(pages)]
        imgs[0].save(folder / f"doc{k:03d}.pdf", "PDF", save_all=True, append_images=imgs[1:],
                     resolution=36.0)
    input_mb = sum(p.stat().st_size for p in folder.iterdir()) / MB
    redis = Redis.from_url(redis_url)
    worker = subprocess.Popen(
        C.worker_cmd(redis_url, model, "ocr", max_batch=16, cache_dir=work / "vcache",
                     name="mem", burst=False), env=C.worker_env(work / "cache"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not redis.scard("rq:workers:ocr"):
            time.sleep(0.2)
        before = used(redis)
        t0 = time.perf_counter()
        with peak_memory(redis) as peak:
            _, _, batch = producer_rss(redis_url, folder, "--max-tokens", "1",
                                       "--max-pending-mb", str(budget_mb),
                                       "--keep-inputs", str(keep_s))
            subprocess.run([C.VLMQ, "--redis-url", redis_url, "wait", batch], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
        ended = used(redis)
        time.sleep(keep_s + 2)
        after = used(redis)
    finally:
        worker.kill()
        worker.wait()
    return {"input_mb": input_mb, "before": before / MB, "peak": peak[0] / MB,
            "ended": ended / MB, "after": after / MB, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=None,
                        help="a Redis db to FLUSH and use (default: start a redis-server)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--big", type=int, default=20, help="PDFs for the RSS figure (20)")
    parser.add_argument("--big-mb", type=float, default=20, help="MB each (20)")
    parser.add_argument("--pdfs", type=int, default=100, help="PDFs in the page run (100)")
    parser.add_argument("--pages", type=int, default=100, help="pages each (100)")
    parser.add_argument("--budget-mb", type=float, default=4.0,
                        help="--max-pending-mb of the page run (4)")
    parser.add_argument("--keep-inputs", type=int, default=10,
                        help="--keep-inputs of the page run, s (10)")
    parser.add_argument("--finished", type=int, default=400,
                        help="items of the bytes-per-finished-item runs (400)")
    parser.add_argument("--per-job", type=int, default=100, help="items per job there (100)")
    parser.add_argument("--finished-only", action="store_true",
                        help="only the bytes-per-finished-item figure")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="vlmq-memory-"))
    model = C.ensure_model(args.model)
    print(f"machine: {C.machine()}")
    if args.redis_url:
        C.connect(args.redis_url)
        report(args.redis_url, work, model, args)
    else:
        server = start_private()
        try:
            report(server.url, work, model, args)
        finally:
            server.stop()


def report(url: str, work: Path, model: str, args: argparse.Namespace) -> None:
    report_finished(url, model, args)
    if args.finished_only:
        return
    C.connect(url)
    big = work / "big"
    big.mkdir()
    for i in range(args.big):
        noise_pdf(big / f"big{i:02d}.pdf", int(args.big_mb * MB), seed=i)
    rss, wall, _ = producer_rss(url, big)
    redis = Redis.from_url(url)
    print(C.table(("figure", "value"), [
        (f"producer peak RSS, {args.big} x {args.big_mb:g} MB PDFs", f"{rss:.0f} MB"),
        ("enqueue wall time", f"{wall:.1f} s"),
        ("Redis used_memory after that enqueue", f"{used(redis) / MB:.0f} MB")]))
    redis.flushdb()
    run = pages_run(url, work, model, pdfs=args.pdfs, pages=args.pages,
                    budget_mb=args.budget_mb, keep_s=args.keep_inputs)
    print(f"\n{args.pdfs * args.pages} pages in {args.pdfs} PDFs, {run['input_mb']:.1f} MB "
          f"of input; --max-pending-mb {args.budget_mb:g}, --keep-inputs "
          f"{args.keep_inputs}; run took {run['wall_s']:.0f} s")
    print(C.table(("Redis used_memory", "MB"), [
        ("before the enqueue", f"{run['before']:.1f}"),
        ("peak during the run", f"{run['peak']:.1f}"),
        ("when the last job ended", f"{run['ended']:.1f}"),
        (f"{args.keep_inputs + 2} s later (grace passed)", f"{run['after']:.1f}")]))


# ---------------------------------------------------------------- bytes per finished item

# Key families of a finished run, by what they hold; deleted in this order to see what
# each really costs (used_memory drops by exactly what it used, dict overhead included).
_FAMILIES = (("result cache", ("rcache",)), ("item events", ("events",)),
             ("item results", ("items",)), ("job hashes, results, registries", ("",)))


def _family(key: str, prefix: str) -> str | None:
    """Which family a key left by a finished run belongs to; None for inputs (blobs) and
    worker bookkeeping, which are not the finished items' cost."""
    if key.startswith((f"{prefix}:blob", f"{prefix}:worker", "rq:worker", f"{prefix}:workers")):
        return None
    if key.startswith(f"{prefix}:job:") and key.endswith(":inputs"):
        return None
    if key.startswith((f"{prefix}:rcache", f"{prefix}:rc:", f"{prefix}:rc-")):
        return "result cache"
    if key.startswith(f"{prefix}:job:") and key.endswith(":events"):
        return "item events"
    if key.startswith(f"{prefix}:job:") and key.endswith(":items"):
        return "item results"
    return "job hashes, results, registries"


def _caption_run(redis_url: str, model: str, work: Path, images: list[Path], *,
                 per_job: int, max_tokens: int, name: str) -> list[str]:
    """Caption `images` in jobs of `per_job` items through one `vlmq worker --burst`."""
    from vlmq.producer.client import Client

    queue = f"mem-{name}"
    with Client(redis_url) as client:
        ids = [client.caption(images[i:i + per_job], queue=queue, max_tokens=max_tokens,
                              max_side=112).id for i in range(0, len(images), per_job)]
    subprocess.run(C.worker_cmd(redis_url, model, queue, max_batch=16,
                                cache_dir=work / "vcache", name=name),
                   env=C.worker_env(work / "cache"), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return ids


def _texts(redis: Redis, keys: Keys, ids: list[str]) -> tuple[int, int, int, int, int]:
    """(items, items ok, bytes of text, bytes of the stored JSON, bytes the compact form
    ItemResult.to_json would take) over the jobs' stored results."""
    n = ok = text = stored = compact = 0
    for jid in ids:
        for raw in redis.hvals(keys.job_items(jid)):
            res = ItemResult.from_dict(json.loads(raw))
            n += 1
            ok += res.ok
            text += len((res.text or "").encode())
            stored += len(raw)
            compact += len(res.to_json().encode())
    return n, ok, text, stored, compact


def _drop_inputs(redis: Redis, prefix: str) -> None:
    """Inputs and worker bookkeeping are not a finished item's cost: remove them."""
    doomed = [k.decode() for k in redis.scan_iter(count=1000)
              if _family(k.decode(), prefix) is None]
    for i in range(0, len(doomed), 500):
        redis.delete(*doomed[i:i + 500])


def _family_bytes(redis: Redis, prefix: str, jobs: list[str] | None) -> dict[str, int]:
    """Delete each key family in turn (only `jobs`' own keys, if given); what used_memory
    dropped by is what it cost, dict and expiry overhead included. (used_memory's growth
    over a whole run is no measure: the server keeps a fixed few hundred KB it had to
    allocate, e.g. for the slow log and script caches, after every key is gone.)"""
    by_key: dict[str, list[str]] = {name: [] for name, _ in _FAMILIES}
    if jobs is None:
        names = [k.decode() for k in redis.scan_iter(count=1000)]
    else:
        keys = Keys.from_env()
        names = [n for j in jobs for n in (keys.job_items(j), keys.job_events(j),
                                           Keys.rq_job(j), Keys.rq_results(j))]
    for name in names:
        fam = _family(name, prefix)
        if fam is not None:
            by_key[fam].append(name)
    out: dict[str, int] = {}
    for fam, _ in _FAMILIES:
        before = used(redis)
        for i in range(0, len(by_key[fam]), 500):
            redis.delete(*by_key[fam][i:i + 500])
        out[fam] = before - used(redis)
    return out


def bytes_per_finished_item(redis_url: str, model: str | None = None, *, items: int = 400,
                            per_job: int = 100, max_tokens: int = 24,
                            workdir: Path | None = None) -> dict[str, float]:
    """Redis bytes each finished item costs, with the result cache on, from a real worker.

    `redis_url` must be a Redis of its own (used_memory is server-wide): its db is FLUSHED.
    Two runs over the same `items` images in jobs of `per_job`: the first generates every
    item (and stores it in the result cache), the second is answered from the cache.
    Each figure is what deleting those keys gave back (inputs and worker bookkeeping are
    not counted). Keys: per_item (first run, total), per_item_ex_text, text (mean text
    bytes), cached_per_item and cached_per_item_ex_text (the second run's own keys),
    "<family> per item" (first run), the result cache's budget count against what its
    keys really use, per entry (rcache_counted, rcache_real), and the mean item result
    JSON as stored (stored_json) and in ItemResult.to_json's compact form (compact_json),
    and what the items hashes would use in that form (compact_items, per item).
    """
    work = workdir or Path(tempfile.mkdtemp(prefix="vlmq-finished-"))
    model = C.ensure_model(model)
    keys = Keys.from_env()
    redis = C.connect(redis_url)
    folder = work / "imgs"
    folder.mkdir(parents=True, exist_ok=True)
    images = []
    for i in range(items):
        path = folder / f"img{i:05d}.png"
        C._page(i, (96, 120)).save(path)
        images.append(path)
    first = _caption_run(redis_url, model, work, images, per_job=per_job,
                         max_tokens=max_tokens, name="gen")
    n, ok, text, stored, compact = _texts(redis, keys, first)
    if n != items or ok != items:
        raise RuntimeError(f"first run: {ok} of {n} items ok, {items} expected")
    second = _caption_run(redis_url, model, work, images, per_job=per_job,
                          max_tokens=max_tokens, name="hit")
    _, ok2, text2, _, _ = _texts(redis, keys, second)
    _drop_inputs(redis, keys.prefix)
    counted = ResultCache(redis, keys, "").used_bytes()
    entries = _cache_entries(redis, keys)
    hit_fams = _family_bytes(redis, keys.prefix, second)
    compact_items = _compact_items_bytes(redis, keys, first)
    fams = _family_bytes(redis, keys.prefix, None)
    total = sum(fams.values())
    hits = sum(hit_fams.values())
    out = {"items": float(items), "per_job": float(per_job), "text": text / items,
           "per_item": total / items, "per_item_ex_text": (total - text) / items,
           "cached_ok": float(ok2), "cached_per_item": hits / items,
           "cached_per_item_ex_text": (hits - text2) / items,
           "rcache_entries": float(entries),
           "rcache_counted": counted / max(1, entries),
           "rcache_real": fams["result cache"] / max(1, entries),
           "stored_json": stored / items, "compact_json": compact / items,
           "compact_items": compact_items / items}
    for name, cost in fams.items():
        out[f"{name} per item"] = cost / items
    return out


def _compact_items_bytes(redis: Redis, keys: Keys, jobs: list[str]) -> int:
    """What the jobs' items hashes would use with every result in ItemResult.to_json's
    form: copies are built beside them (same field names and TTL), then deleted; what
    that gave back is the figure (as for the families: growth is blurred by buffers the
    server trims lazily)."""
    copies = []
    for jid in jobs:
        copy = f"{keys.job_items(jid)}:compact"
        raw = redis.hgetall(keys.job_items(jid))
        redis.hset(copy, mapping={k: ItemResult.from_dict(json.loads(v)).to_json()
                                  for k, v in raw.items()})
        redis.expire(copy, 3600)
        copies.append(copy)
    before = used(redis)
    redis.delete(*copies)
    return before - used(redis)


def _cache_gens(redis: Redis, keys: Keys) -> list[str]:
    return [k.decode() for k in redis.scan_iter(keys.result_cache_gen(0)[:-1] + "*",
                                                count=1000)]


def _cache_entries(redis: Redis, keys: Keys) -> int:
    """Entries of the result cache (fields of its generation hashes)."""
    return sum(int(redis.hlen(g)) for g in _cache_gens(redis, keys))


def report_finished(url: str, model: str, args: argparse.Namespace) -> None:
    fig = bytes_per_finished_item(url, model, items=args.finished, per_job=args.per_job)
    print(f"\nRedis bytes per finished item: {fig['items']:.0f} items in jobs of "
          f"{fig['per_job']:.0f}, result cache on, mean text {fig['text']:.0f} B")
    rows = [("first run (generated), total", f"{fig['per_item']:.0f}"),
            ("first run, excluding the text", f"{fig['per_item_ex_text']:.0f}"),
            ("second run (result-cache hits), total", f"{fig['cached_per_item']:.0f}"),
            ("second run, excluding the text", f"{fig['cached_per_item_ex_text']:.0f}")]
    for name, _ in _FAMILIES:
        rows.append((f"  {name}", f"{fig[f'{name} per item']:.0f}"))
        if name == "item results":
            rows += [("    the item result JSON itself", f"{fig['stored_json']:.0f}"),
                     ("    that JSON as ItemResult.to_json writes it",
                      f"{fig['compact_json']:.0f}"),
                     ("  item results, stored as to_json writes them",
                      f"{fig['compact_items']:.0f}")]
    rows += [("result cache budget: counted per entry", f"{fig['rcache_counted']:.0f}"),
             ("result cache: really used per entry", f"{fig['rcache_real']:.0f}")]
    print(C.table(("figure", "bytes"), rows))


if __name__ == "__main__":
    main()
