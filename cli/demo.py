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

import json
import os
import secrets
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import click
from rq import Queue
from rq.serializers import JSONSerializer

from vlmq.cli.common import EXIT_FAILED, fail
from vlmq.cli.logs import LogSettings
from vlmq.cli.progress import warn
from vlmq.producer.client import Client, Job
from vlmq.shared import constants as C
from vlmq.shared.redis_text import as_str
from vlmq.shared.urls import redact_url
from vlmq.worker.loop import WorkerConfig, run_worker
from vlmq.worker.model import names
from vlmq.worker.model.reader.data import cer
from vlmq.worker.redis_server import PrivateRedis, answers, start_private

DEMO_QUEUE_PREFIX = "vlmq-demo-"
TINY_MAX_SIDE = 224
TINY_MAX_TOKENS = 24
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


# The summary figures a job's table shows, as (heading, summary key).
SUMMARY_COLUMNS = (("items", "items"), ("ok", "ok"), ("failed", "failed"),
                   ("vision-cache hits", "cache_hits"), ("prompt tokens", "prompt_tokens"),
                   ("new tokens", "completion_tokens"), ("seconds", "wall_s"))


def summary_table(summary: dict[str, Any]) -> list[str]:
    """A job's summary as a two-line table (headings, figures) under it."""
    cells = [(head, str(summary.get(key, "-"))) for head, key in SUMMARY_COLUMNS]
    widths = [max(len(head), len(value)) for head, value in cells]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in ([h for h, _ in cells], [v for _, v in cells])]


def _job_report(job: Job, truth: dict[tuple[str, int], str] | None) -> dict[str, Any]:
    """What the demo shows of one job: its results (with the character error rate beside
    the rendered text when `truth` knows it) and its summary."""
    results: list[dict[str, Any]] = []
    rates: list[float] = []
    for r in job.results():
        name = Path(r.source).name
        written = None if truth is None else truth.get((name, r.page or 0))
        if written is not None:
            rates.append(cer(r.text or "", written))
        results.append({"source": name, "page": r.page, "text": r.text, "error": r.error,
                        "vision_cache_hit": r.vision_cache_hit, "rendered": written,
                        "cer": None if written is None else rates[-1]})
    return {"id": job.id, "queue": job.queue, "status": job.status(), "results": results,
            "cer": sum(rates) / len(rates) if rates else None,
            "summary": job.summary() or {}}


def _print_job(job: dict[str, Any]) -> None:
    click.secho(f"\njob {job['id']} ({job['queue']}): {job['status']}", bold=True)
    for r in job["results"]:
        where = f"{r['source']} p{r['page']}" if r["page"] else r["source"]
        body = r["text"] if r["error"] is None else f"ERROR: {r['error']}"
        hit = " [cache hit]" if r["vision_cache_hit"] else ""
        if r["rendered"] is None:
            flat = " ".join((body or "").split())
            click.echo(f"  {where:<22} {flat[:70]!r}{hit}")
            continue
        click.echo(f"  {where:<22} CER {r['cer']:6.1%}{hit}")
        click.echo(f"    read:     {' | '.join((body or '').splitlines())}")
        click.echo(f"    rendered: {' | '.join(r['rendered'].splitlines())}")
    if job["cer"] is not None:
        click.echo(f"  character error rate: {job['cer']:.1%} over {len(job['results'])} pages")
    for line in summary_table(job["summary"]):
        click.echo(f"  {line}")


