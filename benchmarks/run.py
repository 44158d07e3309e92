"""vlmq against the ways OCR/caption services are built today, on the workload they see.

Eight jobs of 1, 2, 3, 4, 6, 8, 12 and 24 items arrive at fixed offsets (the biggest
first, as when one producer drops a batch and others trickle in). Items mix PDF pages and
photos of three sizes. Every system gets the same items, arrivals, prompt, max_tokens,
greedy decoding and repetition guard (off for all by default, `--guard`: the worker's
default guard in all), in this one run:

  A  a plain RQ service: one job at a time, `mlx_vlm.generate` per item, model loaded once;
  B  per-job batching: one `mlx_vlm.batch_generate` call per job, in arrival order;
  C  the vlmq Engine fed the same arrivals in-process (no Redis);
  D  vlmq end to end: client enqueue, real Redis, one `vlmq worker` process;
  E  mlx-vlm's own server (`python -m mlx_vlm.server`, continuous batching), one
     streamed OpenAI-style HTTP request per item from concurrent clients (no guard:
     its HTTP API takes no custom stopping rule);
  D_ref  D with `--blas reference` (bench model only): what Linux users got before.

    python benchmarks/run.py --ocr --model bench      # the headline: OCR-shaped work
    python benchmarks/run.py --quick --model bench    # CI-sized
    python benchmarks/run.py --model tiny --json-out out.json

Prints a table, then one JSON line. Nothing here is asserted: ratios measured side by
side in one run say which path is faster on this machine, not how fast another is.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter
from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C
import server_e

from vlmq.worker.engine.repetition import RepetitionGuard

JOB_SIZES = (24, 1, 12, 2, 8, 3, 6, 4)  # in arrival order
SMALL = 4  # the 4 smallest jobs: what a latency-sensitive producer sends
PHOTO_SIZES = ((224, 168), (126, 224), (112, 112))  # landscape, portrait, square
ENQUEUE_ITEMS = 5000
OCR_TOKENS, OCR_SIDE = 256, 448  # --ocr: a page of text, pages rendered at 448 px


@dataclass
class Job:
    size: int
    offset: float
    paths: list[Path]
    images: list[Image.Image] = field(default_factory=list)


@dataclass
class SystemRun:
    name: str
    wall_s: float
    items: int
    tokens: int
    latencies: list[float]  # per job, arrival -> last item, in arrival order
    sizes: list[int]        # items per job, same order
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def items_s(self) -> float:
        return self.items / self.wall_s

    def p(self, q: float, small: bool = False) -> float:
        lat = self.latencies
        if small:
            order = sorted(range(len(self.sizes)), key=lambda i: self.sizes[i])[:SMALL]
            lat = [lat[i] for i in order]
        return float(np.percentile(lat, q))

    def figures(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall_s, 3), "items": self.items, "tokens": self.tokens,
                "tok_s": round(self.tok_s, 2), "items_s": round(self.items_s, 3),
                "p50_s": round(self.p(50), 3), "p95_s": round(self.p(95), 3),
                "small_p50_s": round(self.p(50, True), 3),
                "small_p95_s": round(self.p(95, True), 3),
                "latencies_s": [round(x, 3) for x in self.latencies], **self.extra}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer new tokens and tighter arrivals (a few minutes on 2 cores)")
    p.add_argument("--ocr", action="store_true",
                   help=f"OCR-shaped headline: {OCR_TOKENS} new tokens, {OCR_SIDE} px pages, "
                        "the staggered jobs (slow on 2 cores)")
    p.add_argument("--guard", action="store_true",
                   help="the worker's default repetition guard in every system (E cannot "
                        "have it); default: off in all")
    p.add_argument("--model", default="tiny",
                   help="tiny, bench (random-weight models built offline) or a model folder")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--redis-url", default=None,
                   help="a Redis db to use; it is FLUSHED first (default: a private "
                        "redis-server on a free port, so nothing else can flush it mid-run)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"new tokens per item (default 16 with --quick, {OCR_TOKENS} with "
                        "--ocr, else 64)")
    p.add_argument("--max-batch", type=int, default=16,
                   help="rows for C, D and E (its --max-num-seqs; default 16)")
    p.add_argument("--defaults", action="store_true",
                   help="every system at its own defaults, no tuning flag: D without "
                        "--max-batch (its batch sizes itself), E without --max-num-seqs "
                        "(unbounded), no BLAS thread count set (systems D,E unless given)")
    p.add_argument("--sweep", default=None, metavar="N,N,...",
                   help="also run D at each fixed --max-batch N (--fixed-batch), to compare "
                        "the batch D chose with the best fixed one")
    p.add_argument("--prep-threads", type=int, default=None,
                   help="D's --prep-threads and C's pool (default: the worker's default)")
    p.add_argument("--spacing", type=float, default=None,
                   help="seconds between arrivals (default 0.25 with --quick, else 0.5)")
    p.add_argument("--systems", default="A,B,C,D,E,D_ref",
                   help="which systems to run (comma-separated; default all)")
    p.add_argument("--sizes", default=None,
                   help="job sizes in arrival order instead of 24,1,12,2,8,3,6,4 (for tests)")
    p.add_argument("--side", type=int, default=None,
                   help=f"longest side in px (default {OCR_SIDE} with --ocr, else 224)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where inputs and caches go (default: a fresh temp dir)")
    p.add_argument("--blas-threads", type=int, default=None,
                   help="OpenBLAS threads for every system (default: what a worker picks, "
                        "cores minus prep threads, at least 1)")
    p.add_argument("--no-flush", action="store_true",
                   help="use the db as it is, unflushed (any db; the test suite passes its own)")
    p.add_argument("--no-enqueue-bench", action="store_true",
                   help=f"skip the {ENQUEUE_ITEMS}-item enqueue throughput figure")
    args = p.parse_args(argv)
    if args.defaults:
        args.max_batch = None
        if "--systems" not in " ".join(argv or sys.argv[1:]):
            args.systems = "D,E"
    if args.quick and args.ocr:
        p.error("--quick and --ocr are two different workloads: pick one")
    if args.side is None:
        args.side = OCR_SIDE if args.ocr else 224
    return args


# ---------------------------------------------------------------- inputs


def _photo(i: int, size: tuple[int, int]) -> Image.Image:
    """A photo-like picture: smooth noise plus shapes, distinct for every i."""
    rng = np.random.default_rng(1000 + i)
    w, h = size
    small = rng.integers(0, 256, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize(size, Image.Resampling.BILINEAR)
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, w // 2)), int(rng.integers(0, h // 2))
        draw.ellipse([x0, y0, x0 + w // 3, y0 + h // 3],
                     fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    return img.filter(ImageFilter.SMOOTH)


def make_jobs(folder: Path, sizes: Sequence[int], spacing: float, side: int) -> list[Job]:
    """Each job: its half of PDF pages (one PDF per job), the rest photos of 3 sizes."""
    from PIL import Image as PILImage

    folder.mkdir(parents=True, exist_ok=True)
    jobs: list[Job] = []
    counter = 0
    for j, n in enumerate(sizes):
        paths: list[Path] = []
        n_pages = n // 2
        if n_pages:
            pages = [C._page(counter + k, C.PAGE_PT) for k in range(n_pages)]
            pdf = folder / f"job{j}.pdf"
            pages[0].save(pdf, "PDF", save_all=True, append_images=pages[1:], resolution=72.0)
            paths.append(pdf)
            counter += n_pages
        for k in range(n - n_pages):
            photo = _photo(counter, PHOTO_SIZES[(j + k) % len(PHOTO_SIZES)])
            path = folder / f"job{j}-photo{k}.jpg"
            photo.save(path, quality=90)
            paths.append(path)
            counter += 1
        jobs.append(Job(n, j * spacing, paths))
    for job in jobs:  # the exact pixels a worker hands its processor
        job.images = C.item_images(job.paths, side)
        assert len(job.images) == job.size
        assert all(isinstance(im, PILImage.Image) for im in job.images)
    return jobs


# ---------------------------------------------------------------- A, B, C (in-process)


def _arrivals(jobs: Sequence[Job], t0: float) -> Callable[[Job], None]:
    def wait(job: Job) -> None:
        delay = t0 + job.offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    return wait


def _generate_guarded(model: Any, processor: Any, prompt_text: str, img: Image.Image,
                      max_tokens: int, guard: RepetitionGuard) -> tuple[int, bool]:
    """`generate` for one item, stopped where the engine would cut a loop: (tokens
    generated, cut). stream_generate is what `generate` runs; leaving it early stops it."""
    from mlx_vlm import stream_generate

    tokens: list[int] = []
    for r in stream_generate(model, processor, prompt_text, image=[img],
                             max_tokens=max_tokens, temperature=0.0):
        if r.finish_reason is not None:  # the closing result lists every token, EOS too
            return len(r.token_ids or tokens), False
        tokens.append(int(r.token))
        if guard.find(tokens) is not None:
            return len(tokens), True
    return len(tokens), False


def run_a(model: Any, processor: Any, prompt_text: str, jobs: Sequence[Job],
          max_tokens: int, guard: RepetitionGuard | None) -> SystemRun:
    """A plain RQ service: FIFO jobs, one `generate` per item."""
    from mlx_vlm import generate

    t0 = time.perf_counter()
    wait = _arrivals(jobs, t0)
    tokens, cuts, lat = 0, 0, []
    for job in jobs:
        wait(job)
        for img in job.images:
            if guard is None:
                r = generate(model, processor, prompt_text, image=[img],
                             max_tokens=max_tokens, temperature=0.0)
                tokens += len(r.token_ids or [])
            else:
                n, cut = _generate_guarded(model, processor, prompt_text, img, max_tokens,
                                           guard)
                tokens, cuts = tokens + n, cuts + cut
        lat.append(time.perf_counter() - (t0 + job.offset))
    return SystemRun("A plain RQ (generate per item)", time.perf_counter() - t0,
                     sum(j.size for j in jobs), tokens, lat, [j.size for j in jobs],
                     {"guard_cuts": cuts})


class GuardToEos:
    """The repetition guard as a logits processor for `batch_generate` (B).

    batch_generate has no per-row stop hook, but it takes logits processors (cloned per
    row) and ends a row on EOS. Once a row's generated tail loops, its next token is
    forced to EOS: the row ends one token after the step where the engine cuts it.
    `cuts` is shared by the clones, so the caller can count the rows cut.
    """

    def __init__(self, guard: RepetitionGuard, eos: int, cuts: list[int] | None = None) -> None:
        self.guard, self.eos = guard, eos
        self.cuts = cuts if cuts is not None else []
        self.tokens: list[int] = []

    def clone(self) -> GuardToEos:
        return GuardToEos(self.guard, self.eos, self.cuts)

    def __call__(self, context: Any, logits: Any) -> Any:
        return logits  # end of prefill: the context is the prompt, nothing generated yet

    def process_last_token(self, token: int, logits: Any) -> Any:
        """Decode steps: `token` is the row's previous token."""
        import mlx.core as mx

        self.tokens.append(int(token))
        if self.guard.find(self.tokens) is None:
            return logits
        self.cuts.append(len(self.tokens))
        only_eos = mx.arange(logits.shape[-1]) == self.eos
        return mx.broadcast_to(mx.where(only_eos, 0.0, -mx.inf), logits.shape).astype(
            logits.dtype)


