"""Worker-side commands (`vlmq worker`, `vlmq model make-tiny`, `vlmq model check`).

They join the root group (vlmq.cli.main), so this module imports only click, the
standard library and the families' data (vlmq.worker.engine.families, no MLX); MLX loads inside
the command bodies, where it is needed, after a check that says which install extra is
missing.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import click

from vlmq.cli.common import store_option
from vlmq.shared import constants as C
from vlmq.shared.keys import QUEUE_NAME_RE
from vlmq.stores.backends import Stores
from vlmq.worker.default_dirs import default_cache_dir
from vlmq.worker.engine import families
from vlmq.worker.engine.batch_size import DEFAULT_CAP

if TYPE_CHECKING:  # the service loads MLX; the commands import it in their bodies
    from vlmq.worker.loop import WorkerConfig

__all__ = ["default_cache_dir", "register"]

# What the worker extra installs and the worker commands import.
WORKER_MODULES = ("mlx", "mlx_vlm")

DEFAULT_QUEUES = tuple(C.DEFAULT_QUEUE[task] for task in C.TASKS)


def require_worker_extra() -> None:
    """One clear line on a producer-only install instead of an ImportError traceback."""
    missing = [m for m in WORKER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(
            f"this command needs the worker extra ({', '.join(missing)} not installed): "
            "pip install 'vlmq[worker]'")


def _split_queues(values: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for value in values:
        for name in value.replace(",", " ").split():
            if name not in out:
                out.append(name)
    return out


def _checked_queues(values: tuple[str, ...]) -> list[str]:
    """--queues as names in priority order (the defaults when none is given), refused before
    the model loads when one is not a queue name."""
    queues = _split_queues(values) or list(DEFAULT_QUEUES)
    bad = [q for q in queues if not QUEUE_NAME_RE.fullmatch(q)]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not a queue name (letters, digits, _ . -)",
                                 param_hint="--queues")
    return queues


@click.command("worker")
@click.option("--model", "model", required=True,
              help="Local model folder, or a hub id (mlx-community/...).")
@click.option("--queues", "queues_opt", multiple=True, metavar="Q1,Q2,...",
              help="Queues to serve, in priority order, comma-separated: --queues ocr,caption "
                   "(repeatable; default: ocr,caption,generate).")
@click.option("--burst", is_flag=True, help="Exit once the queues are empty and all work is done.")
@click.option("--max-batch", type=click.IntRange(1, 256), default=DEFAULT_CAP, show_default=True,
              help="Most sequences decoded together. The batch starts at 8 and grows "
                   "while measured tokens/s keeps rising (the worker logs what it chose "
                   "and why); --fixed-batch uses exactly this many.")
@click.option("--fixed-batch", is_flag=True,
              help="Decode exactly --max-batch sequences together: no measuring.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Disk tier of the vision-feature cache (default: ~/.cache/vlmq/vision).")
@click.option("--cache-mem-mb", type=click.IntRange(0), default=1024, show_default=True,
              help="Memory tier of the vision-feature cache (LRU by bytes).")
@click.option("--cache-disk-gb", type=click.FloatRange(0), default=10.0, show_default=True,
              help="Disk tier bound (LRU); survives restarts.")
@click.option("--name", default=None, help="Worker name (default: host.pid).")
@click.option("--grace", type=click.FloatRange(0), default=30.0, show_default=True,
              help="Seconds to finish in-flight items after SIGTERM/SIGINT before requeueing.")
@click.option("--prep-threads", type=click.IntRange(1, 64), default=None,
              help="CPU threads for fetch/decode/render/tokenize (default: cores, at most 4).")
@click.option("--heartbeat-ttl", type=click.IntRange(1), default=None,
              help="Seconds without a heartbeat after which this worker's jobs count as "
                   "abandoned and are requeued (default 90).")
@click.option("--on-repetition", type=click.Choice(["stop", "retry"]), default="stop",
              show_default=True,
              help="A row whose tail loops is stopped (finish_reason 'repetition', text kept "
                   "up to the first repeat), or retried once at temperature 0.7.")
@click.option("--repetition-repeats", type=click.IntRange(0), default=8, show_default=True,
              help="Repeats of a block that count as a loop (0: guard off).")
@click.option("--repetition-min-span", type=click.IntRange(1), default=32, show_default=True,
              help="Tokens a loop must cover, so short runs of one token are left alone.")
@click.option("--repetition-period", type=click.IntRange(1, 1024), default=64,
              show_default=True, help="Longest repeating block, in tokens.")
@click.option("--result-cache-ttl", type=click.IntRange(1), default=30 * 24 * 3600,
              show_default=True, metavar="S",
              help="Seconds a finished item's text stays in the shared result cache "
                   "(in Redis, for every worker).")
@click.option("--result-cache-mb", type=click.FloatRange(0), default=256.0, show_default=True,
              help="Byte budget of the shared result cache; the oldest entries go first. "
                   "0 turns it off for the items this worker runs.")
@click.option("--with-scheduler", is_flag=True,
              help="Also fire schedules (vlmq schedule) from this process, as `vlmq "
                   "scheduler` does; any number of schedulers may run.")
@click.option("--render-mem-mb", type=click.IntRange(64), default=1024, show_default=True,
              help="Memory limit of each render process (PDF pages, images, TIFF pages), "
                   "and the largest referenced input read; an item over it fails alone.")
@click.option("--render-timeout", type=click.FloatRange(0.1), default=60.0, show_default=True,
              help="Seconds one PDF page, image or TIFF page may take to decode before it "
                   "fails alone.")
@click.option("--render-procs", type=click.IntRange(1, 64), default=None,
              help="Render processes, which decode every input (default: --prep-threads).")
@click.option("--max-kv-tokens", type=click.IntRange(1), default=None,
              help="Admit a sequence only while the sum of (prompt + max_tokens) in flight "
                   "stays under this (default: from the model's KV size and the machine's "
                   "memory); a longer request runs alone.")
@click.option("--poison-kills", type=click.IntRange(1), default=2, show_default=True,
              help="A job whose item was being processed when this many workers died is "
                   "failed, naming the item (other jobs of a dead worker keep their retries).")
@click.option("--blas", "blas_choice", default=None, metavar="auto|reference|PATH",
              help="BLAS for MLX's CPU matmuls on Linux: auto (system OpenBLAS, else the "
                   "wheel copy), reference (the slow one mlx[cpu] links) or a library path "
                   "(default: $VLMQ_BLAS, else auto).")
@click.option("--allow-eviction", is_flag=True,
              help="Run even though Redis's maxmemory-policy may evict keys (a warning "
                   "still says what that loses); also $VLMQ_ALLOW_EVICTION=1.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: off).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Interface the metrics endpoint listens on (0.0.0.0: every interface).")
@store_option
@click.pass_context
def worker_cmd(ctx: click.Context, model: str, queues_opt: tuple[str, ...], burst: bool,
               max_batch: int, fixed_batch: bool,
               cache_dir: Path | None, cache_mem_mb: int, cache_disk_gb: float,
               name: str | None, grace: float, prep_threads: int | None,
               heartbeat_ttl: int | None, on_repetition: str, repetition_repeats: int,
               repetition_min_span: int, repetition_period: int,
               result_cache_ttl: int, result_cache_mb: float, with_scheduler: bool,
               render_mem_mb: int, render_timeout: float, render_procs: int | None,
               max_kv_tokens: int | None, poison_kills: int,
               blas_choice: str | None, allow_eviction: bool, metrics_port: int,
               metrics_host: str, stores: Stores) -> None:
    """Serve jobs with one loaded model and a continuous batcher.

    Items from every job in flight share one batch; each result is written the moment it
    is done. SIGTERM/SIGINT: stop taking jobs, finish in-flight items within --grace,
    requeue the rest (their finished items are kept), exit 0.
    """
    require_worker_extra()
    from vlmq.worker.engine.repetition import RepetitionGuard
    from vlmq.worker.loop import WorkerConfig, run_worker

    queues = _checked_queues(queues_opt)
    redis_url = ctx.obj["redis_url"] if ctx.obj else os.environ.get("REDIS_URL")
    cfg = WorkerConfig(
        redis_url=redis_url or C.DEFAULT_REDIS_URL,
        model=model,
        queues=queues,
        burst=burst,
        max_batch=max_batch,
        auto_batch=not fixed_batch,
        cache_dir=cache_dir if cache_dir is not None else default_cache_dir() / "vision",
        cache_mem_bytes=cache_mem_mb * 1024 * 1024,
        cache_disk_bytes=int(cache_disk_gb * 1024**3),
        name=name or f"{socket.gethostname()}.{os.getpid()}",
        grace_s=grace,
        prep_threads=prep_threads or min(4, os.cpu_count() or 2),
        heartbeat_ttl=heartbeat_ttl,
        repetition=None if repetition_repeats == 0 else RepetitionGuard(
            max_period=repetition_period, min_repeats=max(2, repetition_repeats),
            min_span=repetition_min_span, on_repetition=on_repetition),
        result_cache_ttl_s=result_cache_ttl,
        result_cache_bytes=int(result_cache_mb * 1024 * 1024),
        render_procs=render_procs,
        render_mem_mb=render_mem_mb,
        render_timeout_s=render_timeout,
        max_kv_tokens=max_kv_tokens,
        poison_kills=poison_kills,
        blas=blas_choice,
        allow_eviction=allow_eviction or None,
        stores=stores,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
    if not with_scheduler:
        ctx.exit(run_worker(cfg))
    ctx.exit(_run_with_scheduler(ctx, cfg, stores))


def _run_with_scheduler(ctx: click.Context, cfg: WorkerConfig, stores: Stores) -> int:
    """The worker with the scheduler loop beside it, stopped when the worker ends.

    The loop is the producer's (it enqueues): the root command passes it in, so the worker
    imports nothing from the producer.
    """
    from vlmq.worker.loop import run_worker

    if not ctx.obj or "start_scheduler" not in ctx.obj:
        raise click.UsageError("--with-scheduler needs the `vlmq` root command")
    thread, stop = ctx.obj["start_scheduler"](cfg.redis_url, stores)
    try:
        return run_worker(cfg)
    finally:
        stop.set()
        thread.join(timeout=30)


@click.group("model")
def model_group() -> None:
    """Model utilities."""


@model_group.command("make-tiny")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(families.names()), default="qwen2_vl",
              show_default=True, help="mlx-vlm model family to build.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--size", type=click.Choice(["tiny", "bench"]), default="tiny", show_default=True,
              help="tiny: 0.8 M parameters, for tests; bench: ~20 M, for benchmarks/run.py.")
def make_tiny_cmd(out_dir: Path, arch: str, seed: int, size: str) -> None:
    """Build a tiny random-weight model (real mlx-vlm format) for tests and offline demos."""
    require_worker_extra()
    from vlmq.worker.model.tiny import build_tiny_model

    path = build_tiny_model(out_dir, arch=arch, seed=seed, size=size)
    click.echo(str(path))


@model_group.command("check")
@click.argument("model")
@click.option("--max-tokens", type=click.IntRange(1, 4096), default=32, show_default=True,
              help="New tokens per image.")
@click.option("--max-batch", type=click.IntRange(2, 64), default=4, show_default=True,
              help="Batch size for the batched speed figure.")
def check_cmd(model: str, max_tokens: int, max_batch: int) -> None:
    """Check a model before serving it: run this first on any new model.

    Loads MODEL (hub id or folder), runs 2 images sequentially with mlx-vlm's own
    generate and then batched through the worker's engine, and reports the family,
    whether batched output is token-identical (exit 1 if not), whether vision
    features can be cached, the preset jobs get, and tokens/s at batch 1 and batched.
    """
    from vlmq.worker.engine.mlx_adapter import ModelLoadError
    from vlmq.worker.model.check import check_model

    try:
        report = check_model(model, max_tokens=max_tokens, max_batch=max_batch)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
    for line in report.lines():
        click.echo(line)
    if not report.parity:
        raise click.exceptions.Exit(1)


def register(group: click.Group) -> None:
    group.add_command(worker_cmd)
    group.add_command(model_group)
