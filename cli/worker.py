"""Worker-side commands (`vlmq worker`, `vlmq model make-tiny`, `vlmq model check`).

They join the root group (vlmq.cli.main), so this module imports only click, the
standard library, the worker's option table (vlmq.worker.options) and the families' data
(vlmq.worker.model.families), no MLX; MLX loads inside the command bodies, where it is
needed, after a check that says which install extra is missing. `vlmq worker`'s options are
the table's rows (worker_options).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from vlmq.cli.common import (
    EXIT_CONFIG,
    EXIT_FAILED,
    ConfigError,
    config_store_option,
    fail,
)
from vlmq.cli.logs import LogSettings
from vlmq.shared import constants as C
from vlmq.worker import options
from vlmq.worker.model import families
from vlmq.worker.model.default_dirs import default_cache_dir

if TYPE_CHECKING:  # the service loads MLX; the commands import it in their bodies
    from vlmq.worker.jobs.starting import Starting
    from vlmq.worker.loop import WorkerConfig

__all__ = ["default_cache_dir", "register"]

# What the worker extra installs and the worker commands import.
WORKER_MODULES = ("mlx", "mlx_vlm")

F = TypeVar("F", bound=Callable[..., Any])


def require_worker_extra() -> None:
    """One clear line on a producer-only install instead of an ImportError traceback."""
    missing = [m for m in WORKER_MODULES if importlib.util.find_spec(m) is None]
    if missing:  # no restart installs it: exit 78, which the service units do not restart
        raise ConfigError(
            f"this command needs the worker extra ({', '.join(missing)} not installed): "
            "pip install 'vlmq[worker]'")


def _quiet() -> None:
    """Library lines that say nothing to an operator, filtered before transformers loads."""
    from vlmq.worker.model.mlx_adapter import quiet_library_noise

    quiet_library_noise()


def _whole(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


def _click_type(row: options.WorkerOption) -> Any:
    if row.kind == "int":
        return click.IntRange(_whole(row.lo), _whole(row.hi))
    if row.kind == "float":
        return click.FloatRange(row.lo, row.hi)
    if row.kind == "choice":
        return click.Choice(row.choices)
    if row.kind == "path":
        return click.Path(file_okay=False, path_type=Path)
    return None


def click_option(row: options.WorkerOption) -> Callable[[F], F]:
    """The click option of one table row."""
    if row.kind == "stores":  # the --store every command shares, a bad one exiting 78
        return config_store_option
    kw: dict[str, Any] = {"help": row.help, "metavar": row.metavar, "envvar": row.envvar}
    if row.kind == "flag":
        kw["is_flag"] = True
    elif row.kind == "strs":
        kw["multiple"] = True
    else:
        kw.update(type=_click_type(row), required=row.required)
    if not row.required and row.kind != "strs":
        kw.update(default=row.default, show_default=row.show_default)
    return click.option(row.cli_flag, row.name, **kw)


def worker_options(rows: Sequence[options.WorkerOption] = options.OPTIONS) -> Callable[[F], F]:
    """A click option per table row, in the table's order; the command gets each value
    under the row's name."""
    def decorate(func: F) -> F:
        for row in reversed(rows):
            func = click_option(row)(func)
        return func

    return decorate


def config_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """WorkerConfig's arguments from the options' values; a value the table's conversion
    refuses (a queue name) is a usage error naming its option, before any model loads."""
    try:
        return options.config_values(values)
    except options.OptionError as exc:
        raise click.BadParameter(exc.message, param_hint=exc.flag) from None


