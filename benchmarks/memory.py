"""Memory of a bulk run: the producer's peak RSS, and Redis before, during and after.

1. Producer peak RSS: `vlmq enqueue ocr` over a folder of 20 PDFs of 20 MB each (one page
   of incompressible image data each), as a subprocess (its own ru_maxrss).
2. Redis used_memory while a 10,000-page run goes through a real worker (the tiny model):
   before the enqueue, its peak during the run, when the last job has ended, and once the
   inputs' grace (--keep-inputs) has passed.

Runs its own redis-server on a free port (used_memory is server-wide: a shared Redis that
others use would blur it), or --redis-url (a db that is FLUSHED).
"""

from __future__ import annotations

import argparse
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

from vlmq.worker.redis_server import start_private

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

if __name__ == "__main__":
    main()
