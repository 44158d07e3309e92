"""`vlmq schedule add|list|run|remove|pause|resume` and `vlmq scheduler`."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

import click

from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, SCHEDULE_NAME, fail, store_option
from vlmq.cli.logs import LogSettings, log_options
from vlmq.cli.options import job_options
from vlmq.cli.progress import warn
from vlmq.producer.client import Client
from vlmq.producer.expand import S3_SCHEME
from vlmq.producer.ops.export import FORMATS
from vlmq.producer.ops.schedules import (
    TASKS,
    Schedule,
    ScheduleError,
    ScheduleStore,
    iso_time,
)
from vlmq.producer.options import JobOptions
from vlmq.server.scheduler import TICK_S, run_scheduler
from vlmq.shared.errors import PayloadError
from vlmq.stores.backends import Stores

_GLOB = frozenset("*?[")


def _store(ctx: click.Context) -> tuple[Client, ScheduleStore]:
    client = Client(ctx.obj["redis_url"], on_warning=warn)
    return client, ScheduleStore(client)


@click.group("schedule")
def schedule_group() -> None:
    """Scheduled, incremental caption/OCR/extract runs over folders (stored in Redis; fired by
    `vlmq scheduler` or `vlmq worker --with-scheduler`, each due time exactly once)."""


@schedule_group.command("add")
@click.argument("name", type=SCHEDULE_NAME)
@click.argument("task", type=click.Choice(TASKS))
@click.argument("paths", nargs=-1, required=True)
@click.option("--cron", help='Cron expression, e.g. "0 3 * * *" (in --tz).')
@click.option("--every", type=click.FloatRange(min=1), metavar="SECONDS",
              help="Run every SECONDS, counted from now.")
@click.option("--tz", default="UTC", show_default=True, help="Time zone of --cron.")
@click.option("--recursive", "-r", is_flag=True, help="Descend into folders.")
@job_options("schedule", refused="no schedule was added",
             labels={"help": "Label on every job of this schedule (repeatable); "
                             "schedule=NAME is always added."})
@click.option("--export", "export_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="When a run's job ends, write its results under DIR (see vlmq export).")
@click.option("--format", "export_format", type=click.Choice(FORMATS), default="md",
              show_default=True, help="Format of --export.")
@click.option("--sidecar", is_flag=True,
              help="When a run's job ends, write each result next to its input "
                   "(photo.jpg.txt).")
@click.option("--replace", is_flag=True,
              help="Replace a schedule of this name (its history and done marks stay; a "
                   "changed prompt or setting makes every file due again).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@store_option
@click.pass_context
def add_cmd(ctx: click.Context, name: str, task: str, paths: tuple[str, ...],
            cron: str | None, every: float | None, tz: str, recursive: bool,
            options: JobOptions, export_dir: str | None, export_format: str, sidecar: bool,
            replace: bool, as_json: bool, stores: Stores) -> None:
    """Add a schedule NAME running TASK over PATHS (folders, files, quoted globs); task
    extract needs --schema FILE.

    Paths (and s3://bucket/prefix URLs) are read by the scheduler, on its machine: files
    in its stores (`vlmq scheduler --store`) are enqueued by reference, the rest uploaded.
    Each run enqueues only files (and PDF pages) not yet done under the current settings.
    """
    remote = _check_paths(paths, stores, sidecar)
    try:
        sched = Schedule(
            name=name, task=task,
            paths=tuple(p if p in remote else os.path.abspath(p) for p in paths),
            every=every, cron=cron, tz=tz, recursive=recursive,
            settings=dict(options.given),
            export_dir=os.path.abspath(export_dir) if export_dir else None,
            export_format=export_format, sidecar=sidecar)
    except (ScheduleError, PayloadError) as exc:
        fail(f"error: {exc}", EXIT_BAD_INPUT)
    client, store = _store(ctx)
    with client:
        try:
            first = store.add(sched, replace=replace)
        except ScheduleError as exc:
            fail(f"error: {exc}", EXIT_BAD_INPUT)
    if as_json:
        click.echo(json.dumps({"name": name, "first_due": iso_time(first)}))
    else:
        click.echo(f"schedule {name} added; first run due {iso_time(first)}")


def _check_paths(paths: tuple[str, ...], stores: Stores, sidecar: bool) -> list[str]:
    """The s3:// paths among `paths`, checked as far as this machine can before the
    schedule is stored: a local path must exist or be a glob; an s3:// one in none of the
    stores given here is only warned about (the scheduler's machine may have it), and
    --sidecar, which writes next to local files, is refused with s3:// paths."""
    remote = [p for p in paths if p.startswith(S3_SCHEME)]
    for path in paths:
        if path in remote:
            if stores and stores.for_url(path) is None:
                click.echo(f"vlmq: warning: {path} is in none of the stores given here; "
                           "the scheduler needs a --store holding it", err=True)
        elif not os.path.exists(path) and not _GLOB & set(path):
            fail(f"error: {path}: no such file or folder", EXIT_BAD_INPUT)
    if remote and sidecar:
        fail("error: --sidecar writes next to local files; use --export DIR with s3:// "
             "paths", EXIT_BAD_INPUT)
    return remote


@schedule_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--runs", type=click.IntRange(0), default=5, show_default=True,
              help="Runs of history shown per schedule (text output).")
@click.pass_context
def list_cmd(ctx: click.Context, as_json: bool, runs: int) -> None:
    """Every schedule with its next due time and its run history."""
    client, store = _store(ctx)
    with client:
        described = [store.describe(n) for n in store.names()]
    if as_json:
        click.echo(json.dumps(described, indent=2))
        return
    if not described:
        click.echo("no schedules")
    for d in described:
        state = "paused" if d["paused"] else f"next {d['next_due']}"
        out = (f", export {d['export']}" if d["export"] else "") + \
            (", sidecars" if d["sidecar"] else "")
        click.echo(f"{d['name']}: {d['task']} {' '.join(d['paths'])}, {d['when']}, "
                   f"{state}{out}")
        for run in d["runs"][-runs:] if runs else []:
            click.echo("  " + _run_line(run))


def _run_line(run: dict[str, Any]) -> str:
    parts = [run["due"] + (" (manual)" if run.get("manual") else ""),
             f"job {run['job_id']}" if run.get("job_id") else "no job",
             f"{run.get('items', 0)} items", f"{run.get('skipped', 0)} skipped",
             run.get("status", "")]
    if run.get("ok") is not None:
        parts.append(f"{run['ok']} ok, {run.get('failed', 0)} failed")
    if run.get("exported") is not None:
        parts.append(f"{run['exported']} written")
    if run.get("missing"):
        parts.append("missing: " + ", ".join(run["missing"]))
    if run.get("bad"):
        parts.append(f"{len(run['bad'])} bad file(s)")
    if run.get("not_media"):
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(run["not_media"].items()))
        parts.append(f"{sum(run['not_media'].values())} file(s) not PDFs or images left "
                     f"out ({kinds})")
    if run.get("refused"):
        parts.append(f"{len(run['refused'])} output(s) refused")
    if run.get("kept"):
        parts.append(f"{len(run['kept'])} file(s) not written by vlmq left as they were")
    parts += [run[key] for key in ("error", "export_error") if run.get(key)]
    return " | ".join(parts)