@click.command("worker")
@worker_options()
@click.pass_context
def worker_cmd(ctx: click.Context, /, **values: Any) -> None:
    """Serve jobs with one loaded model and a continuous batcher.

    Items from every job in flight share one batch; each result is written the moment it
    is done. SIGTERM/SIGINT: stop taking jobs, finish in-flight items within --grace,
    requeue the rest (their finished items are kept), exit 0.
    """
    if values.pop("print_config"):
        _print_config(ctx)
    require_worker_extra()
    LogSettings.from_values(values).configure()
    redis_url = ctx.obj["redis_url"] if ctx.obj else os.environ.get("REDIS_URL")
    settings = config_values(values)
    with _starting(redis_url or C.DEFAULT_REDIS_URL, settings):
        _quiet()
        from vlmq.worker.loop import WorkerConfig, run_worker

        cfg = WorkerConfig(redis_url=redis_url or C.DEFAULT_REDIS_URL, **settings)
        if not values["with_scheduler"]:
            ctx.exit(run_worker(cfg))
        ctx.exit(_run_with_scheduler(ctx, cfg))


def _starting(redis_url: str, settings: Mapping[str, Any]) -> Starting:
    """The worker's presence while it imports MLX and loads its model (worker/jobs/
    starting.py): producers enqueueing meanwhile count it as serving its queues. Its keys
    are WorkerConfig's default ($VLMQ_PREFIX)."""
    from vlmq.shared.keys import Keys
    from vlmq.worker.jobs.starting import Starting

    return Starting(redis_url, Keys.from_env(), settings["name"], settings["queues"])


def _print_config(ctx: click.Context) -> None:
    """--print-config: the values as parsed, before the worker extra or a model is needed."""
    from vlmq.cli import config
    from vlmq.shared.urls import redact_url

    def shown(name: str, value: Any) -> Any:
        if name == "redis_url" and value:
            return redact_url(str(value))
        if name == "stores":
            return [options.store_spec(store) for store in options.stores(value)]
        return value

    for line in config.render(ctx, ctx.find_root().meta.get(config.CONFIG_META), shown):
        click.echo(line)
    ctx.exit(0)


def _run_with_scheduler(ctx: click.Context, cfg: WorkerConfig) -> int:
    """The worker with the scheduler loop beside it, stopped when the worker ends.

    The loop is the producer's (it enqueues): the root command passes it in, so the worker
    imports nothing from the producer.
    """
    from vlmq.worker.loop import run_worker

    if not ctx.obj or "start_scheduler" not in ctx.obj:
        raise click.UsageError("--with-scheduler needs the `vlmq` root command")
    thread, stop = ctx.obj["start_scheduler"](cfg.redis_url, cfg.stores)
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
              help="tiny: 0.8 M parameters, for tests; bench: ~20 M, for benchmarks.")
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
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as one JSON object (errors as JSON on stderr).")
def check_cmd(model: str, max_tokens: int, max_batch: int, as_json: bool) -> None:
    """Check a model before serving it: run this first on any new model.

    Loads MODEL (hub id, folder, or a name: reader, tiny; see `vlmq worker --help`),
    runs 2 images sequentially with mlx-vlm's own generate and then batched through
    the worker's engine, and reports the family,
    whether batched output is token-identical (exit 1 if not), whether vision
    features can be cached, the preset jobs get, and tokens/s at batch 1 and batched.
    A model that cannot load exits 78 (1 when the hub is out of reach: try again).
    """
    require_worker_extra()
    _quiet()
    from vlmq.worker.model import blas

    blas.select()  # before MLX loads, as the worker does: the speed figures are its own
    from vlmq.worker.engine.check import check_model
    from vlmq.worker.model.mlx_adapter import ModelLoadError

    try:
        report = check_model(model, max_tokens=max_tokens, max_batch=max_batch)
    except ModelLoadError as exc:
        fail(f"error: {exc}", EXIT_FAILED if exc.network else EXIT_CONFIG)
    if as_json:
        click.echo(json.dumps(report.as_json()))
    else:
        for line in report.lines():
            click.echo(line)
    if not report.parity:
        raise click.exceptions.Exit(EXIT_FAILED)


def register(group: click.Group) -> None:
    group.add_command(worker_cmd)
    group.add_command(model_group)
