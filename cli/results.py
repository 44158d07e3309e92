"""`vlmq wait` and `vlmq result`: block on jobs, then write their results in a format.

The formats are vlmq.producer.ops.output_formats, shared with the dashboard's downloads and
`vlmq export`; this module reads the jobs, says on stderr what is partial or failed,
and puts the text where it was asked for. Its own module (cli/main.py COMMANDS), so
`vlmq jobs` never imports the formats.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import click

from vlmq.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_FAILED_ITEMS,
    EXIT_OK,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    JOB_ID,
    fail,
)
from vlmq.cli.progress import display
from vlmq.producer.errors import JobNotFound
from vlmq.producer.ops import output_formats
from vlmq.producer.ops.output_formats import FORMATS, JobResults, last_line

# The client (redis, RQ) is imported by the command bodies: `--help` never needs it.
if TYPE_CHECKING:
    from vlmq.producer.client import Client, Job
    from vlmq.producer.job_sets import Batch


def _client(ctx: click.Context) -> Client:
    from vlmq.producer.client import Client

    return Client(ctx.find_root().obj["redis_url"])


# --- wait ------------------------------------------------------------------------------------


def _unserved_hint(client: Client, jobs: Sequence[Job], statuses: Mapping[str, str]) -> str:
    unserved = sorted({j.queue for j in jobs if statuses.get(j.id) == "queued"
                       and client.serving(j.queue) == 0})
    if not unserved:
        return ""
    return (f"\nno live worker serves queue(s) {', '.join(unserved)}: start one with "
            f"vlmq worker --model M --queues {' '.join(unserved)}")


def _wait_row(job: Job, state: str) -> dict[str, Any]:
    error = job.error() if state != "finished" else None
    failed = (job.summary() or {}).get("failed", 0) if state == "finished" else 0
    return {"id": job.id, "status": state, "failed_items": failed,
            "error": last_line(error) if error else None}


def _batch_row(batch: Batch, state: str) -> dict[str, Any]:
    """A batch's line: its end and its counts (PROTOCOL.md 8b), never its jobs one by one;
    `vlmq jobs --status failed` or `vlmq status BATCH` say more."""
    status = batch.status()
    return {"id": batch.id, "batch": True, "status": state, "jobs": status["jobs"],
            "by_status": status["by_status"], "failed_items": status["items"]["failed"],
            "error": None}


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _wait_batches(client: Client, ids: Sequence[str], deadline: float | None
                  ) -> list[dict[str, Any]]:
    """Wait for each batch by its counts and terminal event, in turn, within the one
    deadline."""
    rows = []
    for batch_id in ids:
        batch = client.batch(batch_id)
        rows.append(_batch_row(batch, batch.wait(timeout=_left(deadline), progress=display)))
    return rows


def _wait_all(client: Client, ids: Sequence[str], timeout: float | None, jobs: list[Job]
              ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Wait for the batches among `ids` (their rows), then for the jobs, put in `jobs`
    first so a timeout's hint can name their queues (with their statuses), all within
    `timeout`."""
    from vlmq.producer.client import wait_all
    from vlmq.producer.job_sets import expand, is_batch

    deadline = None if timeout is None else time.monotonic() + timeout
    batch_ids = [i for i in ids if is_batch(client, i)]
    jobs += expand(client, [i for i in ids if i not in batch_ids])
    batch_rows = _wait_batches(client, batch_ids, deadline)
    statuses = wait_all(jobs, timeout=_left(deadline) if batch_ids else timeout,
                        progress=display)
    return batch_rows, statuses


def _wait_line(row: Mapping[str, Any]) -> str:
    return (f"{row['id']}: {row['status']}"
            + (f": {row['error']}" if row["error"] else "")
            + (f" ({row['failed_items']} item(s) failed)" if row["failed_items"] else ""))


# The help's exit codes are cli/common.py's, whatever they become.
_WAIT_HELP = f"""Wait for jobs with progress (a bar on a terminal, else a line every 10 % or
10 s); a batch id waits for the batch's end and prints one line for it.

Exit codes: {EXIT_OK} every job finished; {EXIT_FAILED} a job failed, was canceled or is
not found; {EXIT_FAILED_ITEMS} (--strict only) every job finished but some items failed;
{EXIT_TIMEOUT} timed out; {EXIT_UNREACHABLE} Redis unreachable: at the start, or still at
--timeout (connection resets and failovers before it are ridden out; with no --timeout,
it waits through any outage).
"""


@click.command("wait", help=_WAIT_HELP)
@click.argument("job_ids", nargs=-1, required=True, type=JOB_ID)
@click.option("--timeout", type=click.FloatRange(min=0), metavar="S",
              help=f"Give up after S seconds (exit {EXIT_TIMEOUT}; {EXIT_UNREACHABLE} if Redis "
                   "is unreachable then).")
