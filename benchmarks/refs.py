"""Inputs by reference against uploads: Redis bytes per queued item, and enqueue items/s.

Two sets, each enqueued twice into a flushed db, once with the folder as a store (items
are references: nothing of the inputs goes to Redis) and once without (every file is
uploaded as a blob):

1. distinct files: `--files` different PNG images, one item each;
2. one PDF of `--pages` pages, one item per page.

"Redis bytes per queued item" is MEMORY USAGE summed over every key of the db once the
job is queued (job hash, queue, blobs), divided by its items (INFO used_memory moves by
more than that between runs, from allocator reuse). "items/s" is the wall time of
Client.submit (hashing, checks, uploads, the enqueue), best of `--repeat`, with the OS
file cache warm. A job's data is zlib-compressed, so pages of one PDF cost almost nothing.

    .venv/bin/python benchmarks/refs.py
    .venv/bin/python benchmarks/refs.py --files 5000 --pages 2000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common as C
from redis import Redis

from vlmq.producer.client import Client
from vlmq.producer.options import JobOptions
from vlmq.stores.backends import FolderStore, Stores


def make_files(folder: Path, files: int, side: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    size = (round(side * C.PAGE_PT[0] / C.PAGE_PT[1]), side)
    for i in range(files):
        C._page(i, size).save(folder / f"img{i:05d}.png")


def make_pdf(path: Path, pages: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    imgs = [C._page(i, (306, 396)) for i in range(pages)]
    imgs[0].save(path, "PDF", save_all=True, append_images=imgs[1:], resolution=72.0)


def used(redis: Redis) -> int:
    return sum(int(redis.memory_usage(k, samples=0) or 0) for k in redis.scan_iter(count=1000))


def measure(redis_url: str, folder: Path, stores: Stores, repeat: int
            ) -> tuple[int, float, float]:
    """(items, Redis bytes per item, items/s) for enqueueing `folder` once per repeat."""
    best = float("inf")
    per_item = 0.0
    items = 0
    for _ in range(repeat):
        redis = C.connect(redis_url)  # flushed
        with Client(redis_url, stores=stores) as client:
            t0 = time.perf_counter()
            job = client.submit("ocr", [folder], JobOptions(), recursive=True)
            best = min(best, time.perf_counter() - t0)
        items = job.items
        per_item = used(redis) / items
        redis.close()
    return items, per_item, items / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=C.DEFAULT_REDIS_URL,
                        help=f"Redis db to use; it is FLUSHED (default {C.DEFAULT_REDIS_URL})")
    parser.add_argument("--files", type=int, default=2000, help="distinct images (2000)")
    parser.add_argument("--pages", type=int, default=1000, help="pages of the PDF (1000)")
    parser.add_argument("--side", type=int, default=384, help="image height in px (384)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure, best kept")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="vlmq-refs-"))
    images, pdf = work / "images", work / "pdf"
    make_files(images, args.files, args.side)
    make_pdf(pdf / "doc.pdf", args.pages)
    img_bytes = sum(p.stat().st_size for p in images.iterdir()) / args.files
    pdf_bytes = (pdf / "doc.pdf").stat().st_size
    version = C.connect(args.redis_url).info()["redis_version"]
    print(f"{args.files} images, {img_bytes / 1024:.1f} KiB each; one PDF of {args.pages} "
          f"pages, {pdf_bytes / 1024:.0f} KiB; Redis {version}")
    rows = []
    for label, folder in ((f"{args.files} distinct images", images),
                          (f"1 PDF x {args.pages} pages", pdf)):
        for how, stores in (("reference", Stores([FolderStore("bench", work)])),
                            ("upload", Stores())):
            items, per_item, rate = measure(args.redis_url, folder, stores, args.repeat)
            rows.append((label, how, items, round(per_item), round(rate)))
    print(C.table(("set", "inputs", "items", "Redis bytes / queued item", "enqueue items/s"),
                  rows))


if __name__ == "__main__":
    main()
