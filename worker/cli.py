"""Worker-side commands (`vlmq worker`, `vlmq model make-tiny`, `vlmq demo`).

They join the producer's click group, so this module imports only click and the
standard library; MLX loads inside the command bodies, where it is needed.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import click

from vlmq.shared import constants as C
from vlmq.shared.keys import QUEUE_NAME_RE

DEFAULT_QUEUES = tuple(C.DEFAULT_QUEUE[task] for task in C.TASKS)


def _split_queues(values: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for value in values:
        for name in value.replace(",", " ").split():
            if name not in out:
                out.append(name)
    return out


@click.command("worker")
@click.option("--model", "model", required=True,
              help="Local model folder, or a hub id (mlx-community/...).")
@click.option("--queues", "queues_opt", multiple=True,
              help="Queues to serve, in priority order: --queues ocr caption "
                   "(default: ocr caption generate).")
@click.argument("extra_queues", nargs=-1)
@click.option("--burst", is_flag=True, help="Exit once the queues are empty and all work is done.")
@click.option("--max-batch", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Sequences decoded together.")
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
@click.option("--blas", "blas_choice", default=None, metavar="auto|reference|PATH",
              help="BLAS for MLX's CPU matmuls on Linux: auto (system OpenBLAS, else the "
                   "wheel copy), reference (the slow one mlx[cpu] links) or a library path "
                   "(default: $VLMQ_BLAS, else auto).")
@click.pass_context
def worker_cmd(ctx: click.Context, model: str, queues_opt: tuple[str, ...],
               extra_queues: tuple[str, ...], burst: bool, max_batch: int,
               cache_dir: Path | None, cache_mem_mb: int, cache_disk_gb: float,
               name: str | None, grace: float, prep_threads: int | None,
               heartbeat_ttl: int | None, blas_choice: str | None) -> None:
    """Serve jobs with one loaded model and a continuous batcher.

    Items from every job in flight share one batch; each result is written the moment it
    is done. SIGTERM/SIGINT: stop taking jobs, finish in-flight items within --grace,
    requeue the rest (their finished items are kept), exit 0.
    """
    from vlmq.worker.service import WorkerConfig, run_worker

    queues = _split_queues(queues_opt + extra_queues) or list(DEFAULT_QUEUES)
    bad = [q for q in queues if not QUEUE_NAME_RE.match(q)]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not a queue name (letters, digits, _ . -)",
                                 param_hint="--queues")
    redis_url = ctx.obj["redis_url"] if ctx.obj else os.environ.get("REDIS_URL")
    cfg = WorkerConfig(
        redis_url=redis_url or C.DEFAULT_REDIS_URL,
        model=model,
        queues=queues,
        burst=burst,
        max_batch=max_batch,
        cache_dir=cache_dir if cache_dir is not None else default_cache_dir() / "vision",
        cache_mem_bytes=cache_mem_mb * 1024 * 1024,
        cache_disk_bytes=int(cache_disk_gb * 1024**3),
        name=name or f"{socket.gethostname()}.{os.getpid()}",
        grace_s=grace,
        prep_threads=prep_threads or min(4, os.cpu_count() or 2),
        heartbeat_ttl=heartbeat_ttl,
        blas=blas_choice,
    )
    ctx.exit(run_worker(cfg))


def default_cache_dir() -> Path:
    """VLMQ_CACHE, else $XDG_CACHE_HOME/vlmq, else ~/.cache/vlmq."""
    if os.environ.get("VLMQ_CACHE"):
        return Path(os.environ["VLMQ_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vlmq"


@click.group("model")
def model_group() -> None:
    """Model utilities."""


@model_group.command("make-tiny")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(["qwen2_vl", "qwen2_5_vl"]), default="qwen2_vl",
              show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--size", type=click.Choice(["tiny", "bench"]), default="tiny", show_default=True,
              help="tiny: 0.8 M parameters, for tests; bench: ~20 M, for benchmarks/run.py.")
def make_tiny_cmd(out_dir: Path, arch: str, seed: int, size: str) -> None:
    """Build a tiny random-weight model (real mlx-vlm format) for tests and offline demos."""
    from vlmq.worker.tiny_model import build_tiny_model

    path = build_tiny_model(out_dir, arch=arch, seed=seed, size=size)
    click.echo(str(path))


@click.command("demo")
@click.option("--model", default=None,
              help="Model to use (default: build the tiny random-weight model).")
@click.option("--max-batch", type=click.IntRange(1, 256), default=8, show_default=True)
@click.pass_context
def demo_cmd(ctx: click.Context, model: str | None, max_batch: int) -> None:
    """Enqueue the bundled sample, run a burst worker on it, and show results and stats."""
    from vlmq.worker.demo import run_demo

    redis_url = ctx.obj.get("redis_url") if ctx.obj else None
    ctx.exit(run_demo(redis_url=redis_url, model=model, max_batch=max_batch))


def register(group: click.Group) -> None:
    group.add_command(worker_cmd)
    group.add_command(model_group)
    group.add_command(demo_cmd)