@click.option("--strict", is_flag=True,
              help=f"Also fail (exit {EXIT_FAILED_ITEMS}) when a job finished with failed "
                   "items.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
def wait_cmd(ctx: click.Context, job_ids: tuple[str, ...], timeout: float | None,
             strict: bool, as_json: bool) -> None:
    """_WAIT_HELP is its help: the exit codes come from cli/common.py."""
    from vlmq.producer.client import RedisUnreachable, WaitTimeout
    from vlmq.shared import redis_checks

    jobs: list[Job] = []
    with _client(ctx) as client:
        seen = redis_checks.run_id(client.redis)
        try:
            batch_rows, statuses = _wait_all(client, job_ids, timeout, jobs)
        except JobNotFound as exc:
            # A job gone with a Redis restart is not a wrong id: say which it is.
            why = redis_checks.lost_with_restart(client.redis, client.keys, exc.job_id, seen)
            fail(f"error: {why or exc}", EXIT_FAILED)
        except WaitTimeout as exc:
            fail(f"{exc}{_unserved_hint(client, jobs, exc.statuses)}", EXIT_TIMEOUT)
        except RedisUnreachable as exc:
            fail(f"error: {exc}", EXIT_UNREACHABLE)
        rows = batch_rows + [_wait_row(job, statuses[job.id]) for job in jobs]
    click.echo(json.dumps(rows) if as_json else "\n".join(map(_wait_line, rows)))
    if any(row["status"] != "finished" for row in rows):
        sys.exit(EXIT_FAILED)
    if strict and any(row["failed_items"] for row in rows):
        sys.exit(EXIT_FAILED_ITEMS)


# --- result ----------------------------------------------------------------------------------


def _write(path: str | None, text: str) -> None:
    if path is None:
        # A terminal runs control sequences a text carries: shown escaped there.
        click.echo(output_formats.for_terminal(text) if sys.stdout.isatty() else text, nl=False)
        return
    try:
        # newline="": the text's own line ends (csv's CRLF) are written as they are.
        with open(path, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
    except OSError as exc:
        fail(f"error: cannot write {path}: {exc.strerror or exc}", EXIT_BAD_INPUT)


def _read(job: Job) -> JobResults:
    """The job's results; an unreadable job ends the command, before anything is written."""
    if job.problem is not None:
        state = job.status()
        error = job.error()
        detail = f"\nerror: {error.strip()}" if error else ""
        fail(f"error: job {job.id} is not a readable vlmq job: {job.problem}\n"
             f"status: {state}{detail}", EXIT_FAILED)
    return JobResults.read(job)


def _notes(view: JobResults, fmt: output_formats.Format) -> list[str]:
    """What stderr says about a job: failed, or still running; and the items the format
    leaves out, so that nothing is dropped silently."""
    job, done = view.job, len(view.results)
    notes = []
    if view.error is not None:
        notes.append(f"vlmq: job {job.id} failed ({done}/{job.items} items have results): "
                     f"{last_line(view.error)}")
    elif done < job.items:
        notes.append(f"vlmq: job {job.id} is {view.state}: {done}/{job.items} items done; "
                     "results are partial")
    if fmt.omits_failed:
        notes += [f"vlmq: job {job.id} item {r.index} ({r.source}) failed: {r.error}"
                  for r in view.results if not r.ok]
    return notes


def _format_help() -> str:
    names = [f"{f.name}: {f.summary}" for f in FORMATS.values()]
    single = [f.name for f in FORMATS.values() if not f.several_jobs]
    return ("; ".join(names) + f". {' and '.join(single)} take one job. Failed items a "
            "format leaves out are named on stderr.")


@click.command("result")
@click.argument("job_ids", nargs=-1, required=True, type=JOB_ID)
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="jsonl",
              show_default=True, help=_format_help())
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write here instead of stdout.")
@click.option("--errors", "errors_path", type=click.Path(dir_okay=False, writable=True),
              help="jsonl and openai-batch: write failed items here, successes to "
                   "-o/stdout (the OpenAI Batch convention).")
@click.pass_context
def result_cmd(ctx: click.Context, job_ids: tuple[str, ...], fmt: str, output: str | None,
               errors_path: str | None) -> None:
    """Print jobs' results in item order (partial while they run); a batch id prints its
    jobs' in batch order.

    Exit 1 when a job failed; the results it has are still written, and the failure is
    said once on stderr (and in the json and md output).
    """
    form = FORMATS[fmt]
    if (not form.several_jobs and len(job_ids) > 1) or (form.split is None and errors_path):
        raise click.UsageError(f"several job ids need --format {_several_jobs_formats()}; "
                               f"--errors needs --format {_split_formats()}")
    from vlmq.producer.job_sets import expand

    with _client(ctx) as client:
        jobs = expand(client, job_ids)  # every id checked before any is read
        if not form.several_jobs and len(jobs) > 1:
            raise click.UsageError("a batch of several jobs needs --format "
                                   f"{_several_jobs_formats()}")
        views = [_read(job) for job in jobs]
        text = _render(form, views, errors_path)
    _write(output, text)
    for view in views:
        for note in _notes(view, form):
            click.echo(output_formats.for_terminal(note), err=True)  # names from any producer
    if any(v.error is not None for v in views):
        sys.exit(EXIT_FAILED)


def _several_jobs_formats() -> str:
    return " or ".join(f.name for f in FORMATS.values() if f.several_jobs)


def _split_formats() -> str:
    return " or ".join(f.name for f in FORMATS.values() if f.split is not None)


def _render(form: output_formats.Format, views: Sequence[JobResults],
            errors_path: str | None) -> str:
    """The text for -o/stdout. With --errors (a format that splits), the failed items go to
    that file now and the text holds the successes."""
    if errors_path is None or form.split is None:
        return form.render_jobs(views)
    ok, bad = form.split_jobs(views)
    _write(errors_path, bad)
    return ok


def register(group: click.Group) -> None:
    group.add_command(wait_cmd)
    group.add_command(result_cmd)
