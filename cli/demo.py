"""`vlmq demo`: the whole product on one machine in one command.

Enqueue the bundled sample, run a burst worker, print results and stats; then run the
same jobs again on a restarted worker to show the disk cache turning every image into a
hit. With no --model (or `--model reader`) it runs the tiny reader trained here
(worker/model/reader) on its own sample pages (a 3-page typed PDF and two images) and
prints what it read beside the text rendered there, with the character error rate.
`--model tiny` runs the tiny random-weight model, any other --model the general sample
(a multi-page PDF for OCR, a few images for captioning).
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from importlib import resources
from pathlib import Path

import click
from rq import Queue
from rq.serializers import JSONSerializer

from vlmq.cli.progress import warn
from vlmq.producer.client import Client, Job
from vlmq.shared import constants as C
from vlmq.shared.redis_text import as_str
from vlmq.shared.urls import redact_url
from vlmq.worker.default_dirs import default_cache_dir
from vlmq.worker.loop import WorkerConfig, run_worker
from vlmq.worker.model.reader.data import cer
from vlmq.worker.redis_server import PrivateRedis, answers, start_private

DEMO_QUEUE_PREFIX = "vlmq-demo-"
TINY_MAX_SIDE = 224
TINY_MAX_TOKENS = 24
READER = "reader"  # the default: the tiny reader (worker/model/reader)
TINY = "tiny"  # the tiny random-weight model
READER_MAX_TOKENS = 96


def sample_files() -> tuple[list[Path], list[Path]]:
    folder = Path(str(resources.files("vlmq.producer").joinpath("samples")))
    files = sorted(p for p in folder.iterdir()
                   if p.is_file() and not p.name.startswith("reader"))
    pdfs = [p for p in files if p.suffix.lower() == ".pdf"]
    images = [p for p in files if p.suffix.lower() in {".png", ".jpg", ".jpeg", ".webp"}]
    return pdfs, images


def demo_queues() -> list[str]:
    """Queues of this demo run alone: two demos on one Redis (or a worker someone left on
    fixed demo queues) would otherwise take each other's jobs, each seeing none of its own."""
    run = f"{os.getpid()}-{secrets.token_hex(4)}"
    return [f"{DEMO_QUEUE_PREFIX}{run}-ocr", f"{DEMO_QUEUE_PREFIX}{run}-caption"]


def _enqueue(client: Client, tiny: bool, reading: bool, queues: list[str]) -> list[Job]:
    if reading:
        from vlmq.worker.model import reader
        from vlmq.worker.model.reader.samples import sample_paths

        # The reader was trained on pages of exactly this size: --max-side 448.
        return [client.ocr(sample_paths(), queue=queues[0], max_side=reader.MAX_SIDE,
                           max_tokens=READER_MAX_TOKENS, labels={"demo": "reader"},
                           text_layer="off")]  # the PDF is typed: show the model reading it
    pdfs, images = sample_files()
    side = TINY_MAX_SIDE if tiny else None
    tokens = TINY_MAX_TOKENS if tiny else None
    return [
        client.ocr(pdfs, queue=queues[0], max_side=side, max_tokens=tokens,
                   labels={"demo": "ocr"}),
        client.caption(images, queue=queues[1], max_side=side, max_tokens=tokens,
                       labels={"demo": "caption"}),
    ]


def round_problem(jobs: list[Job], totals: dict[str, int]) -> str | None:
    """Why a round did not show the demo's own work (None when it did): every job of ours
    finished, with a result for each of its items. Anything less is a failed demo, not
    "0/0 items ok"."""
    expected = sum(job.items for job in jobs)
    states = {job.id: job.status() for job in jobs}
    unfinished = {k: v for k, v in states.items() if v != "finished"}
    if not unfinished and totals["items"] == expected and expected > 0:
        return None
    listed = ", ".join(f"{k} {v}" for k, v in sorted(unfinished.items())) or "none"
    return (f"the worker finished {totals['items']} of this demo's {expected} items "
            f"(jobs not finished: {listed}); did another worker take them from its queues?")


def _show(jobs: list[Job], truth: dict[tuple[str, int], str] | None) -> dict[str, int]:
    """Print each job's results (beside the rendered text when `truth` knows it)."""
    totals = {"items": 0, "ok": 0, "cache_hits": 0, "tokens": 0}
    for job in jobs:
        click.secho(f"\njob {job.id} ({job.queue}): {job.status()}", bold=True)
        rates = []
        for r in job.results():
            name = Path(r.source).name
            where = f"{name} p{r.page}" if r.page else name
            body = r.text if r.error is None else f"ERROR: {r.error}"
            hit = " [cache hit]" if r.vision_cache_hit else ""
            written = None if truth is None else truth.get((name, r.page or 0))
            if written is None:
                flat = " ".join((body or "").split())
                click.echo(f"  {where:<22} {flat[:70]!r}{hit}")
                continue
            rates.append(cer(r.text or "", written))
            click.echo(f"  {where:<22} CER {rates[-1]:6.1%}{hit}")
            click.echo(f"    read:     {' | '.join((body or '').splitlines())}")
            click.echo(f"    rendered: {' | '.join(written.splitlines())}")
        if rates:
            click.echo(f"  character error rate: {sum(rates) / len(rates):.1%} "
                       f"over {len(rates)} pages")
        summary = job.summary() or {}
        click.echo(f"  summary: {summary}")
        totals["items"] += int(summary.get("items", 0))
        totals["ok"] += int(summary.get("ok", 0))
        totals["cache_hits"] += int(summary.get("cache_hits", 0))
        totals["tokens"] += int(summary.get("completion_tokens", 0))
    return totals