def _eos_id(model: Any) -> int:
    eos = model.config.eos_token_id
    return int(eos[0] if isinstance(eos, (list, tuple)) else eos)


def run_b(model: Any, processor: Any, prompt: str, jobs: Sequence[Job],
          max_tokens: int, guard: RepetitionGuard | None) -> SystemRun:
    """Per-job batching: one `batch_generate` per job, FIFO."""
    from mlx_vlm import batch_generate

    cuts: list[int] = []
    kw: dict[str, Any] = {}
    if guard is not None:
        kw["logits_processors"] = [GuardToEos(guard, _eos_id(model), cuts)]
    t0 = time.perf_counter()
    wait = _arrivals(jobs, t0)
    tokens, lat = 0, []
    for job in jobs:
        wait(job)
        out = batch_generate(model, processor, images=list(job.images),
                             prompts=[prompt] * job.size, max_tokens=max_tokens, **kw)
        tokens += int(out.stats.generation_tokens)
        lat.append(time.perf_counter() - (t0 + job.offset))
    return SystemRun("B per-job batch_generate", time.perf_counter() - t0,
                     sum(j.size for j in jobs), tokens, lat, [j.size for j in jobs],
                     {"guard_cuts": len(cuts)})


def run_c(model_path: str, prompt: str, stop: tuple[str, ...], jobs: Sequence[Job],
          max_tokens: int, max_batch: int, prep_threads: int,
          guard: RepetitionGuard | None) -> SystemRun:
    """The vlmq Engine in-process, fed at the arrival times, prep on a thread pool."""
    from vlmq.worker.engine.batcher import Engine, Request
    from vlmq.worker.model import mlx_adapter

    engine = Engine(model_path, max_batch=max_batch, repetition=guard)
    engine.wait_ready(timeout=300)
    processor, config = engine.processor, engine.model_config

    def submit(key: tuple[int, int], img: Image.Image, priority: int = 0) -> None:
        prepared = mlx_adapter.prepare(processor, config, img, prompt)
        engine.submit(Request(key=key, prepared=prepared, cached_features=None,
                              max_tokens=max_tokens, temperature=0.0, stop=stop,
                              priority=priority))

    try:
        submit((-1, 0), jobs[0].images[0])  # warm-up, untimed
        while not engine.get_finished(timeout=1.0):
            pass
        left = {j: job.size for j, job in enumerate(jobs)}
        done_at: dict[int, float] = {}
        tokens = 0
        with ThreadPoolExecutor(prep_threads) as pool:
            t0 = time.perf_counter()
            busy0, reps0 = engine.state.busy_s, engine.state.repetitions

            def feed() -> None:
                wait = _arrivals(jobs, t0)
                for j, job in enumerate(jobs):
                    wait(job)
                    for k, img in enumerate(job.images):  # as the worker: items left
                        pool.submit(submit, (j, k), img, job.size)

            feeder = threading.Thread(target=feed)
            feeder.start()
            while left:
                for f in engine.get_finished(timeout=1.0):
                    if f.error:
                        raise RuntimeError(f"engine item {f.key} failed: {f.error}")
                    j = f.key[0]  # type: ignore[index]
                    tokens += f.completion_tokens
                    left[j] -= 1
                    if not left[j]:
                        del left[j]
                        done_at[j] = time.perf_counter()
            feeder.join()
            wall = max(done_at.values()) - t0
            busy = (engine.state.busy_s - busy0) / wall
            cuts = engine.state.repetitions - reps0
    finally:
        engine.close(timeout=30)
    lat = [done_at[j] - (t0 + job.offset) for j, job in enumerate(jobs)]
    return SystemRun("C vlmq Engine in-process", wall, sum(j.size for j in jobs), tokens, lat,
                     [j.size for j in jobs], {"busy": round(busy, 3), "guard_cuts": cuts})


