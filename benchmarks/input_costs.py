"""What one input costs the worker: a deep TIFF page, a decode behind it, a huge reference.

Three figures, each a cost that one input must not pass on to others:
1. TIFF page N against page 1: a `--tiff-pages` page TIFF (20,000 by default, written
   directory by directory), its page 1 and its last page decoded in process, each from a
   fresh document (the page index read again) and from the kept one, plus the producer's
   check of the whole file (every page, once) at 1/10 and at full size.
2. The wait of a one-image job behind a TIFF job: a real worker (the tiny model) takes an
   OCR job of the TIFF's last `--tiff-job-pages` pages, then a one-image caption job is
   enqueued; its enqueue-to-finished time against the same job on the idle worker.
3. The worker's peak RSS for one referenced file: a small real PNG followed by a
   `--sparse-gib` GiB sparse tail, by reference through a folder store; the growth of
   the worker's (and its render processes') peak RSS over a warm-up with the PNG alone,
   against the size of the decoded image.

Run it against another tree (the code before a change) with that tree first on the path:
`PYTHONPATH=/tmp/before .venv/bin/python benchmarks/input_costs.py` (vlmq/ in it).

    .venv/bin/python benchmarks/input_costs.py
    .venv/bin/python benchmarks/input_costs.py --parts 1     # part 1 only (seconds)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.support.tiff_craft

import common
from PIL import Image

from tests.support.tiff_craft import LZW, best_time, encoded_strip, many_pages


def tiff_pages(pages: int, side: int) -> dict[str, float]:
    """Part 1: in-process decode of page 1 and page N, and the producer's check."""
    from vlmq.producer.files import check_file
    from vlmq.worker.prep import decode

    last = encoded_strip(Image.new("L", (8, 8), 99), "tiff_lzw")
    data = many_pages(pages, strips=[(last, LZW)])
    out: dict[str, float] = {}
    for page in (1, pages):
        out[f"fresh_p{page}_s"] = best_time(lambda p=page: decode.decode_tiff_page(data, p, side),
                                            repeat=3)
        key = f"bench-{pages}"
        decode.decode_tiff_page(lambda: data, 1, side, doc_key=key)  # the document kept
        out[f"kept_p{page}_s"] = best_time(
            lambda p=page, k=key: decode.decode_tiff_page(lambda: data, p, side, doc_key=k),
            repeat=3)
    with tempfile.TemporaryDirectory() as tmp:
        for n in (pages // 10, pages):
            path = Path(tmp) / f"t{n}.tif"
            path.write_bytes(many_pages(n))
            t0 = time.perf_counter()
            check_file(path)
            out[f"check_{n}_s"] = time.perf_counter() - t0
    return out


def _start(redis_url: str, model: str, tmp: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [common.VLMQ, "--redis-url", redis_url, "worker", "--model", model, "--name",
         f"bench-{os.getpid()}", "--cache-dir", str(tmp / "vision"), "--queues",
         "caption,ocr", *args], env=common.worker_env(tmp / "cache"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True)


def _caption_s(client: Any, image: Path) -> float:
    t0 = time.perf_counter()
    job = client.caption([image], max_tokens=4, result_cache="off")
    status = job.wait(timeout=1800)
    if status != "finished":
        raise RuntimeError(f"caption job {job.id} {status}: {job.error()}")
    return time.perf_counter() - t0


def behind_tiff(redis_url: str, model: str, tmp: Path, pages: int, job_pages: int
                ) -> dict[str, float]:
    """Part 2: a one-image job alone, then queued behind a TIFF job of deep pages."""
    from vlmq.producer.client import Client

    fax = tmp / "deep.tif"
    # 32 px: the smallest the vision processor takes is 28 (smaller pages fail at once).
    fax.write_bytes(many_pages(pages, size=(32, 32)))
    images = [tmp / f"photo{i}.png" for i in range(3)]
    for i, p in enumerate(images):
        common._page(i, (96, 96)).save(p)
    proc = _start(redis_url, model, tmp)
    try:
        with Client(redis_url) as client:
            _caption_s(client, images[0])  # the worker is up, its children too
            alone = _caption_s(client, images[1])
            t0 = time.perf_counter()
            tiff_job = client.ocr([fax], pages=f"{pages - job_pages + 1}-{pages}",
                                  max_tokens=4, result_cache="off")
            enqueue_s = time.perf_counter() - t0
            while not any(True for _ in tiff_job.results()):  # running: a page is done
                time.sleep(0.05)
            behind = _caption_s(client, images[2])
            tiff_done = tiff_job.status() == "finished"
            tiff_job.cancel()
    finally:
        common.stop(proc, timeout=10)
    return {"alone_s": alone, "behind_s": behind, "tiff_enqueue_s": enqueue_s,
            "tiff_job_done_first": float(tiff_done)}


def _hwm(pid: int) -> int:
    """Peak RSS (VmHWM) of a process, bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def sparse_ref(redis_url: str, model: str, tmp: Path, gib: float) -> dict[str, float]:
    """Part 3: peak RSS growth for a PNG with a sparse tail, by reference."""
    from vlmq.producer.client import Client
    from vlmq.stores.backends import FolderStore, Stores

    store = tmp / "store"
    store.mkdir()
    side = 1024
    for i in range(3):  # same size, different pixels: each one a full decode and tower run
        common._page(5 + i, (side, side)).save(store / f"plain{i}.png")
    sparse = store / "sparse.png"
    sparse.write_bytes((store / "plain2.png").read_bytes())
    (store / "plain2.png").unlink()
    os.truncate(sparse, sparse.stat().st_size + int(gib * (1 << 30)))
    decoded = side * side * 3
    mem_mb = str(max(1024, int(gib * 1024) + 512))  # the reference must fit the limit
    # One prep thread and one render process: the warm-up ran on the very thread (malloc
    # arena) and process the sparse file then runs on.
    proc = _start(redis_url, model, tmp, "--store", f"shared={store}", "--render-mem-mb",
                  mem_mb, "--render-procs", "1", "--prep-threads", "1")
    try:
        with Client(redis_url, stores=Stores([FolderStore("shared", store)])) as client:
            for name in ("plain0.png", "plain1.png"):  # warm: imports, tower, child
                job = client.caption([store / name], max_tokens=4, result_cache="off")
                assert job.wait(timeout=600) == "finished", job.error()
            procs = [proc.pid, *_children(proc.pid)]
            before = {p: _hwm(p) for p in procs}
            t0 = time.perf_counter()
            job = client.caption([sparse], max_tokens=4, result_cache="off")
            status = job.wait(timeout=1800)
            took = time.perf_counter() - t0
            after = {p: _hwm(p) for p in procs if os.path.exists(f"/proc/{p}")}
            ok = status == "finished" and all(r.ok for r in job.results())
    finally:
        common.stop(proc, timeout=10)
    worker = after.get(proc.pid, 0) - before[proc.pid]
    kids = max((after[p] - before[p] for p in after if p != proc.pid), default=0)
    return {"decoded_mb": decoded / 1e6, "worker_growth_mb": worker / 1e6,
            "child_growth_mb": kids / 1e6, "worker_peak_mb": after.get(proc.pid, 0) / 1e6,
            "file_gb": sparse.stat().st_size / 1e9, "ok": float(ok), "job_s": took}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default=None,
                        help="a Redis db, FLUSHED first (default: a private redis-server)")
    parser.add_argument("--model", default=None, help="default: the tiny test model")
    parser.add_argument("--tiff-pages", type=int, default=20_000)
    parser.add_argument("--tiff-job-pages", type=int, default=2_000)
    parser.add_argument("--sparse-gib", type=float, default=1.0)
    parser.add_argument("--side", type=int, default=1288, help="TIFF page max side")
    parser.add_argument("--parts", default="1,2,3",
                        help="which figures: 1 TIFF pages, 2 the wait, 3 the RSS")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    from vlmq.worker.prep import decode

    print(f"vlmq from {Path(decode.__file__).parent.parent}")
    parts = {int(p) for p in args.parts.split(",")}
    figures: dict[str, float] = {}
    if 1 in parts:
        _print_tiff(figures, tiff_pages(args.tiff_pages, args.side), args.tiff_pages)
    if parts & {2, 3}:
        model = common.ensure_model(args.model)
        with common.redis_url_or_private(args.redis_url) as url, \
                tempfile.TemporaryDirectory() as tmp:
            if 2 in parts:
                common.connect(url)
                (Path(tmp) / "b").mkdir()
                _print_wait(figures, behind_tiff(url, model, Path(tmp) / "b", args.tiff_pages,
                                                 args.tiff_job_pages))
            if 3 in parts:
                common.connect(url)
                (Path(tmp) / "r").mkdir()
                _print_ref(figures, sparse_ref(url, model, Path(tmp) / "r", args.sparse_gib))
    common.emit_json(figures, args.json_out)


def _print_tiff(figures: dict[str, float], t: dict[str, float], n: int) -> None:
    figures.update({f"tiff_{k}": v for k, v in t.items()})
    print(common.table(["TIFF page", "fresh document s", "kept document s"],
                       [[1, t["fresh_p1_s"], t["kept_p1_s"]],
                        [n, t[f"fresh_p{n}_s"], t[f"kept_p{n}_s"]]]))
    print(f"page {n} / page 1: fresh {t[f'fresh_p{n}_s'] / t['fresh_p1_s']:.2f}, "
          f"kept {t[f'kept_p{n}_s'] / t['kept_p1_s']:.2f}")
    small, big = n // 10, n
    print(f"producer check: {small} pages {t[f'check_{small}_s']:.2f} s, {big} pages "
          f"{t[f'check_{big}_s']:.2f} s (x{t[f'check_{big}_s'] / t[f'check_{small}_s']:.1f} "
          "for x10 the pages)")


def _print_wait(figures: dict[str, float], b: dict[str, float]) -> None:
    figures.update({f"wait_{k}": v for k, v in b.items()})
    print(f"one-image job: alone {b['alone_s']:.2f} s, behind the TIFF job "
          f"{b['behind_s']:.2f} s (x{b['behind_s'] / b['alone_s']:.1f})")


def _print_ref(figures: dict[str, float], r: dict[str, float]) -> None:
    figures.update({f"ref_{k}": v for k, v in r.items()})
    print(f"referenced {r['file_gb']:.2f} GB file (decoded image {r['decoded_mb']:.1f} MB): "
          f"worker peak RSS +{r['worker_growth_mb']:.1f} MB (peak {r['worker_peak_mb']:.0f} "
          f"MB), render process +{r['child_growth_mb']:.1f} MB; item ok: {bool(r['ok'])}, "
          f"{r['job_s']:.1f} s")


if __name__ == "__main__":
    main()
