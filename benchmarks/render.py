"""PDF page rendering: one PDFium lock in the worker process (the old path) against the
worker's pool of render processes (worker/prep/render_pool.py), on a 40-page job.

Both paths render every page at the worker's OCR size (1288 px) from the same prepare
threads, so the figures compare only where rendering runs. Run:

    .venv/bin/python benchmarks/render.py [--pages 40] [--threads 2] [--ops 20000]

No Redis or model is needed. Pages are vector-heavy (`--ops` filled shapes each, like a
dense chart or CAD page), so rendering takes real CPU time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.pdf_craft import build_pdf
from vlmq.shared.blobs import sha256_hex
from vlmq.worker.prep import decode
from vlmq.worker.prep.render_pool import RenderPool

SIDE = 1288


def vector_pdf(pages: int, ops: int, seed: int) -> bytes:
    """`pages` pages of `ops` small coloured rectangles each (different per page)."""
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>", b""]
    kids = []
    for p in range(pages):
        lines = []
        for i in range(ops):
            k = (i * 7919 + p * 104729 + seed) % 100003
            lines.append(b"%.2f %.2f %.2f rg %d %d %d %d re f" % (
                (k % 97) / 97, (k % 89) / 89, (k % 83) / 83,
                k % 600, (k // 7) % 780, 2 + k % 9, 2 + k % 7))
        data = zlib.compress(b"\n".join(lines), 6)
        page_no, stream_no = len(objs) + 1, len(objs) + 2
        kids.append(b"%d 0 R" % page_no)
        objs.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R >>"
                    % stream_no)
        objs.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(data) + data
                    + b"\nendstream")
    objs[1] = b"<< /Type /Pages /Kids [" + b" ".join(kids) + b"] /Count %d >>" % pages
    return build_pdf(objs)


def run(render: Callable[[bytes, int, str], object], docs: list[bytes], threads: int) -> float:
    jobs = [(d, sha256_hex(d), page) for d in docs for page in range(1, _pages(d) + 1)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda j: render(j[0], j[2], j[1]), jobs))
    return time.perf_counter() - t0


def _pages(data: bytes) -> int:
    return int(data.split(b"/Count ")[1].split(b" ")[0].split(b">")[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2, help="prepare threads (worker default: "
                                                           "cores, at most 4)")
    ap.add_argument("--ops", type=int, default=20000, help="filled shapes per page")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    one = [vector_pdf(args.pages, args.ops, seed=1)]
    halves = [vector_pdf(args.pages // 2, args.ops, seed=s) for s in (2, 3)]
    print(f"# {args.pages} pages, {args.ops} shapes/page, {args.threads} prepare threads, "
          f"{os.cpu_count()} cores, {args.runs} runs (medians)")

    def in_process(data: bytes, page: int, key: str) -> object:
        return decode.render_pdf_page(data, page, SIDE, doc_key=key)

    pool = RenderPool(args.threads, mem_mb=1024, timeout_s=600)
    try:
        pool_render = lambda d, p, k: pool.render(d, p, SIDE, doc_key=k)  # noqa: E731
        run(pool_render, halves[:1], args.threads)  # start the children (not timed)
        rows: dict[str, list[float]] = {}
        for _ in range(args.runs):
            n, half = args.pages, args.pages // 2
            for name, fn, docs in (
                (f"one {n}-page PDF, in-process lock", in_process, one),
                (f"one {n}-page PDF, render processes", pool_render, one),
                (f"two {half}-page PDFs, in-process lock", in_process, halves),
                (f"two {half}-page PDFs, render processes", pool_render, halves),
            ):
                decode.clear_pdf_cache()
                rows.setdefault(name, []).append(run(fn, docs, args.threads))
    finally:
        pool.close()
    base: dict[str, float] = {}
    for name, times in rows.items():
        med = statistics.median(times)
        key = name.split(",")[0]
        if key not in base:
            base[key] = med
        print(f"{name:40s} {med:7.2f} s  {args.pages / med:6.1f} pages/s  "
              f"x{base[key] / med:.2f}")


if __name__ == "__main__":
    main()
