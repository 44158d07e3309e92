"""Shared set-up for the benchmark scripts: arguments, the model, inputs, a real worker run.

Benchmarks compare figures measured side by side in one run, never against fixed
numbers: this machine's speed says nothing about another's, but two paths timed on the
same items, model and machine minutes apart do say which is faster here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from PIL import Image, ImageDraw
from redis import Redis

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/5"
# The test suite claims dbs 9-15; a benchmark that flushed one would break a test run.
RESERVED_DBS = frozenset(range(9, 16))
VLMQ = str(Path(sys.executable).parent / "vlmq")
# Letter paper in PDF points; images are drawn at the size a page renders to, so every
# item has the same shape (as pages of one scanned batch do) and batch_generate's
# group-by-shape does not split the batch.
PAGE_PT = (612, 792)
COLORS = [(220, 40, 40), (40, 160, 60), (40, 70, 200), (230, 200, 40), (160, 60, 190),
          (30, 180, 190), (240, 130, 30), (90, 90, 90)]


def add_common_args(parser: argparse.ArgumentParser, *, items: int = 16,
                    max_tokens: int = 64, side: int = 224) -> None:
    parser.add_argument("--redis-url", default=None,
                        help="a Redis db to use; it is FLUSHED first (default: a private "
                             "redis-server on a free port)")
    parser.add_argument("--model", default=None,
                        help="model folder or hub id (default: build the tiny random-weight model)")
    parser.add_argument("--items", type=int, default=items,
                        help=f"items per job: half PDF pages, half images (default {items})")
    parser.add_argument("--max-tokens", type=int, default=max_tokens,
                        help=f"new tokens per item (default {max_tokens})")
    parser.add_argument("--side", type=int, default=side,
                        help=f"longest image side in px; keep ~224 on mlx[cpu] (default {side})")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where inputs and caches go (default: a fresh temp dir)")


@contextmanager
def redis_url_or_private(url: str | None) -> Iterator[str]:
    """`url` as given, else a private redis-server on a free port for the block: a
    benchmark on a shared db can be flushed mid-run by anything else that uses it."""
    if url is not None:
        yield url
        return
    from vlmq.worker.redis_server import start_private

    server = start_private()
    try:
        yield server.url
    finally:
        server.stop()


def print_header(model: str, items: int, side: int, detail: str) -> None:
    """What ran, on what: the first lines of every benchmark's output."""
    print(f"machine: {machine()}")
    print(f"model: {model}; {items} items ({items // 2} PDF pages + {items - items // 2} "
          f"images) at {side} px, {detail}")


