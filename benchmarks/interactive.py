"""Interactive requests beside a bulk job, on one loaded model: vlmq against mlx-vlm's server.

For each system, in this one run, on the same pages, requests and model, in this order:

  bulk   a saturating OCR-shaped job of a few hundred pages, alone;
  idle   the interactive requests alone, one after another (one image each, 64 new
         tokens, streamed through the official `openai` SDK);
  load   the same bulk work (other pages of the same shape) with the interactive
         requests sent at seeded random moments while it runs.

vlmq: one `vlmq worker` serving the bulk queue and `chat`, the bulk as one vlmq OCR job,
the interactive requests through `vlmq api`'s /v1/chat/completions. mlx-vlm: its own
server (benchmarks/server_e.py), the bulk pages as concurrent streamed HTTP requests, the
same interactive requests through the same SDK.

Each phase uses pages and images of its own, so no vision cache turns a repeat into a
hit. Prints time to first token and total time of the interactive requests (p50, p95)
idle and under load, bulk pages/s with and without them, and the issue's target ratios;
the last line is JSON. Nothing is asserted.

    .venv/bin/python benchmarks/interactive.py                  # the figures (bench model)
    .venv/bin/python benchmarks/interactive.py --quick          # a few pages, for development
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C
import server_e

BULK_QUEUE = "bench-bulk"
API_KEY = secrets.token_urlsafe(24)  # the API refuses weak keys; mlx-vlm ignores it
QUESTION = "Describe this image in detail."
# The targets: vlmq's p95 TTFT under load at most 2x its idle one and at most
# 0.25x mlx-vlm's under the same load; its bulk pages/s with the requests >= 0.9x without.
TARGET_TTFT_LOAD_OVER_IDLE = 2.0
TARGET_TTFT_OVER_MLX = 0.25
TARGET_BULK_KEPT = 0.9
# The requests land within this part of the bulk phase's length alone: early enough that
# the bulk, slowed by them, is still running when the last one comes.
SPREAD = (0.05, 0.7)
WARM_PAGES = 32


# ---------------------------------------------------------------- figures


@dataclass(frozen=True)
class Timing:
    """One interactive request as its client saw it (seconds from sending it)."""

    ttft_s: float
    total_s: float
    tokens: int


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linearly interpolated between ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(timings: Sequence[Timing]) -> dict[str, float]:
    """p50 and p95 of time to first token and total time, in seconds."""
    ttft = [t.ttft_s for t in timings]
    total = [t.total_s for t in timings]
    return {"n": len(timings), "ttft_p50_s": round(percentile(ttft, 50), 4),
            "ttft_p95_s": round(percentile(ttft, 95), 4),
            "total_p50_s": round(percentile(total, 50), 4),
            "total_p95_s": round(percentile(total, 95), 4)}


def moments(n: int, span_s: float, seed: int) -> list[float]:
    """`n` seeded random send times (s from the bulk's start), sorted, within SPREAD of
    `span_s`."""
    rng = random.Random(seed)
    lo, hi = SPREAD
    return sorted(rng.uniform(lo * span_s, hi * span_s) for _ in range(n))


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def targets(figures: dict[str, Any]) -> dict[str, Any]:
    """The issue's three ratios from both systems' figures, each beside its target and
    whether it is met (None where a system did not run)."""
    v, m = figures.get("vlmq"), figures.get("mlx_vlm")
    load_idle = ratio(v["load"]["ttft_p95_s"], v["idle"]["ttft_p95_s"]) if v else None
    over_mlx = (ratio(v["load"]["ttft_p95_s"], m["load"]["ttft_p95_s"]) if v and m else None)
    kept = ratio(v["load_pages_per_s"], v["bulk_pages_per_s"]) if v else None
    return {
        "vlmq_ttft_p95_load_over_idle": load_idle,
        "vlmq_ttft_p95_load_over_mlx_vlm": over_mlx,
        "vlmq_bulk_with_over_without": kept,
        "met": {"load_over_idle": None if load_idle is None
                else load_idle <= TARGET_TTFT_LOAD_OVER_IDLE,
                "over_mlx_vlm": None if over_mlx is None else over_mlx <= TARGET_TTFT_OVER_MLX,
                "bulk_kept": None if kept is None else kept >= TARGET_BULK_KEPT},
    }


# ---------------------------------------------------------------- inputs


def make_pages(folder: Path, name: str, first: int, n: int) -> Path:
    """One PDF of `n` pages, each distinct (numbered from `first`)."""
    folder.mkdir(parents=True, exist_ok=True)
    pages = [C._page(first + i, C.PAGE_PT) for i in range(n)]
    path = folder / f"{name}.pdf"
    pages[0].save(path, "PDF", save_all=True, append_images=pages[1:], resolution=72.0)
    return path


def make_photos(first: int, n: int, side: int) -> list[str]:
    """`n` distinct photo-like images as PNG data URIs (the interactive requests')."""
    size = (side, side * 3 // 4)
    return [server_e.data_url(_photo(first + i, size)) for i in range(n)]


def _photo(i: int, size: tuple[int, int]) -> Image.Image:
    from run import _photo as photo

    return photo(i, size)


# ---------------------------------------------------------------- the interactive client


def ask(base_url: str, model: str, image_url: str, max_tokens: int) -> Timing:
    """One streamed chat completion through the official SDK, timed from the send."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=1800)
    t0 = time.perf_counter()
    first: float | None = None
    tokens = 0
    stream = client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": image_url}}]}])
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    client.close()
    return Timing((first or end) - t0, end - t0, tokens)


def idle_phase(base_url: str, model: str, images: Sequence[str], max_tokens: int
               ) -> list[Timing]:
    """The requests one after another on an otherwise idle system."""
    return [ask(base_url, model, url, max_tokens) for url in images]


def send_at(base_url: str, model: str, images: Sequence[str], at: Sequence[float],
            t0: float, max_tokens: int) -> Callable[[], list[Timing]]:
    """Start a thread per request, each sending at t0 + its moment; the returned call
    waits for them all (a failed request raises there)."""

    def one(i: int) -> Timing:
        delay = t0 + at[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return ask(base_url, model, images[i], max_tokens)

    pool = ThreadPoolExecutor(len(images))
    futures = [pool.submit(one, i) for i in range(len(images))]

    def wait() -> list[Timing]:
        try:
            return [f.result() for f in futures]
        finally:
            pool.shutdown()

    return wait


# ---------------------------------------------------------------- vlmq


def _wait_http(url: str, proc: subprocess.Popen[str], timeout: float,
               ok: Callable[[Any], bool]) -> Any:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"process exited {proc.returncode}:\n{out[-4000:]}")
        try:
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                body = json.loads(resp.read())
                if ok(body):
                    return body
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready after {timeout} s")


def _bulk_vlmq(redis_url: str, pdf: Path, args: argparse.Namespace) -> tuple[str, float]:
    from vlmq.producer.client import Client

    with Client(redis_url) as client:
        started = time.time()
        job = client.ocr([pdf], queue=BULK_QUEUE, max_side=args.side,
                         max_tokens=args.bulk_tokens, temperature=0.0, result_cache="off")
    return job.id, started


def _pages_per_s(redis_url: str, job_id: str, started: float, timeout: float) -> float:
    from vlmq.producer.client import Client

    with Client(redis_url) as client:
        client.job(job_id).wait(timeout=timeout, check=True)
    run = C.job_run(redis_url, job_id)
    return run.items / (run.last_item_at - started)


def run_vlmq(args: argparse.Namespace, model_path: str, workdir: Path,
             inputs: dict[str, Any]) -> dict[str, Any]:
    """Worker + `vlmq api`, then the three phases."""
    from vlmq.worker.redis_server import free_port

    tag = f"i-{uuid.uuid4().hex[:6]}"
    cache = workdir / f"cache-{tag}"
    cmd = C.worker_cmd(args.redis_url, model_path, f"{BULK_QUEUE},chat",
                       max_batch=args.max_batch or None, cache_dir=cache / "vision", name=tag,
                       burst=False)
    cmd += ["--repetition-repeats", "0"]  # no guard: mlx-vlm's server has none
    worker = subprocess.Popen(cmd, env=C.worker_env(cache), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    port = free_port()
    api = subprocess.Popen(
        [C.VLMQ, "api", "--port", str(port), "--files-dir", str(workdir / "api-files")],
        env={**os.environ, "REDIS_URL": args.redis_url, "VLMQ_API_KEYS": API_KEY,
             "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        models = _wait_http(f"{base}/models", api, 600, lambda b: bool(b.get("data")))
        model = models["data"][0]["id"]
        job_id, started = _bulk_vlmq(args.redis_url, inputs["warm_pdf"], args)
        _pages_per_s(args.redis_url, job_id, started, 1800)
        print("  vlmq: ready", flush=True)
        # The bulk alone comes before any interactive request: for a minute after one
        # the worker fills its batch a row a turn (worker/engine/admission.py).
        job_id, started = _bulk_vlmq(args.redis_url, inputs["bulk_pdf"], args)
        bulk = _pages_per_s(args.redis_url, job_id, started, 3600)
        span = args.pages / bulk
        print(f"  vlmq bulk alone: {bulk:.2f} pages/s", flush=True)
        ask(base, model, inputs["warm"], args.chat_tokens)  # warm-up, untimed
        idle = idle_phase(base, model, inputs["idle"], args.chat_tokens)
        print(f"  vlmq idle: {summarize(idle)}", flush=True)
        at = moments(args.requests, span, args.seed)
        job_id, started = _bulk_vlmq(args.redis_url, inputs["load_pdf"], args)
        wait = send_at(base, model, inputs["load"], at,
                       time.perf_counter() - (time.time() - started), args.chat_tokens)
        load_bulk = _pages_per_s(args.redis_url, job_id, started, 3600)
        load = wait()
        print(f"  vlmq under load: {summarize(load)}; bulk {load_bulk:.2f} pages/s",
              flush=True)
        redis = C.connect(args.redis_url, flush=False)
        stats = C.read_stats(redis, tag)
        redis.close()
    finally:
        for proc in (api, worker):
            if proc.poll() is None:
                C.stop(proc)
    return {"idle": summarize(idle), "load": summarize(load),
            "bulk_pages_per_s": round(bulk, 3), "load_pages_per_s": round(load_bulk, 3),
            "batch": stats.get("batch_limit", "?"), "model_name": model,
            "raw": {"idle": [t.__dict__ for t in idle], "load": [t.__dict__ for t in load],
                    "moments_s": [round(x, 3) for x in at]}}


# ---------------------------------------------------------------- mlx-vlm's server


def _bulk_http(port: int, bodies: Sequence[bytes]
               ) -> tuple[ThreadPoolExecutor, list[Future[server_e.Reply]], float]:
    """Every bulk page in flight at once, a client thread each (as run.py's E)."""
    pool = ThreadPoolExecutor(len(bodies))
    t0 = time.perf_counter()
    futures = [pool.submit(server_e.chat, port, body) for body in bodies]
    return pool, futures, t0


def _pages_http(pool: ThreadPoolExecutor, futures: Sequence[Future[server_e.Reply]],
                t0: float) -> float:
    replies = [f.result() for f in futures]
    pool.shutdown()
    return len(replies) / (max(r.done_at for r in replies) - t0)


def run_mlx_vlm(args: argparse.Namespace, model_path: str, workdir: Path,
                inputs: dict[str, Any]) -> dict[str, Any]:
    """mlx_vlm.server, then the same three phases over HTTP."""
    prompt = inputs["ocr_prompt"]

    def bodies(images: Sequence[Image.Image]) -> list[bytes]:
        return [server_e.request_body(model_path, server_e.data_url(im), prompt,
                                      args.bulk_tokens) for im in images]

    bulk_bodies, load_bodies = bodies(inputs["bulk_images"]), bodies(inputs["load_images"])
    with server_e.Server(model_path, max_num_seqs=args.max_batch or None,
                         max_tokens=max(args.bulk_tokens, args.chat_tokens),
                         log_path=workdir / "mlx-vlm-server.log") as server:
        server.wait_ready()
        base = f"http://{server_e.HOST}:{server.port}/v1"
        _pages_http(*_bulk_http(server.port, bodies(inputs["warm_images"])))
        print("  mlx-vlm: ready", flush=True)
        bulk = _pages_http(*_bulk_http(server.port, bulk_bodies))  # in vlmq's order
        print(f"  mlx-vlm bulk alone: {bulk:.2f} pages/s", flush=True)
        ask(base, model_path, inputs["warm"], args.chat_tokens)  # warm-up, untimed
        idle = idle_phase(base, model_path, inputs["idle"], args.chat_tokens)
        print(f"  mlx-vlm idle: {summarize(idle)}", flush=True)
        at = moments(args.requests, args.pages / bulk, args.seed)
        pool, futures, t0 = _bulk_http(server.port, load_bodies)
        wait = send_at(base, model_path, inputs["load"], at, t0, args.chat_tokens)
        load_bulk = _pages_http(pool, futures, t0)
        load = wait()
        print(f"  mlx-vlm under load: {summarize(load)}; bulk {load_bulk:.2f} pages/s",
              flush=True)
    return {"idle": summarize(idle), "load": summarize(load),
            "bulk_pages_per_s": round(bulk, 3), "load_pages_per_s": round(load_bulk, 3),
            "max_num_seqs": args.max_batch or None,
            "raw": {"idle": [t.__dict__ for t in idle], "load": [t.__dict__ for t in load],
                    "moments_s": [round(x, 3) for x in at]}}


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a few pages and requests, short answers, the tiny model (a check "
                        "that every part runs, not figures)")
    p.add_argument("--model", default=None,
                   help="bench (default), tiny, or a model folder")
    p.add_argument("--pages", type=int, default=None, help="bulk pages (default 300)")
    p.add_argument("--requests", type=int, default=None,
                   help="interactive requests per phase (default 20)")
    p.add_argument("--bulk-tokens", type=int, default=None,
                   help="new tokens per bulk page (default 256)")
    p.add_argument("--chat-tokens", type=int, default=None,
                   help="new tokens per interactive request (default 64)")
    p.add_argument("--side", type=int, default=None,
                   help="longest side of a page in px (default 448)")
    p.add_argument("--max-batch", type=int, default=16,
                   help="vlmq's --max-batch and mlx-vlm's --max-num-seqs (0: each "
                        "system's own default; default 16)")
    p.add_argument("--seed", type=int, default=0, help="the requests' moments (default 0)")
    p.add_argument("--systems", default="vlmq,mlx-vlm",
                   help="which systems to run (comma-separated; default both)")
    p.add_argument("--redis-url", default=None,
                   help="a Redis db to use; it is FLUSHED first (default: a private "
                        "redis-server on a free port)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where inputs and caches go (default: a fresh temp dir)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("model", "bench", "tiny"), ("pages", 300, 12),
                              ("requests", 20, 3), ("bulk_tokens", 256, 24),
                              ("chat_tokens", 64, 16), ("side", 448, 224)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    return args


def make_inputs(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Pages and images for every phase, each phase its own (no cache hit across them)."""
    n, r = args.pages, args.requests
    bulk_pdf = make_pages(folder, "bulk", 0, n)
    load_pdf = make_pages(folder, "load", n, n)
    # Bulk warm-up: enough pages for a batch to fill (and a worker to size it) untimed.
    warm_pdf = make_pages(folder, "warm", 2 * n, max(1, min(n // 4, WARM_PAGES)))
    return {
        "warm_pdf": warm_pdf,
        "warm_images": C.item_images([warm_pdf], args.side),
        "bulk_pdf": bulk_pdf, "load_pdf": load_pdf,
        "bulk_images": C.item_images([bulk_pdf], args.side),
        "load_images": C.item_images([load_pdf], args.side),
        "warm": make_photos(10_000, 1, args.side)[0],
        "idle": make_photos(20_000, r, args.side),
        "load": make_photos(30_000, r, args.side),
    }


def _ocr_prompt(model_path: str, tokens: int) -> str:
    """The OCR prompt a vlmq worker gives this model, so mlx-vlm's bulk asks the same."""
    from vlmq.worker.model.defaults import resolve

    with open(Path(model_path) / "config.json", encoding="utf-8") as fh:
        model_type = str(json.load(fh).get("model_type", ""))
    return str(resolve(model_type, "ocr", None, tokens, 0.0, ()).prompt)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with C.redis_url_or_private(args.redis_url) as args.redis_url:
        return run(args)


def run(args: argparse.Namespace) -> int:
    systems = {s.strip() for s in args.systems.split(",") if s.strip()}
    model_path = C.resolve_model(args.model)
    C.connect(args.redis_url).close()
    t_start = time.perf_counter()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-interactive-") as tmp:
        workdir = args.workdir or Path(tmp)
        inputs = make_inputs(args, workdir / "inputs")
        inputs["ocr_prompt"] = _ocr_prompt(model_path, args.bulk_tokens)
        print(f"machine: {C.machine()}")
        print(f"model: {model_path}; bulk: {args.pages} PDF pages at {args.side} px, "
              f"{args.bulk_tokens} new tokens each; interactive: {args.requests} requests "
              f"per phase, one image each, {args.chat_tokens} new tokens; greedy; max batch "
              f"{args.max_batch or 'each system default'}; seed {args.seed}", flush=True)
        if "vlmq" in systems:
            figures["vlmq"] = run_vlmq(args, model_path, workdir, inputs)
        if "mlx-vlm" in systems:
            figures["mlx_vlm"] = run_mlx_vlm(args, model_path, workdir, inputs)
    total = time.perf_counter() - t_start
    print()
    print(report(figures))
    goals = targets(figures)
    print(f"harness wall time: {total:.0f} s")
    C.emit_json({**goals, "systems": figures, "model": args.model, "pages": args.pages,
                 "requests": args.requests, "bulk_tokens": args.bulk_tokens,
                 "chat_tokens": args.chat_tokens, "side": args.side,
                 "max_batch": args.max_batch, "seed": args.seed, "quick": args.quick,
                 "machine": C.machine(), "harness_s": round(total, 1)}, args.json_out)
    return 0


def report(figures: dict[str, Any]) -> str:
    """The table of both systems, then each target ratio beside its target."""
    rows = []
    for name, f in figures.items():
        for phase in ("idle", "load"):
            s = f[phase]
            rows.append([name, phase, s["ttft_p50_s"], s["ttft_p95_s"], s["total_p50_s"],
                         s["total_p95_s"],
                         f["bulk_pages_per_s"] if phase == "idle" else f["load_pages_per_s"]])
    table = C.table(["system", "interactive", "TTFT p50 s", "TTFT p95 s", "total p50 s",
                     "total p95 s", "bulk pages/s (alone / with requests)"], rows)
    goals = targets(figures)
    met = goals["met"]

    def line(label: str, value: float | None, target: str, ok: bool | None) -> str:
        shown = "n/a" if value is None else f"{value:.3f}"
        verdict = "" if ok is None else (" met" if ok else " NOT met")
        return f"{label}: {shown} (target {target}){verdict}"

    return "\n".join([
        table, "",
        line("vlmq TTFT p95 under load / idle", goals["vlmq_ttft_p95_load_over_idle"],
             f"<= {TARGET_TTFT_LOAD_OVER_IDLE}", met["load_over_idle"]),
        line("vlmq TTFT p95 under load / mlx-vlm's under load",
             goals["vlmq_ttft_p95_load_over_mlx_vlm"], f"<= {TARGET_TTFT_OVER_MLX}",
             met["over_mlx_vlm"]),
        line("vlmq bulk pages/s with requests / without", goals["vlmq_bulk_with_over_without"],
             f">= {TARGET_BULK_KEPT}", met["bulk_kept"]),
    ])


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    raise SystemExit(main())