@schedule_group.command("run")
@click.argument("name", type=SCHEDULE_NAME)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def run_cmd(ctx: click.Context, name: str, as_json: bool) -> None:
    """Run a schedule now (its due times are unchanged): enqueue what is new."""
    client, store = _store(ctx)
    with client:
        try:
            run = store.run(name)
        except ScheduleError as exc:
            fail(f"error: {exc}", EXIT_FAILED)
    summary = {"job_id": run.get("job_id"), "items": run.get("items", 0),
               "skipped": run.get("skipped", 0), "missing": run.get("missing", []),
               "bad": run.get("bad", []), "not_media": run.get("not_media", {})}
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(_run_line(run))
    if run.get("status") == "error":
        fail(f"error: {run.get('error')}", EXIT_FAILED)


def _simple(command: str, doc: str, action: str) -> None:
    @schedule_group.command(command, help=doc)
    @click.argument("name", type=SCHEDULE_NAME)
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @click.pass_context
    def cmd(ctx: click.Context, name: str, as_json: bool) -> None:
        client, store = _store(ctx)
        with client:
            try:
                if action == "remove":
                    store.remove(name)
                else:
                    store.set_paused(name, action == "pause")
            except ScheduleError as exc:
                fail(f"error: {exc}", EXIT_FAILED)
        click.echo(json.dumps({"name": name, "done": f"{command}d"}) if as_json
                   else f"schedule {name}: {command}d")


_simple("remove", "Delete a schedule with its history (jobs it enqueued stay).", "remove")
_simple("pause", "Stop firing a schedule until `resume`.", "pause")
_simple("resume", "Fire a paused schedule again (a missed due time runs once).", "resume")


@click.command("scheduler")
@click.option("--tick", type=click.FloatRange(0.05), default=TICK_S, show_default=True,
              metavar="S", help="Seconds between looks at the schedules.")
@store_option
@log_options
@click.pass_context
def scheduler_cmd(ctx: click.Context, tick: float, stores: Stores,
                  log_setup: LogSettings) -> None:
    """Fire schedules when due (any number may run: each due time fires once), finish
    their runs (done marks, exports, sidecars). SIGTERM/SIGINT: stop."""
    log_setup.configure()
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # A long-running command: its warnings are log records, in its log format.
    run_scheduler(ctx.obj["redis_url"], stop, tick_s=tick, stores=stores,
                  on_warning=logging.getLogger("vlmq.scheduler").warning)


def register(group: click.Group) -> None:
    group.add_command(schedule_group)
    group.add_command(scheduler_cmd)