def machine() -> str:
    """One line saying what ran the benchmark; figures mean nothing without it."""
    from vlmq.worker.model import blas

    blas.select()  # no-op when the script chose already; MLX loads next
    import mlx.core as mx

    try:
        import mlx_vlm

        vlm = mlx_vlm.__version__
    except (ImportError, AttributeError):
        vlm = "?"
    return (f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
            f"mlx {mx.__version__} ({mx.default_device()}), mlx-vlm {vlm}, "
            f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")


def ensure_model(model: str | None) -> str:
    """The given model (a name such as `reader` resolved to its folder), or the tiny
    random-weight one (built once, reused after)."""
    from vlmq.worker.model import names

    return names.resolve(model or names.TINY)


def resolve_model(name: str) -> str:
    """"bench" (built once, reused after), else the model as the worker reads it (a name
    such as `tiny` or `reader` resolved to its folder)."""
    from vlmq.cli.worker import default_cache_dir
    from vlmq.worker.model import names
    from vlmq.worker.model.tiny import build_tiny_model

    if name == "bench":
        folder = default_cache_dir() / "models" / f"{name}-qwen2_vl"
        return str(build_tiny_model(folder, arch="qwen2_vl", seed=0, size=name))
    return names.resolve(name)


def connect(redis_url: str, *, flush: bool = True) -> Redis:
    """Connect to the benchmark db; refuse the test suite's dbs, flush only this one."""
    path = urlparse(redis_url).path.strip("/")
    db = int(path) if path.isdigit() else 0
    if db in RESERVED_DBS:
        raise SystemExit(f"db {db} is reserved for the test suite (9-15); use 5 or 6")
    redis = Redis.from_url(redis_url)
    redis.ping()
    if flush:
        redis.flushdb()
    return redis


# ---------------------------------------------------------------- inputs


def _page(i: int, size: tuple[int, int]) -> Image.Image:
    """A page that differs from every other one even at 224 px: colour, shapes, text."""
    w, h = size
    img = Image.new("RGB", size, COLORS[i % len(COLORS)])
    draw = ImageDraw.Draw(img)
    k = (i * 37) % 97
    draw.rectangle([w // 8 + k % 30 * w // 200, h // 8, w // 2 + k % 40 * w // 200,
                    h // 2 + k % 50 * h // 300], fill=(255, 255, 255))
    draw.ellipse([w // 3, h // 2 + k % 20 * h // 300, w - w // 12, h - h // 12],
                 fill=COLORS[(i * 3 + 1) % len(COLORS)])
    for line in range(i % 5 + 2):
        y = h // 12 + line * h // 40
        draw.line([w // 10, y, w // 10 + (k + 13 * line) % (w // 2), y], fill=(0, 0, 0),
                  width=max(1, h // 200))
    draw.text((w // 10, h - h // 8), f"item {i + 1}", fill=(0, 0, 0))
    return img


def make_inputs(folder: Path, items: int, side: int) -> list[Path]:
    """A PDF of items//2 pages plus enough images to make `items` visually distinct items."""
    folder.mkdir(parents=True, exist_ok=True)
    n_pages = items // 2
    out: list[Path] = []
    if n_pages:
        pages = [_page(i, PAGE_PT) for i in range(n_pages)]
        pdf = folder / "doc.pdf"
        pages[0].save(pdf, "PDF", save_all=True, append_images=pages[1:], resolution=72.0)
        out.append(pdf)
    img_size = (round(side * PAGE_PT[0] / PAGE_PT[1]), side)
    for i in range(n_pages, items):
        p = folder / f"img{i:03d}.png"
        _page(i, img_size).save(p)
        out.append(p)
    return out


def item_images(paths: Sequence[Path], side: int) -> list[Image.Image]:
    """Every item as the exact pixels the worker would hand its processor."""
    from vlmq.worker.prep import decode

    images: list[Image.Image] = []
    for path in paths:
        data = path.read_bytes()
        if path.suffix.lower() == ".pdf":
            import pypdfium2 as pdfium

            doc = pdfium.PdfDocument(data)
            n = len(doc)
            doc.close()
            images.extend(decode.render_pdf_page(data, page, side) for page in range(1, n + 1))
        else:
            images.append(decode.decode_image(data, side))
    return images


# ---------------------------------------------------------------- a real worker


@dataclass
class JobRun:
    """One job's figures, as the worker reported them (model load excluded)."""

    job_id: str
    items: int
    ok: int
    tokens: int
    wall_s: float  # worker-side: job taken -> last item written
    cache_hits: int
    last_item_at: float  # epoch seconds (its end event's stream id) of the last item
    timings: dict[str, float] = field(default_factory=dict)  # per-item timings, summed

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


@dataclass
class WorkerRun:
    """A burst worker subprocess that ran one or more jobs."""

    name: str
    max_batch: int
    started_at: float  # epoch seconds, just before the process was spawned
    process_s: float  # spawn -> exit: interpreter, imports, model load, work, shutdown
    jobs: list[JobRun]
    stats: dict[str, str]
    output: str
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def to_last_item_s(self) -> float:
        """Spawn -> last item written: what a user waiting on a fresh worker sees."""
        return max(j.last_item_at for j in self.jobs) - self.started_at

    def stat(self, name: str) -> int:
        return int(float(self.stats.get(name, "0")))


def enqueue_job(redis_url: str, inputs: Sequence[Path], *, queue: str, max_tokens: int,
                side: int) -> str:
    """One OCR job over every input (PDF pages and images): the bulk case vlmq is for."""
    from vlmq.producer.client import Client

    with Client(redis_url) as client:
        # Result cache off: repeated runs measure generation (and the vision cache).
        return client.ocr(list(inputs), queue=queue, max_side=side, max_tokens=max_tokens,
                          result_cache="off").id


def job_run(redis_url: str, job_id: str) -> JobRun:
    from vlmq.producer.client import Client
    from vlmq.shared.results import read_end

    with Client(redis_url) as client:
        job = client.job(job_id)
        summary = job.summary() or {}
        if job.status() != "finished" or not summary:
            raise RuntimeError(f"job {job_id} ended {job.status()}: {job.error()}")
        timings: dict[str, float] = {}
        for item in job.results():
            for k, v in item.timings.items():
                timings[k] = timings.get(k, 0.0) + float(v)
        # The end event is written with the job's last item (end_job.lua), and kept as
        # long as the job: its stream id dates the last item whenever this is read.
        end = read_end(client.redis, client.keys, job_id)
        if end is None or not isinstance(end.get("id"), str):
            raise RuntimeError(f"job {job_id} keeps no end event")
        last_ms = int(end["id"].split("-")[0])
    return JobRun(job_id=job_id, items=int(summary["items"]), ok=int(summary["ok"]),
                  tokens=int(summary["completion_tokens"]), wall_s=float(summary["wall_s"]),
                  cache_hits=int(summary["cache_hits"]), last_item_at=last_ms / 1000,
                  timings=timings)


def worker_cmd(redis_url: str, model: str, queue: str, *, max_batch: int | None,
               cache_dir: Path, name: str, burst: bool = True,
               fixed: bool = False) -> list[str]:
    """`max_batch` None: the worker's default (its batch sizes itself); `fixed`: exactly
    max_batch rows (--fixed-batch)."""
    cmd = [VLMQ, "--redis-url", redis_url, "worker", "--model", model, "--queues", queue,
           "--cache-dir", str(cache_dir), "--name", name]
    if max_batch is not None:
        cmd += ["--max-batch", str(max_batch)]
    if fixed:
        cmd.append("--fixed-batch")
    return [*cmd, "--burst"] if burst else cmd


def worker_env(cache_root: Path) -> dict[str, str]:
    from vlmq.worker.model import blas

    # A worker picks its own BLAS threads unless the harness set them for every system.
    return {**blas.child_env(), "VLMQ_CACHE": str(cache_root), "PYTHONUNBUFFERED": "1"}


def read_stats(redis: Redis, name: str) -> dict[str, str]:
    """The worker's stats hash; it outlives the worker by ~30 s."""
    from vlmq.shared.keys import Keys

    raw = redis.hgetall(Keys.from_env().worker_stats(name))
    return {k.decode(): v.decode() for k, v in raw.items()}


def run_burst_worker(redis_url: str, model: str, inputs: Sequence[Path], *, max_batch: int,
                     cache_dir: Path, max_tokens: int, side: int, label: str,
                     timeout: float = 600) -> WorkerRun:
    """Enqueue one job, then run `vlmq worker --burst` on it as a subprocess, as in production.

    The job is queued before the worker starts, so the worker sees all items at once.
    """
    tag = f"{label}-{uuid.uuid4().hex[:6]}"
    queue = f"bench-{tag}"
    job_id = enqueue_job(redis_url, inputs, queue=queue, max_tokens=max_tokens, side=side)
    cmd = worker_cmd(redis_url, model, queue, max_batch=max_batch, cache_dir=cache_dir,
                     name=tag)
    started = time.time()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=worker_env(cache_dir.parent), capture_output=True,
                          text=True, timeout=timeout, check=False)
    process_s = time.perf_counter() - t0
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"worker exited {proc.returncode}:\n{output[-4000:]}")
    redis = Redis.from_url(redis_url)
    stats = read_stats(redis, tag)
    redis.close()
    return WorkerRun(name=tag, max_batch=max_batch, started_at=started, process_s=process_s,
                     jobs=[job_run(redis_url, job_id)], stats=stats, output=output)


# ---------------------------------------------------------------- printing


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain Markdown table, so output can be pasted into benchmarks/README.md."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
             for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def stop(proc: subprocess.Popen[str], *, signum: int = signal.SIGTERM,
         timeout: float = 60.0) -> None:
    """Stop a worker (or server) the way an operator would, killing it if it hangs."""
    proc.send_signal(signum)
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def emit_json(figures: dict[str, Any], json_out: Path | None) -> None:
    """The last line of every harness: its figures as one JSON line (also to a file)."""
    line = json.dumps(figures)
    if json_out:
        json_out.write_text(line + "\n")
    print(line)