def _show(jobs: list[Job], truth: dict[tuple[str, int], str] | None,
          as_json: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Each job's report (printed unless `as_json`) and the round's totals."""
    totals = {"items": 0, "ok": 0, "cache_hits": 0, "tokens": 0}
    reports = []
    for job in jobs:
        report = _job_report(job, truth)
        reports.append(report)
        if not as_json:
            _print_job(report)
        summary = report["summary"]
        totals["items"] += int(summary.get("items", 0))
        totals["ok"] += int(summary.get("ok", 0))
        totals["cache_hits"] += int(summary.get("cache_hits", 0))
        totals["tokens"] += int(summary.get("completion_tokens", 0))
    return reports, totals


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


def _note(text: str, as_json: bool, **style: Any) -> None:
    """A line for the person watching: on stderr under --json, where stdout is the JSON."""
    click.secho(text, err=as_json, **style)


def run_demo(*, redis_url: str | None, model: str | None, max_batch: int,
             as_json: bool = False) -> int:
    """Run both rounds; print what they did (one JSON object with `as_json`)."""
    LogSettings().configure()  # the worker's lines, on stderr, as `vlmq worker` logs them
    url = redis_url or os.environ.get("REDIS_URL") or C.DEFAULT_REDIS_URL
    private: PrivateRedis | None = None
    if not answers(url):
        private = start_private()
        _note(f"no Redis at {redact_url(url)}: started a private {Path(private.binary).name} "
              f"at {private.url} for this demo", as_json)
        url = private.url
    try:
        # A name stays as typed (the worker's loader resolves it: worker/model/names.py).
        model = model or names.READER
        name = names.builtin(model)
        tiny, reading = name == names.TINY, name == names.READER
        truth = None
        if tiny:
            _note("NOTE: --model tiny: a tiny model with RANDOM "
                  "weights that vlmq builds offline: its text is gibberish by design. "
                  "It shows the queue, the batching and the cache, not a model.", as_json,
                  fg="yellow")
        if reading:
            from vlmq.worker.model.reader.samples import sample_truth

            truth = sample_truth()
            _note("NOTE: this demo uses vlmq's tiny reader (--model reader, the default): a "
                  "3 M-parameter qwen2_vl trained here on one line of capitals and digits "
                  "in 4 monospaced fonts at one size; other fonts and sizes read as noise. "
                  "--model picks a real one.", as_json, fg="yellow")
        with tempfile.TemporaryDirectory(prefix="vlmq-demo-cache-") as cache_dir:
            rounds: list[dict[str, Any]] = []
            for n, label in enumerate(("cold cache", "warm cache, restarted worker")):
                client = Client(url, on_warning=warn)
                queues = demo_queues()
                jobs = _enqueue(client, tiny, reading, queues)
                _note(f"\n== {label}: enqueued {sum(j.items for j in jobs)} items "
                      f"in {len(jobs)} jobs; running a burst worker", as_json, bold=True)
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
                reports, totals = _show(jobs, truth, as_json)
                problem = round_problem(jobs, totals)
                raw = client.redis.hgetall(client.keys.worker_stats(worker_name(n)))
                stats = {as_str(k): as_str(v) for k, v in raw.items()}
                rounds.append({"round": label, "wall_s": round(wall, 3), **totals,
                               "worker_stats": stats, "jobs": reports})
                if private is None:
                    _clean_up(client, jobs, worker_name(n), queues)
                client.close()
                if problem is not None:
                    fail(f"error: demo {label}: {problem}", EXIT_FAILED)
        if as_json:
            click.echo(json.dumps({"model": model, "rounds": rounds}))
        else:
            _print_stats(rounds)
        return 0
    finally:
        if private is not None:
            private.stop()


def _print_stats(rounds: list[dict[str, Any]]) -> None:
    click.secho("\n== stats", bold=True)
    for r in rounds:
        st = r["worker_stats"]
        click.echo(f"  {r['round']:<30} {r['ok']}/{r['items']} items ok, "
                   f"{r['cache_hits']} vision-cache hits, {r['tokens']} tokens, "
                   f"{r['wall_s']:.1f} s with model load")
        click.echo(f"  {'':<30} worker stats: {st.get('tower_calls')} vision-tower calls, "
                   f"{st.get('pdf_renders')} PDF renders, {st.get('image_decodes')} image "
                   f"decodes, cache hit rate {st.get('cache_hit_rate')}")
