"""`vlmq export`: jobs' results as files mirroring the input tree, or as sidecars."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

import click

from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, JOB_ID, fail
from vlmq.producer.ops.export import FORMATS, ExportReport, export_results
from vlmq.producer.ops.output_formats import EXTRACT

if TYPE_CHECKING:
    from vlmq.producer.client import Job


def print_report(report: ExportReport, where: Path, as_json: bool,
                 why_empty: str | None = None) -> None:
    """What was written; when nothing was, why (`why_empty`, in the JSON report too)."""
    if as_json:
        click.echo(json.dumps(report.to_dict() | ({"empty": why_empty} if why_empty else {})))
        return
    click.echo(f"wrote {len(report.written)} file(s) under {where}"
               + (f": {why_empty}" if why_empty else ""))
    for source, error in report.failed:
        click.echo(f"vlmq: {source}: failed, not written: {error}", err=True)
    for _source, reason in report.refused:
        click.echo(f"vlmq: refused: {reason}", err=True)
    for path in report.kept:
        click.echo(f"vlmq: kept {path}: not written by vlmq, or changed since "
                   "(--overwrite replaces it)", err=True)


@click.command("export")
@click.argument("job_ids", nargs=-1, required=True, type=JOB_ID)
@click.option("--dir", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write OUT/<source>.md|.txt|.json, mirroring the input tree.")
@click.option("--sidecar", "sidecar_root", type=click.Path(file_okay=False, exists=True,
                                                           path_type=Path),
              metavar="ROOT",
              help="Write each result next to its input under ROOT (photo.jpg.txt); ROOT is "
                   "the folder the job was enqueued from.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="md", show_default=True,
              help="md: a PDF becomes <source>.md with page markers, an image <source>.txt; "
                   "txt: plain text for both; json: <source>.json with every item field. "
                   "An extract job's sources are always <source>.json, their objects.")
@click.option("--overwrite", is_flag=True,
              help="Replace files at the targets even when vlmq did not write them (or "
                   "they changed since); without it they are kept and listed.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
@click.pass_context
def export_cmd(ctx: click.Context, job_ids: tuple[str, ...], out_dir: Path | None,
               sidecar_root: Path | None, fmt: str, overwrite: bool, as_json: bool) -> None:
    """Write jobs' results to files: an item's source (its path relative to the folder it
    was enqueued from) is its place in the output tree.

    A source that would land outside the output folder (absolute, `..`, a symlink out) is
    refused. vlmq replaces only files it wrote itself (recorded with their sha256 in each
    folder's .vlmq-written.json) and that are unchanged since; any other file there is
    kept and listed, unless --overwrite. Exit 1 when an item failed, a source was refused
    or a file was kept; the rest is written. A batch id exports all its jobs.
    """
    if (out_dir is None) == (sidecar_root is None):
        fail("error: give exactly one of --dir OUT and --sidecar ROOT", EXIT_BAD_INPUT)
    root = out_dir if out_dir is not None else sidecar_root
    assert root is not None
    report, why = _export(ctx.obj["redis_url"], job_ids, root, fmt, overwrite)
    print_report(report, root, as_json, why)
    if report.failed or report.refused or report.kept:
        sys.exit(EXIT_FAILED)


def _export(redis_url: str, job_ids: Sequence[str], root: Path, fmt: str,
            overwrite: bool) -> tuple[ExportReport, str | None]:
    """Export the jobs under `root`: the report, and why nothing was written (or None)."""
    from vlmq.producer.client import Client
    from vlmq.producer.job_sets import expand

    report = ExportReport()
    with Client(redis_url) as client:
        # Every id checked before anything is written; a batch is exported as one set,
        # so a PDF whose pages went to several jobs becomes one file.
        sets = [expand(client, [j]) for j in job_ids]
        root.mkdir(parents=True, exist_ok=True)
        for jobs in sets:
            # An extract job's files are its objects (<source>.json); a batch is one task,
            # and ids of both kinds each export as their own.
            for extract in (False, True):
                part = [j for j in jobs if (j.task == EXTRACT) == extract]
                if part:
                    report.merge(export_results(chain.from_iterable(j.results() for j in part),
                                                root, fmt, overwrite, extract=extract))
        if report.written or report.kept or report.refused:
            return report, None
        return report, why_nothing([j for jobs in sets for j in jobs])


def why_nothing(jobs: Sequence[Job]) -> str:
    """Why an export wrote no file: the jobs' states and items, in a few words."""
    states: dict[str, int] = {}
    done = total = failed = 0
    for job in jobs:
        state = job.status()
        states[state] = states.get(state, 0) + 1
        finished, items = job.progress()
        done, total, failed = done + finished, total + items, failed + job.failed_items()
    where = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
    if done == 0:
        pending = any(s in ("queued", "started", "deferred", "scheduled") for s in states)
        return (f"no item has a result yet ({len(jobs)} job(s): {where}"
                + ("; run vlmq wait first, or start a worker" if pending else "") + ")")
    return f"every item with a result failed ({failed} of {total}; job(s): {where})"


def register(group: click.Group) -> None:
    group.add_command(export_cmd)