def _clean_up(client: Client, jobs: list[Job], worker: str, queues: list[str]) -> None:
    """Leave a shared Redis as we found it: the demo's jobs, results, events, queues,
    stats and uploaded samples go (a sample some other job also names stays)."""
    keys = client.keys
    client.delete([job.id for job in jobs], purge_blobs=True)
    for name in queues:
        Queue(name, connection=client.redis, serializer=JSONSerializer).delete(delete_jobs=True)
    client.redis.delete(keys.worker_stats(worker))


def worker_name(run: int) -> str:
    return f"demo-{os.getpid()}-{run + 1}"


def run_demo(*, redis_url: str | None, model: str | None, max_batch: int) -> int:
    url = redis_url or os.environ.get("REDIS_URL") or C.DEFAULT_REDIS_URL
    private: PrivateRedis | None = None
    if not answers(url):
        private = start_private()
        click.echo(f"no Redis at {redact_url(url)}: started a private {Path(private.binary).name} "
                   f"at {private.url} for this demo")
        url = private.url
    try:
        tiny, reading = model == TINY, model in (None, READER)
        truth = None
        if tiny:
            from vlmq.worker.model.tiny import build_tiny_model

            model = str(build_tiny_model(default_cache_dir() / "models" / "tiny-qwen2_vl"))
            click.secho("NOTE: --model tiny: a tiny model with RANDOM "
                        "weights that vlmq builds offline: its text is gibberish by design. "
                        "It shows the queue, the batching and the cache, not a model.",
                        fg="yellow")
        if reading:
            from vlmq.worker.model import reader
            from vlmq.worker.model.reader.samples import sample_truth

            model = str(reader.weights_dir())
            truth = sample_truth()
            click.secho("NOTE: no --model given, so this demo uses vlmq's tiny reader: a "
                        "3 M-parameter qwen2_vl trained here to read one printed line of "
                        "capitals and digits (nothing else). --model picks a real one.",
                        fg="yellow")
        assert model is not None
        with tempfile.TemporaryDirectory(prefix="vlmq-demo-cache-") as cache_dir:
            rounds = []
            for n, label in enumerate(("cold cache", "warm cache, restarted worker")):
                client = Client(url, on_warning=warn)
                queues = demo_queues()
                jobs = _enqueue(client, tiny, reading, queues)
                click.secho(f"\n== {label}: enqueued {sum(j.items for j in jobs)} items "
                            f"in {len(jobs)} jobs; running a burst worker", bold=True)
                t0 = time.monotonic()
                rc = run_worker(WorkerConfig(
                    redis_url=url, model=model, queues=queues, burst=True,
                    max_batch=max_batch, cache_dir=Path(cache_dir), name=worker_name(n),
                    stats_s=1.0,
                    # The demo shows the vision cache: the result cache would answer the
                    # warm round without it (and leave entries in the user's Redis).
                    result_cache_bytes=0))
                wall = time.monotonic() - t0
                if rc != 0:
                    return rc
                totals = _show(jobs, truth)
                problem = round_problem(jobs, totals)
                raw = client.redis.hgetall(client.keys.worker_stats(worker_name(n)))
                stats = {as_str(k): as_str(v) for k, v in raw.items()}
                rounds.append((label, wall, totals, stats))
                if private is None:
                    _clean_up(client, jobs, worker_name(n), queues)
                client.close()
                if problem is not None:
                    click.secho(f"vlmq demo: {label}: {problem}", fg="red", err=True)
                    return 1
        click.secho("\n== stats", bold=True)
        for label, wall, t, st in rounds:
            click.echo(f"  {label:<30} {t['ok']}/{t['items']} items ok, "
                       f"{t['cache_hits']} vision-cache hits, {t['tokens']} tokens, "
                       f"{wall:.1f} s with model load")
            click.echo(f"  {'':<30} worker stats: {st.get('tower_calls')} vision-tower calls, "
                       f"{st.get('pdf_renders')} PDF renders, {st.get('image_decodes')} image "
                       f"decodes, cache hit rate {st.get('cache_hit_rate')}")
        return 0
    finally:
        if private is not None:
            private.stop()