# ---------------------------------------------------------------- D (Redis + worker)


def _vm_hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _stats_after(redis: Any, name: str, cond: Callable[[dict[str, str]], bool],
                 timeout: float, proc: subprocess.Popen[str]) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = C.read_stats(redis, name)
        if stats and cond(stats):
            return stats
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"worker exited {proc.returncode}:\n{out[-4000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"worker {name}: stats not as expected after {timeout} s")


def guard_flags(guard: RepetitionGuard | None) -> list[str]:
    """`vlmq worker` flags for this guard (the worker's own default is on)."""
    if guard is None:
        return ["--repetition-repeats", "0"]
    return ["--repetition-repeats", str(guard.min_repeats),
            "--repetition-min-span", str(guard.min_span),
            "--repetition-period", str(guard.max_period),
            "--on-repetition", guard.on_repetition]


def run_d(args: argparse.Namespace, model_path: str, jobs: Sequence[Job], workdir: Path,
          max_tokens: int, blas_choice: str, label: str,
          guard: RepetitionGuard | None) -> SystemRun:
    """Client enqueue at the arrival times, real Redis, one long-lived worker process."""
    from vlmq.producer.client import Client

    tag = f"{label.lower().replace('@', '-')}-{uuid.uuid4().hex[:6]}"
    queue = f"bench-{tag}"
    cache = workdir / f"cache-{tag}"
    fixed = label.startswith("D@")
    cmd = C.worker_cmd(args.redis_url, model_path, queue,
                       max_batch=int(label[2:]) if fixed else args.max_batch,
                       cache_dir=cache / "vision", name=tag, burst=False, fixed=fixed)
    cmd += ["--blas", blas_choice, *guard_flags(guard)]
    if args.prep_threads:
        cmd += ["--prep-threads", str(args.prep_threads)]
    proc = subprocess.Popen(cmd, env=C.worker_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    redis = Redis.from_url(args.redis_url)
    client = Client(args.redis_url)
    # The result cache off: D_ref runs the very items D just ran, and every system must
    # generate what it is timed on.
    kw = {"queue": queue, "max_side": args.side, "max_tokens": max_tokens,
          "temperature": 0.0, "result_cache": "off"}
    try:
        # Warm-up (untimed): one photo the timed jobs do not contain.
        warm = workdir / f"warm-{tag}.jpg"
        _photo(10_000, PHOTO_SIZES[0]).save(warm)
        client.ocr([warm], **kw).wait(timeout=600)
        stats0 = _stats_after(redis, tag, lambda s: int(s.get("items_ok", "0")) >= 1, 60, proc)
        arrivals: list[float] = []
        handles = []
        t0 = time.time()
        for job in jobs:
            delay = t0 + job.offset - time.time()
            if delay > 0:
                time.sleep(delay)
            arrivals.append(time.time())
            handles.append(client.ocr(job.paths, **kw))
        for h in handles:
            h.wait(timeout=1800)
        runs = [C.job_run(args.redis_url, h.id) for h in handles]
        cuts = sum(1 for h in handles for item in h.results() if item.repetition)
        rss = _vm_hwm_mb(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        stats1 = C.read_stats(redis, tag)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        client.close()
        redis.close()
    first = arrivals[0]
    wall = max(r.last_item_at for r in runs) - first
    lat = [r.last_item_at - a for r, a in zip(runs, arrivals, strict=True)]
    busy = (float(stats1["mlx_busy_s"]) - float(stats0["mlx_busy_s"])) / wall
    shares = _time_shares(stats0, stats1)
    blas_line = next((ln.split("BLAS: ", 1)[1] for ln in out.splitlines() if "BLAS: " in ln),
                     stats1.get("blas", "?"))
    name = {"D": "D vlmq worker via Redis", "D_ref": "D_ref same, --blas reference"}.get(
        label, f"{label} vlmq worker, fixed batch")
    return SystemRun(name, wall, sum(r.items for r in runs), sum(r.tokens for r in runs),
                     lat, [j.size for j in jobs],
                     {"busy": round(busy, 3), "peak_rss_mb": round(rss, 1),
                      "batch": stats1.get("batch_limit", "?"),
                      "batch_reason": stats1.get("batch_reason", ""),
                      "blas": blas_line, "failed": sum(r.items - r.ok for r in runs),
                      "guard_cuts": cuts, **shares})


def _time_shares(before: dict[str, str], after: dict[str, str]) -> dict[str, float]:
    """Where the MLX thread's time went during the timed jobs: turns that admit or prefill
    rows, turns that only decode, and the rows those held on average (a limit the
    batch seldom fills shows here, not in the sizer's readings)."""
    def delta(key: str) -> float:
        return float(after.get(key, 0)) - float(before.get(key, 0))

    prefill = delta("mlx_prefill_turn_s")
    turns = delta("decode_turns")
    return {"prefill_turn_s": round(prefill, 2),
            "decode_turn_s": round(delta("mlx_busy_s") - prefill, 2),
            "decode_rows_avg": round(delta("decode_turn_rows") / turns, 1) if turns else 0.0}


# ---------------------------------------------------------------- E (mlx-vlm's server)


def run_e(model_path: str, prompt: str, jobs: Sequence[Job], workdir: Path, max_tokens: int,
          max_batch: int | None) -> SystemRun:
    """mlx_vlm.server with as many rows as C and D; at each job's arrival, one client
    thread per item sends its request (the exact pixels A, B and C get, as PNG)."""
    bodies = [[server_e.request_body(model_path, server_e.data_url(im), prompt, max_tokens)
               for im in job.images] for job in jobs]
    with server_e.Server(model_path, max_num_seqs=max_batch, max_tokens=max_tokens,
                         log_path=workdir / "server-e.log") as server:
        server.wait_ready()
        warm = _photo(10_000, PHOTO_SIZES[0])  # untimed, not one of the timed items
        server_e.chat(server.port, server_e.request_body(
            model_path, server_e.data_url(warm), prompt, max_tokens))
        # A thread per item, so every request is in flight from its job's arrival.
        with ThreadPoolExecutor(sum(j.size for j in jobs)) as pool:
            futures = {}
            t0 = time.perf_counter()
            wait = _arrivals(jobs, t0)
            for j, job in enumerate(jobs):
                wait(job)
                for k, body in enumerate(bodies[j]):
                    futures[(j, k)] = pool.submit(server_e.chat, server.port, body)
            replies = {key: f.result() for key, f in futures.items()}
        rss = server.vm_hwm_mb()
        blas_line = next((ln.split("BLAS: ", 1)[1] for ln in server.log().splitlines()
                          if ln.startswith("BLAS: ")), "?")
    done = [max(replies[(j, k)].done_at for k in range(job.size))
            for j, job in enumerate(jobs)]
    lat = [d - (t0 + job.offset) for d, job in zip(done, jobs, strict=True)]
    reasons: dict[str, int] = {}
    for r in replies.values():
        reasons[str(r.finish_reason)] = reasons.get(str(r.finish_reason), 0) + 1
    return SystemRun("E mlx_vlm.server, HTTP per item", max(done) - t0,
                     sum(j.size for j in jobs), sum(r.completion_tokens for r in replies.values()),
                     lat, [j.size for j in jobs],
                     {"peak_rss_mb": round(rss, 1), "blas": blas_line,
                      "finish_reasons": reasons, "guard": "none"})


def enqueue_throughput(redis_url: str, folder: Path, n: int) -> float:
    """Items/s for one caption job of `n` tiny distinct images (files to enqueued job)."""
    from vlmq.producer.client import Client

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"t{i:05d}.png"
        Image.new("RGB", (8, 8), (i % 256, (i // 256) % 256, 7)).save(p)
        paths.append(p)
    with Client(redis_url) as client:
        t0 = time.perf_counter()
        client.caption(paths, queue=f"bench-enqueue-{uuid.uuid4().hex[:6]}")
        return n / (time.perf_counter() - t0)


# ---------------------------------------------------------------- main


def _guard_line(guard: RepetitionGuard | None) -> str:
    if guard is None:
        return "off"
    return (f"on (period <= {guard.max_period}, repeats >= {guard.min_repeats}, span >= "
            f"{guard.min_span}, {guard.on_repetition})")


def _sweep(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.sweep.split(",")] if args.sweep else []


def latency_table(runs: dict[str, SystemRun]) -> str:
    """Each job's latency (arrival to its last item) against its size, a column per system:
    small jobs first shows as small latencies in the top rows."""
    if not runs:
        return ""
    first = next(iter(runs.values()))
    order = sorted(range(len(first.sizes)), key=lambda i: (first.sizes[i], i))
    return "latency of each job, s (arrival order in brackets)\n" + C.table(
        ["job items", *runs],
        [[f"{first.sizes[i]} [{i + 1}]", *(r.latencies[i] for r in runs.values())]
         for i in order])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with C.redis_url_or_private(args.redis_url) as args.redis_url:
        return run(args)


def run(args: argparse.Namespace) -> int:
    from vlmq.worker.model import blas

    prep_threads = args.prep_threads or min(4, os.cpu_count() or 2)
    # One thread count for all systems (the D workers inherit the environment).
    threads = args.blas_threads or blas.worker_threads(prep_threads)
    if not args.defaults:  # --defaults: each system picks its own
        os.environ[blas.ENV_THREADS] = os.environ[blas.MKL_THREADS] = str(threads)
    chosen = blas.select()  # this process runs A, B and C: before MLX loads
    systems = {s.strip() for s in args.systems.split(",") if s.strip()}
    if args.model != "bench":
        systems.discard("D_ref")
    max_tokens = args.max_tokens or (16 if args.quick else OCR_TOKENS if args.ocr else 64)
    guard = RepetitionGuard() if args.guard else None  # the worker's default settings
    spacing = args.spacing if args.spacing is not None else (0.25 if args.quick else 0.5)
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else list(JOB_SIZES)
    model_path = C.resolve_model(args.model)
    if (systems & {"D", "D_ref"} or not args.no_enqueue_bench) and not args.no_flush:
        C.connect(args.redis_url).close()

    from vlmq.worker.model import mlx_adapter
    from vlmq.worker.model.defaults import resolve

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-run-") as tmp:
        workdir = args.workdir or Path(tmp)
        jobs = make_jobs(workdir / "inputs", sizes, spacing, args.side)
        print(f"machine: {C.machine()}")
        print(f"BLAS (A, B, C): {chosen.describe()}")
        items = sum(sizes)
        print(f"model: {model_path}; {len(jobs)} jobs of {','.join(map(str, sizes))} items "
              f"({items} in all: PDF pages + photos {PHOTO_SIZES}), arrivals every "
              f"{spacing} s, max {max_tokens} new tokens, greedy, max batch "
              f"{args.max_batch or 'at each system default'}, "
              f"prep threads {prep_threads}", flush=True)
        print("repetition guard: off in every system" if guard is None else
              f"repetition guard: {_guard_line(guard)} in A, B, C, D"
              + ("; E has none (its HTTP API takes no custom stopping rule)"
                 if "E" in systems else ""), flush=True)
        runs: dict[str, SystemRun] = {}
        loaded = mlx_adapter.load_model(model_path)
        spec = resolve(loaded.model_type, "ocr", None, max_tokens, 0.0, ())
        prompt_text = mlx_adapter.format_prompt(loaded.processor, loaded.model.config, spec.prompt,
                                                num_images=1)
        if systems & {"A", "B"}:
            from mlx_vlm import generate

            generate(loaded.model, loaded.processor, prompt_text, image=[jobs[0].images[0]],
                     max_tokens=4, temperature=0.0)  # warm-up, untimed
        if "A" in systems:
            runs["A"] = run_a(loaded.model, loaded.processor, prompt_text, jobs, max_tokens,
                              guard)
            print(f"  A: {runs['A'].wall_s:.1f} s", flush=True)
        if "B" in systems:
            runs["B"] = run_b(loaded.model, loaded.processor, spec.prompt, jobs, max_tokens,
                              guard)
            print(f"  B: {runs['B'].wall_s:.1f} s", flush=True)
        del loaded
        if "C" in systems:
            runs["C"] = run_c(model_path, spec.prompt, tuple(spec.stop), jobs, max_tokens,
                              args.max_batch or 16, prep_threads, guard)
            print(f"  C: {runs['C'].wall_s:.1f} s", flush=True)
        for label, choice in (("D", "auto"), ("D_ref", "reference")):
            if label in systems:
                runs[label] = run_d(args, model_path, jobs, workdir, max_tokens,
                                    os.environ.get("VLMQ_BLAS", "auto") if label == "D"
                                    else choice, label, guard)
                print(f"  {label}: {runs[label].wall_s:.1f} s", flush=True)
            if label == "D" and "E" in systems:  # after D, before the slow D_ref
                runs["E"] = run_e(model_path, spec.prompt, jobs, workdir, max_tokens,
                                  args.max_batch)
                print(f"  E: {runs['E'].wall_s:.1f} s", flush=True)
            if label == "D":
                for n in _sweep(args):
                    runs[f"D@{n}"] = run_d(args, model_path, jobs, workdir, max_tokens,
                                           os.environ.get("VLMQ_BLAS", "auto"), f"D@{n}", guard)
                    print(f"  D@{n}: {runs[f'D@{n}'].wall_s:.1f} s", flush=True)
        enq = None
        if not args.no_enqueue_bench:
            enq = enqueue_throughput(args.redis_url, workdir / "enqueue", ENQUEUE_ITEMS)
    total = time.perf_counter() - t_start

    print()
    print(C.table(
        ["system", "s", "items", "tokens", "tok/s", "items/s", "p50 s", "p95 s",
         "small p50 s", "small p95 s", "busy", "peak RSS MB", "guard cuts", "batch"],
        [[r.name, r.wall_s, r.items, r.tokens, r.tok_s, r.items_s, r.p(50), r.p(95),
          r.p(50, True), r.p(95, True), r.extra.get("busy", ""), r.extra.get("peak_rss_mb", ""),
          r.extra.get("guard_cuts", ""), r.extra.get("batch", "")]
         for r in runs.values()]))
    print()
    print(latency_table(runs))
    if "D" in runs:
        print(f"D's batch: {runs['D'].extra.get('batch')} rows "
              f"({runs['D'].extra.get('batch_reason')}); E: "
              + ("--max-num-seqs " + str(args.max_batch) if args.max_batch else "unbounded"))
    for key, r in runs.items():
        if "prefill_turn_s" in r.extra:
            print(f"{key}'s MLX time: {r.extra['decode_turn_s']} s in turns that only decode "
                  f"({r.extra['decode_rows_avg']} rows on average), {r.extra['prefill_turn_s']} "
                  "s in turns that admit or prefill rows")
    fixed = {k: r for k, r in runs.items() if k.startswith("D@")}
    if fixed and "D" in runs:
        best = max(fixed, key=lambda k: fixed[k].tok_s)
        print(f"best fixed batch: {best} at {fixed[best].tok_s:.0f} tok/s; D (chosen) at "
              f"{runs['D'].tok_s:.0f}: {runs['D'].tok_s / fixed[best].tok_s:.3f} of it")
    if enq is not None:
        print(f"enqueue: {ENQUEUE_ITEMS} tiny items in one caption job: {enq:.0f} items/s")
    print(f"harness wall time: {total:.0f} s")

    def ratio(a: str, b: str) -> float | None:
        if a in runs and b in runs:
            return round(runs[a].tok_s / runs[b].tok_s, 3)
        return None

    def small_p95(a: str, b: str) -> float | None:
        if a in runs and b in runs:
            return round(runs[a].p(95, True) / runs[b].p(95, True), 3)
        return None

    d = runs.get("D")
    summary = {
        "D_over_A": ratio("D", "A"),
        "D_over_B": ratio("D", "B"),
        "D_over_C": ratio("D", "C"),
        "D_over_E": ratio("D", "E"),
        "D_over_D_ref": ratio("D", "D_ref"),
        "D_over_best_fixed": (round(runs["D"].tok_s / max(r.tok_s for k, r in runs.items()
                                                          if k.startswith("D@")), 3)
                              if "D" in runs and any(k.startswith("D@") for k in runs)
                              else None),
        "defaults": args.defaults,
        "small_job_p95_D_over_B": small_p95("D", "B"),
        "small_job_p95_D_over_C": small_p95("D", "C"),
        "small_job_p95_D_over_E": small_p95("D", "E"),
        "guard": _guard_line(guard),
        "E_guard": None if "E" not in runs else "none" if guard is not None else "off",
        "busy": d.extra["busy"] if d else None,
        "enqueue_items_per_s": round(enq, 1) if enq is not None else None,
        "peak_rss_mb": d.extra["peak_rss_mb"] if d else None,
        "model": args.model, "quick": args.quick, "ocr": args.ocr, "max_tokens": max_tokens,
        "side": args.side,
        "blas_threads": threads, "prep_threads": prep_threads,
        "machine": C.machine(), "harness_s": round(total, 1),
        "raw": {k: r.figures() for k, r in runs.items()},
    }
    C.emit_json(summary, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
