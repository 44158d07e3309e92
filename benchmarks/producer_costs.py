"""Producer costs that should follow a job's own work, side by side in one run.

- upload: enqueue rate of one-item uploaded jobs with ~1 k and ~8 k of this producer's jobs
  pending (no worker runs, so none ends); the ratio should stay near 1 (under 1.5).
- split: split_prepared over 100 k and 400 k uploaded blobs; linear means a ratio near 4.
- refs: items/s enqueueing distinct small PNGs by reference (a folder store), default
  100 k files (`--files N` for fewer); the target is 20,000/s or more.
- first job: seconds from the call to the first job queued in Redis, for a set of 1 M pages
  (references to a few many-page PDFs, hard links of one; `--quick`: 100 k pages), and the
  producer's peak RSS over the whole set.

Each measurement runs in a child process of its own, so its peak RSS is its own. Redis is
a private redis-server on a free port (or `--redis-url`, a db that is FLUSHED), so nothing
else shares the figures; the temporary inputs are removed at the end.

    .venv/bin/python benchmarks/producer_costs.py            # a few minutes on 2 cores
    .venv/bin/python benchmarks/producer_costs.py --quick    # under a minute

benchmarks/costs.py runs these phases (`_run`) beside the other issue-28 figures.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import connect, redis_url_or_private, table  # noqa: E402

PREFIX = "vlmqbench"


def _png(i: int) -> bytes:
    """A distinct tiny PNG (852 bytes: 16 x 16, stored): its pixels spell `i`."""
    from PIL import Image

    im = Image.new("RGB", (16, 16), (i % 251, (i // 251) % 251, (i // 63001) % 251))
    im.putpixel((i % 16, (i // 16) % 16), (255, 255, 255))
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=0)
    return buf.getvalue()


def _write_pngs(folder: Path, n: int, per_dir: int = 1000) -> None:
    for i in range(n):
        sub = folder / f"d{i // per_dir:04d}"
        if i % per_dir == 0:
            sub.mkdir(parents=True, exist_ok=True)
        (sub / f"{i:07d}.png").write_bytes(_png(i))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _client(url: str, **kw: Any) -> Any:
    from vlmq.producer.client import Client

    return Client(url, prefix=PREFIX, allow_eviction=True, **kw)


# --- the measurements, each in a child ---------------------------------------------------


def phase_upload(url: str, work: Path, low: int, high: int, timed: int) -> dict[str, Any]:
    """Enqueue one-item uploaded jobs until `low` pending, time `timed` more; then on to
    `high` pending, time `timed` more."""
    files = work / "upload"
    files.mkdir()
    total = high + timed
    paths = []
    for i in range(total):
        p = files / f"{i:06d}.png"
        p.write_bytes(_png(1_000_000 + i))
        paths.append(p)
    client = _client(url, max_pending_mb=1024)
    rates = {}
    at = 0
    for mark in (low, high):
        while at < mark - timed // 2:
            client.caption([paths[at]])
            at += 1
        t0 = time.perf_counter()
        for _ in range(timed):
            client.caption([paths[at]])
            at += 1
        rates[mark] = timed / (time.perf_counter() - t0)
    return {"jobs_s_low": rates[low], "jobs_s_high": rates[high],
            "pending": len(client.uploads.pending), "rss_mb": _rss_mb()}


def phase_split(sizes: list[int]) -> dict[str, Any]:
    from vlmq.producer.files import BlobSource
    from vlmq.producer.inputs import Prepared
    from vlmq.producer.job_sets import split_prepared
    from vlmq.shared.messages import Item

    out: dict[str, Any] = {}
    for n in sizes:
        prepared = Prepared()
        for i in range(n):
            sha = f"{i:064x}"
            prepared.blobs[sha] = BlobSource(Path(f"/x/{i}.png"), f"{i}.png", sha, 600)
            prepared.items.append(Item(kind="image", blob=sha, source=f"{i}.png"))
        t0 = time.process_time()
        parts = split_prepared(prepared, 500, max_bytes=256 * 1024 * 1024)
        out[str(n)] = {"s": time.process_time() - t0, "jobs": len(parts)}
    return out


def phase_refs(url: str, work: Path, files: int) -> dict[str, Any]:
    from vlmq.stores.backends import FolderStore, Stores

    folder = work / "refs"
    _write_pngs(folder, files)
    client = _client(url, stores=Stores([FolderStore("bench", folder)]))
    t0, c0 = time.perf_counter(), time.process_time()
    handle = client.submit_set("caption", [folder], recursive=True)
    took, cpu = time.perf_counter() - t0, time.process_time() - c0
    jobs = len(handle.jobs()) if hasattr(handle, "jobs") and callable(handle.jobs) else 1
    # Producer CPU as well as wall time: on a shared machine the wall figure is the load's.
    return {"items_s": files / took, "cpu_items_s": files / cpu, "s": took, "jobs": jobs,
            "rss_mb": _rss_mb()}


def phase_pages(url: str, work: Path, pages: int, per_pdf: int) -> dict[str, Any]:
    import pypdfium2 as pdfium
    from redis import Redis

    from vlmq.shared import constants as C
    from vlmq.stores.backends import FolderStore, Stores

    folder = work / "pages"
    folder.mkdir()
    pdf = pdfium.PdfDocument.new()
    for _ in range(per_pdf):
        pdf.new_page(200, 260)
    first = folder / "doc0000.pdf"
    pdf.save(str(first))
    pdf.close()
    for i in range(1, max(1, pages // per_pdf)):
        os.link(first, folder / f"doc{i:04d}.pdf")
    watch = Redis.from_url(url)
    queue = f"rq:queue:{C.DEFAULT_QUEUE['caption']}"
    seen: dict[str, float] = {}
    t0 = time.perf_counter()

    def poll() -> None:
        while "first" not in seen and "done" not in seen:
            if watch.llen(queue):
                seen["first"] = time.perf_counter() - t0
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    client = _client(url, stores=Stores([FolderStore("bench", folder)]))
    client.submit_set("caption", [folder])
    seen["done"] = time.perf_counter() - t0
    watcher.join(5)
    return {"first_s": seen.get("first"), "all_s": seen["done"], "pages": pages,
            "rss_mb": _rss_mb()}


def child(args: argparse.Namespace) -> None:
    work = Path(args.work)
    connect(args.url)  # flushed: each phase starts from an empty db
    if args.phase == "upload":
        out = phase_upload(args.url, work, args.low, args.high, args.timed)
    elif args.phase == "split":
        out = phase_split([100_000, 400_000] if not args.quick else [25_000, 100_000])
    elif args.phase == "refs":
        out = phase_refs(args.url, work, args.files)
    else:
        out = phase_pages(args.url, work, args.pages, args.per_pdf)
    print(json.dumps(out))


def _run(phase: str, url: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--phase", phase, "--url", url, "--work", str(work),
           "--files", str(args.files), "--pages", str(args.pages),
           "--per-pdf", str(args.per_pdf), "--low", str(args.low), "--high", str(args.high),
           "--timed", str(args.timed)] + (["--quick"] if args.quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{phase} failed:\n{proc.stderr[-4000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sets (under a minute)")
    parser.add_argument("--files", type=int, default=None,
                        help="distinct small files enqueued by reference (default 100000; "
                             "--quick 20000)")
    parser.add_argument("--pages", type=int, default=None,
                        help="pages in the first-job set (default 1000000; --quick 100000)")
    parser.add_argument("--per-pdf", type=int, default=10_000, help="pages per PDF")
    parser.add_argument("--low", type=int, default=1000, help="pending jobs, first figure")
    parser.add_argument("--high", type=int, default=8000, help="pending jobs, second figure")
    parser.add_argument("--timed", type=int, default=None,
                        help="jobs timed at each pending count (default 500; --quick 200)")
    parser.add_argument("--redis-url", default=None,
                        help="a Redis db to use; it is FLUSHED (default: a private server)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.files = args.files or (20_000 if args.quick else 100_000)
    args.pages = args.pages or (100_000 if args.quick else 1_000_000)
    args.timed = args.timed or (200 if args.quick else 500)
    if args.phase:
        child(args)
        return
    with redis_url_or_private(args.redis_url) as url, \
            tempfile.TemporaryDirectory(prefix="vlmq-producer-costs-") as tmp:
        figures: dict[str, dict[str, Any]] = {}
        for phase in ("upload", "split", "refs", "pages"):
            work = Path(tmp) / phase
            work.mkdir()
            figures[phase] = _run(phase, url, work, args)
            print(f"{phase}: {json.dumps(figures[phase])}", file=sys.stderr)
        connect(url)  # leave the db empty
    _report(figures, args)


def _report(f: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    up, sp, refs, pages = f["upload"], f["split"], f["refs"], f["pages"]
    small, big = sorted(sp, key=int)
    rows = [
        ["upload: one-item jobs/s", f"{up['jobs_s_low']:.0f} at {args.low} pending",
         f"{up['jobs_s_high']:.0f} at {args.high} pending",
         f"{up['jobs_s_low'] / up['jobs_s_high']:.2f} (target < 1.5)"],
        ["split_prepared CPU s", f"{sp[small]['s']:.3f} at {int(small):,} blobs",
         f"{sp[big]['s']:.3f} at {int(big):,} blobs",
         f"{sp[big]['s'] / max(sp[small]['s'], 1e-9):.2f} (linear: "
         f"{int(big) / int(small):.0f})"],
        ["by reference: items/s", f"{refs['items_s']:,.0f} wall, "
         f"{refs['cpu_items_s']:,.0f} per producer CPU s", f"{args.files:,} files, "
         f"{refs['jobs']} jobs", "target 20,000+"],
        ["first job queued (s)", f"{pages['first_s']:.2f}" if pages["first_s"] is not None
         else "-", f"all {pages['pages']:,} pages: {pages['all_s']:.1f} s", "target < 1"],
        ["producer peak RSS (MB)", f"refs {refs['rss_mb']:.0f}",
         f"pages {pages['rss_mb']:.0f}", f"upload {up['rss_mb']:.0f}"],
    ]
    print(table(["figure", "a", "b", "ratio / target"], rows))


if __name__ == "__main__":
    main()
