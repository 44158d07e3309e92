"""The producer's commands: enqueue, jobs, status, wait, result, cancel, retry, delete.

They register on the root group (vlmq.shared.cli), which also carries the worker's
commands; this module imports nothing from the worker. Exit codes: vlmq.shared.clitools.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from vlmq.producer.client import Client, Job, WaitTimeout, wait_all
from vlmq.producer.inputs import PagesWithoutPdf
from vlmq.producer.manage import CannotCancel
from vlmq.producer.manifest import read_manifest
from vlmq.producer.options import MAX_TTL_S, JobOptions
from vlmq.shared import constants as C
from vlmq.shared.clitools import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_FAILED_ITEMS,
    EXIT_TIMEOUT,
    fail,
    parse_labels,
)
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.schema import ItemResult

F = TypeVar("F", bound=Callable[..., Any])
JSON_HELP = "Print JSON instead of text."


def _handle_errors(func: F) -> F:
    """Map an enqueue's input errors to a stderr message and exit 2.

    Commands that read jobs do not use this: an unreadable job is still a job, and they
    show what is known about it (status, failure message) instead of one error line.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (InputError, PayloadError) as exc:
            fail(f"error: {exc}\nnothing was enqueued", EXIT_BAD_INPUT)

    return wrapper  # type: ignore[return-value]


def _client(ctx: click.Context) -> Client:
    return Client(ctx.find_root().obj["redis_url"])


def _label_filter(func: F) -> F:
    return click.option("--label", "labels", multiple=True, callback=parse_labels,
                        metavar="K=V", help="Only jobs carrying this label (repeatable; "
                                            "all must match).")(func)


def _json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help=JSON_HELP)(func)


# Each job option once: (click flag, JobOptions field). The commands hand the collected
# values to JobOptions.build, the same object the Python client builds.
_OPTION_FIELDS = ("prompt", "model", "max_tokens", "max_side", "temperature", "stop",
                  "labels", "job_id", "result_ttl", "blob_ttl")


def _job_options(*, prompt_help: str, prompt_required: bool = False) -> Callable[[F], F]:
    """Add the job options to a command and pass them on as one `options` argument."""
    ttl = click.IntRange(1, MAX_TTL_S)
    options = [
        click.option("--prompt", required=prompt_required, help=prompt_help),
        click.option("--model", help="Model id the worker should use (default: its own)."),
        click.option("--max-tokens", type=click.IntRange(1, C.MAX_TOKENS_LIMIT),
                     help="Most tokens to generate per item."),
        click.option("--max-side", type=click.IntRange(*C.MAX_SIDE_RANGE), metavar="PX",
                     help="Resize so the longer side is at most PX pixels "
                          "(default: the model's own)."),
        click.option("--temperature", type=click.FloatRange(0.0, C.MAX_TEMPERATURE),
                     help="Sampling temperature, 0 = greedy (default: the model's own)."),
        click.option("--stop", multiple=True, help="Extra stop string (repeatable)."),
        click.option("--label", "labels", multiple=True, callback=parse_labels,
                     metavar="K=V", help="Label stored with the job (repeatable)."),
        click.option("--job-id", metavar="ID",
                     help="Use this job id ([A-Za-z0-9_-]); refused if a job with it exists, "
                          "so a re-run script cannot enqueue the same work twice."),
        click.option("--result-ttl", type=ttl, metavar="S",
                     help=f"Keep the results S seconds after the job ends "
                          f"(default {C.RESULT_TTL_S // 86400} days)."),
        click.option("--blob-ttl", type=ttl, metavar="S",
                     help=f"Keep the uploaded inputs S seconds "
                          f"(default {C.BLOB_TTL_S // 86400} days)."),
        click.option("--no-result-cache", "result_cache", flag_value="off", default=None,
                     help="Generate every item afresh, even if the workers' shared result "
                          "cache holds its text."),
        click.option("--result-cache-sampled", "result_cache", flag_value="sampled",
                     help="Also cache (and reuse) items generated with temperature > 0; by "
                          "default only deterministic (temperature 0) items are."),
        click.option("--json", "as_json", is_flag=True, help=JSON_HELP),
    ]

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in _OPTION_FIELDS}
            values["stop"] = values["stop"] or None
            values["labels"] = values["labels"] or None
            values["queue"] = kwargs.pop("queue")
            values["result_cache"] = kwargs.pop("result_cache")
            try:
                kwargs["options"] = JobOptions.build(**values)
            except PayloadError as exc:
                fail(f"error: {exc}\nnothing was enqueued", EXIT_BAD_INPUT)
            return func(*args, **kwargs)

        out: Any = wrapper
        for option in reversed(options):
            out = option(out)
        return out  # type: ignore[no-any-return]

    return decorate


def _queue_option(default: str | None) -> Callable[[F], F]:
    return click.option("--queue", default=default, show_default=default is not None,
                        metavar="NAME",
                        help="Queue to put the job on; workers take jobs from the queues "
                             "they are started with" + ("" if default else
                                                        " (default: the task's own)") + ".")


def _job_json(job: Job) -> dict[str, Any]:
    return {"id": job.id, "queue": job.queue, "task": job.task, "items": job.items,
            "blobs": job.blobs, "uploaded": job.uploaded,
            "rejected": [{"path": p, "reason": r} for p, r in job.rejected]}


def _warn_unserved(client: Client, queues: Sequence[str]) -> None:
    for queue in dict.fromkeys(queues):
        if client.serving(queue) == 0:
            click.echo(f"vlmq: warning: no live worker serves queue {queue!r}; the job "
                       f"waits until one starts (vlmq worker --model M --queues {queue})",
                       err=True)


def _report(client: Client, job: Job, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(_job_json(job)))
    else:
        for path, reason in job.rejected:
            click.echo(f"vlmq: skipped {path}: {reason}", err=True)
        click.echo(job.id)
    _warn_unserved(client, [job.queue])


# --- enqueue ------------------------------------------------------------------------------


@click.group(invoke_without_command=True)
@click.option("--manifest", type=click.Path(dir_okay=False), metavar="FILE.jsonl",
              help='Enqueue a batch manifest: one JSON request per line, {"custom_id", '
                   '"task", "file", "pages"?, "prompt"?, "max_tokens"?}; files are relative '
                   "to the manifest's folder. Lines with the same task and settings share "
                   "a job.")
@click.option("--queue", metavar="NAME",
              help="With --manifest: one queue for every job (default: each task's own).")
@click.option("--skip-bad", is_flag=True,
              help="With --manifest: enqueue the good lines and list the bad ones.")
@click.option("--label", "labels", multiple=True, callback=parse_labels, metavar="K=V",
              help="With --manifest: label every job (repeatable).")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.pass_context
@_handle_errors
def enqueue(ctx: click.Context, manifest: str | None, queue: str | None, skip_bad: bool,
            labels: dict[str, str], as_json: bool) -> None:
    """Validate inputs, upload them once, and enqueue: a task subcommand, or --manifest."""
    if ctx.invoked_subcommand is not None:
        if manifest or queue or skip_bad or labels or as_json:
            raise click.UsageError("--manifest/--queue/--skip-bad/--label/--json before the "
                                   "task go with --manifest only; put them after the task")
        return
    if manifest is None:
        click.echo(ctx.get_help())
        ctx.exit(EXIT_BAD_INPUT)
    base = JobOptions.build(queue=queue, labels=labels or None)
    groups, rejected = read_manifest(manifest, base, skip_bad=skip_bad)
    with _client(ctx) as client:
        jobs = [client.submit(g.task, g.prepared, g.options) for g in groups]
        if as_json:
            click.echo(json.dumps({"jobs": [_job_json(j) for j in jobs],
                                   "rejected": [{"line": n, "reason": r}
                                                for n, r in rejected]}))
        else:
            for number, reason in rejected:
                click.echo(f"vlmq: skipped line {number}: {reason}", err=True)
            for job in jobs:
                click.echo(job.id)
        _warn_unserved(client, [j.queue for j in jobs])


def _set_command(task: str) -> Callable[..., None]:
    prompt_help = ("Prompt text (required)." if task == "generate"
                   else "Prompt text (default: the model's own for the task).")

    @click.argument("paths", nargs=-1, required=True)
    @click.option("--pages", metavar="RANGE",
                  help="Pages of each PDF, e.g. 1-3,7 (default all).")
    @click.option("--recursive", "-r", is_flag=True, help="Descend into folders.")
    @click.option("--skip-bad", is_flag=True,
                  help="Enqueue the good files and report the bad ones (default: reject all).")
    @_queue_option(C.DEFAULT_QUEUE[task])
    @_job_options(prompt_help=prompt_help, prompt_required=task == "generate")
    @click.pass_context
    @_handle_errors
    def command(ctx: click.Context, paths: tuple[str, ...], pages: str | None,
                recursive: bool, skip_bad: bool, options: JobOptions, as_json: bool) -> None:
        with _client(ctx) as client:
            try:
                job = client.submit(task, paths, options, pages=pages, recursive=recursive,
                                    skip_bad=skip_bad)
            except PagesWithoutPdf as exc:
                raise PagesWithoutPdf("--pages") from exc  # name the option the user typed
            _report(client, job, as_json)

    return command


enqueue.command("ocr", help="OCR PDFs (one item per page) and page images, given as files, "
                            "folders or globs.")(_set_command("ocr"))
enqueue.command("caption", help="Caption images given as files, folders or globs. A PDF is "
                                "captioned page by page (each page one item).")(
    _set_command("caption"))
enqueue.command("generate", help="Run one prompt (--prompt, required) over images and PDF "
                                 "pages.")(_set_command("generate"))


# --- jobs / status ---------------------------------------------------------------------------


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@click.command("jobs")
@click.option("--queue", metavar="NAME", help="Only jobs on this queue.")
@click.option("--status", "state", metavar="STATE",
              help="Only jobs in this state (queued, started, finished, failed, canceled...).")
@_label_filter
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="Show at most N jobs.")
@_json_option
@click.pass_context
def jobs_cmd(ctx: click.Context, queue: str | None, state: str | None,
             labels: dict[str, str], limit: int, as_json: bool) -> None:
    """List jobs, newest first: id, queue, task, status, items done/failed/total, age, labels."""
    with _client(ctx) as client:
        rows = client.jobs(queue=queue, status=state, labels=labels, limit=limit)
    if as_json:
        click.echo(json.dumps([r.to_dict() | {"age_s": r.age_s()} for r in rows]))
        return
    if not rows:
        click.echo("no jobs")
        return
    table = [("ID", "QUEUE", "TASK", "STATUS", "DONE/FAILED/TOTAL", "AGE", "LABELS")]
    table += [(r.id, r.queue, r.task, r.status, f"{r.done}/{r.failed}/{r.total}",
               _age(r.age_s()), " ".join(f"{k}={v}" for k, v in r.labels.items()))
              for r in rows]
    _print_table(table)


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


@click.command("status")
@click.argument("job_id", required=False)
@_label_filter
@_json_option
@click.pass_context
def status_cmd(ctx: click.Context, job_id: str | None, labels: dict[str, str],
               as_json: bool) -> None:
    """A job's state and progress; with --label, totals over every job carrying it;
    with neither, queue depths and workers (full worker stats with --json).

    Exit 1 when the job is not a readable vlmq job (its status and error still shown).
    """
    if job_id is not None and labels:
        raise click.UsageError("give a JOB_ID or --label, not both")
    with _client(ctx) as client:
        if job_id is not None:
            job = client.job(job_id)
            _job_status(job, as_json)
            if job.problem is not None:
                sys.exit(EXIT_FAILED)
        elif labels:
            _group_status(client.group_status(labels), as_json)
        else:
            _overview(client, as_json)


def _group_status(group: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(group))
        return
    items = group["items"]
    click.echo("label " + " ".join(f"{k}={v}" for k, v in group["labels"].items())
               + f": {group['jobs']} job(s)")
    click.echo("jobs: " + (", ".join(f"{n} {s}" for s, n in group["by_status"].items())
                           or "none"))
    click.echo(f"items: {items['done']}/{items['total']} done, {items['failed']} failed")


def _job_status(job: Job, as_json: bool) -> None:
    state = job.status()
    done, total = job.progress()
    failed = job.failed_items()
    summary = job.summary() if state == "finished" else None
    error = job.error() if state == "failed" else None
    if as_json:
        click.echo(json.dumps({"id": job.id, "queue": job.queue, "task": job.task,
                               "status": state, "done": done, "total": total,
                               "failed": failed, "labels": job.labels, "summary": summary,
                               "error": error, "problem": job.problem}))
        return
    click.echo(f"job {job.id}  queue {job.queue or '?'}")
    click.echo(f"status: {state}")
    if job.labels:
        click.echo("labels: " + "  ".join(f"{k}={v}" for k, v in job.labels.items()))
    if job.problem is not None:
        click.echo(f"not a readable vlmq job: {job.problem}")
    else:
        click.echo(f"items: {done}/{total} done, {failed} failed")
    if summary is not None:
        click.echo(f"summary: {json.dumps(summary)}")
    if error:
        click.echo(f"error: {error.strip()}")


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else text


def _stat(stats: dict[str, str], key: str, fmt: str = "{}", scale: float = 1.0) -> str:
    raw = stats.get(key)
    if raw is None:
        return "-"
    try:
        return fmt.format(float(raw) * scale)
    except ValueError:
        return raw


def _overview(client: Client, as_json: bool) -> None:
    queues = client.queues()
    workers = client.workers()
    if as_json:
        click.echo(json.dumps({
            "queues": {q.name: vars(q) for q in queues.values()},
            "workers": [{"name": w.name, "state": w.state, "queues": list(w.queues),
                         "stats": w.stats} for w in workers],
        }))
        return
    if queues:
        _print_table([("QUEUE", "QUEUED", "STARTED", "FAILED", "FINISHED")] + [
            (q.name, str(q.queued), str(q.started), str(q.failed), str(q.finished))
            for q in queues.values()])
    else:
        click.echo("queues: none")
    click.echo("")
    if not workers:
        click.echo("workers: none")
        return
    _print_table([("WORKER", "STATE", "MODEL", "QUEUES", "BATCH", "TOK/S", "ITEMS/S",
                   "CACHE HIT", "UPTIME")] + [
        (w.name, w.state or "?", w.stats.get("model", "-").rsplit("/", 1)[-1],
         ",".join(w.queues) or "-", _stat(w.stats, "batch_occupancy", "{:.0f}%", 100),
         _stat(w.stats, "tokens_per_s", "{:.1f}"), _stat(w.stats, "items_per_s", "{:.2f}"),
         _stat(w.stats, "cache_hit_rate", "{:.0f}%", 100),
         _age(float(w.stats["uptime_s"])) if "uptime_s" in w.stats else "-")
        for w in workers])
    for w in workers:
        if w.stats.get("blas"):
            click.echo(f"{w.name} blas: {w.stats['blas']}")


# --- wait / result -----------------------------------------------------------------------------


@click.command("wait")
@click.argument("job_ids", nargs=-1, required=True)
@click.option("--timeout", type=click.FloatRange(min=0), metavar="S",
              help="Give up after S seconds (exit 124).")
@click.option("--strict", is_flag=True,
              help="Also fail (exit 3) when a job finished with failed items.")
@_json_option
@click.pass_context
def wait_cmd(ctx: click.Context, job_ids: tuple[str, ...], timeout: float | None,
             strict: bool, as_json: bool) -> None:
    """Wait for jobs with progress (a bar on a terminal, else a line every 10 % or 10 s).

    Exit codes: 0 every job finished; 1 a job failed, was canceled or is not found;
    3 (--strict only) every job finished but some items failed; 124 timed out.
    """
    with _client(ctx) as client:
        jobs = [client.job(j) for j in job_ids]
        try:
            statuses = wait_all(jobs, timeout=timeout, progress=True)
        except WaitTimeout as exc:
            unserved = sorted({j.queue for j in jobs if exc.statuses.get(j.id) == "queued"
                               and client.serving(j.queue) == 0})
            hint = (f"\nno live worker serves queue(s) {', '.join(unserved)}: start one with "
                    f"vlmq worker --model M --queues {' '.join(unserved)}" if unserved else "")
            fail(f"{exc}{hint}", EXIT_TIMEOUT)
        out = []
        for job in jobs:
            state = statuses[job.id]
            error = job.error() if state != "finished" else None
            failed = (job.summary() or {}).get("failed", 0) if state == "finished" else 0
            out.append({"id": job.id, "status": state, "failed_items": failed,
                        "error": _last_line(error) if error else None})
    if as_json:
        click.echo(json.dumps(out))
    else:
        for row in out:
            click.echo(f"{row['id']}: {row['status']}"
                       + (f": {row['error']}" if row["error"] else "")
                       + (f" ({row['failed_items']} item(s) failed)"
                          if row["failed_items"] else ""))
    if any(row["status"] != "finished" for row in out):
        sys.exit(EXIT_FAILED)
    if strict and any(row["failed_items"] for row in out):
        sys.exit(EXIT_FAILED_ITEMS)


def _write(path: str | None, text: str) -> None:
    if path is None:
        click.echo(text, nl=False)
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        fail(f"error: cannot write {path}: {exc.strerror or exc}", EXIT_BAD_INPUT)


def _result_lines(job: Job, results: Sequence[ItemResult], error: str | None, *,
                  missing: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(successes, failures), one dict per item; a failed job's unfinished items count as
    failures, so the errors file names every item that has no text."""
    ok: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    for r in results:
        (ok if r.ok else bad).append({"job_id": job.id, **r.to_dict()})
    if error is not None and missing:
        done = {r.index for r in results}
        for index, item in enumerate(job.payload().items):
            if index not in done:
                bad.append({"job_id": job.id, "index": index, "source": item.source,
                            "page": item.page, "custom_id": item.custom_id, "text": None,
                            "error": f"no result: the job failed: {_last_line(error)}"})
        bad.sort(key=lambda d: int(d["index"]))
    return ok, bad


@click.command("result")
@click.argument("job_ids", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["jsonl", "json", "md", "txt"]),
              default="jsonl", show_default=True,
              help="jsonl: one item result per line (with job_id and custom_id); json: one "
                   "object with the job's status and summary; md: a readable document, one "
                   "section per page or image; txt: the texts alone, in item order, a blank "
                   "line apart (failed items left out, said on stderr). json and md take "
                   "one job.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write here instead of stdout.")
@click.option("--errors", "errors_path", type=click.Path(dir_okay=False, writable=True),
              help="jsonl: write failed items here, successes to -o/stdout (the OpenAI "
                   "Batch convention).")
@click.pass_context
def result_cmd(ctx: click.Context, job_ids: tuple[str, ...], fmt: str, output: str | None,
               errors_path: str | None) -> None:
    """Print jobs' results in item order (partial while they run).

    Exit 1 when a job failed; the results it has are still written, and the failure is
    said once on stderr (and in the json and md output).
    """
    if (fmt in ("json", "md") and len(job_ids) > 1) or (fmt != "jsonl" and errors_path):
        raise click.UsageError("several job ids need --format jsonl or txt; --errors needs "
                               "--format jsonl")
    ok_lines: list[dict[str, Any]] = []
    bad_lines: list[dict[str, Any]] = []
    notes: list[str] = []
    failed = False
    text = ""
    with _client(ctx) as client:
        for job in [client.job(j) for j in job_ids]:
            state = job.status()
            if job.problem is not None:
                error = job.error()
                detail = f"\nerror: {error.strip()}" if error else ""
                fail(f"error: job {job.id} is not a readable vlmq job: {job.problem}\n"
                     f"status: {state}{detail}", EXIT_FAILED)
            results = list(job.results())
            error = job.error() if state == "failed" else None
            if error is not None:
                failed = True
                notes.append(f"vlmq: job {job.id} failed ({len(results)}/{job.items} items "
                             f"have results): {_last_line(error)}")
            elif len(results) < job.items:
                notes.append(f"vlmq: job {job.id} is {state}: {len(results)}/{job.items} "
                             "items done; results are partial")
            if fmt == "json":
                text = json.dumps({"id": job.id, "status": state, "labels": job.labels,
                                   "summary": job.summary() if state == "finished" else None,
                                   "error": error,
                                   "items": [r.to_dict() for r in results]}, indent=2) + "\n"
            elif fmt == "md":
                text = render_markdown(job, state, results, error)
            elif fmt == "txt":
                text += "".join((r.text or "").rstrip("\n") + "\n\n" for r in results if r.ok)
                notes += [f"vlmq: job {job.id} item {r.index} ({r.source}) failed: {r.error}"
                          for r in results if not r.ok]
            else:
                ok, bad = _result_lines(job, results, error, missing=errors_path is not None)
                ok_lines += ok
                bad_lines += bad
    if fmt == "jsonl":
        main_lines = ok_lines if errors_path else sorted(
            ok_lines + bad_lines, key=lambda d: (job_ids.index(d["job_id"]), d["index"]))
        text = "".join(json.dumps(d) + "\n" for d in main_lines)
        if errors_path:
            _write(errors_path, "".join(json.dumps(d) + "\n" for d in bad_lines))
    _write(output, text)
    for note in notes:
        click.echo(note, err=True)
    if failed:
        sys.exit(EXIT_FAILED)


# --- cancel / retry / delete -------------------------------------------------------------------


@click.command("cancel")
@click.argument("job_ids", nargs=-1, required=True)
@_json_option
@click.pass_context
def cancel_cmd(ctx: click.Context, job_ids: tuple[str, ...], as_json: bool) -> None:
    """Cancel jobs: a queued job never runs; a running one is dropped by its worker within
    seconds. Items already done stay readable. Exit 1 if any could not be canceled."""
    out: dict[str, str] = {}
    with _client(ctx) as client:
        for job_id in job_ids:
            try:
                client.cancel(job_id)
                out[job_id] = "canceled"
            except (CannotCancel, PayloadError) as exc:
                out[job_id] = f"error: {exc}"
    if as_json:
        click.echo(json.dumps(out))
    else:
        for job_id, what in out.items():
            click.echo(f"{job_id}: {what}")
    if any(v != "canceled" for v in out.values()):
        sys.exit(EXIT_FAILED)


@click.command("retry")
@click.argument("job_id")
@click.option("--failed-only", is_flag=True,
              help="Only the items that failed or have no result (default: every item).")
@_json_option
@click.pass_context
def retry_cmd(ctx: click.Context, job_id: str, failed_only: bool, as_json: bool) -> None:
    """Enqueue a new job with JOB_ID's settings and inputs; prints the new id.

    The new job's labels carry retry_of=JOB_ID. Inputs come from Redis (the job's blobs),
    so they must not have expired.
    """
    with _client(ctx) as client:
        try:
            new = client.job(job_id).retry(failed_only=failed_only)
        except PayloadError as exc:
            fail(f"error: cannot retry {job_id}: {exc}", EXIT_BAD_INPUT)
        _report(client, new, as_json)


@click.command("delete")
@click.argument("job_ids", nargs=-1, required=True)
@click.option("--purge-blobs", is_flag=True,
              help="Also remove the jobs' inputs that no remaining job refers to.")
@_json_option
@click.pass_context
def delete_cmd(ctx: click.Context, job_ids: tuple[str, ...], purge_blobs: bool,
               as_json: bool) -> None:
    """Remove jobs with their item results and events (a running job is dropped by its
    worker). Every id is checked first: an unknown one deletes nothing."""
    with _client(ctx) as client:
        purged = client.delete(job_ids, purge_blobs=purge_blobs)
    if as_json:
        click.echo(json.dumps({"deleted": list(job_ids), "blobs_purged": purged}))
    else:
        click.echo(f"deleted {len(job_ids)} job(s)"
                   + (f", purged {purged} blob(s)" if purge_blobs else ""))


def register(group: click.Group) -> None:
    """Attach the producer's commands to the root group."""
    for command in (enqueue, jobs_cmd, status_cmd, wait_cmd, result_cmd, cancel_cmd,
                    retry_cmd, delete_cmd):
        group.add_command(command)


def render_markdown(job: Job, state: str, results: Sequence[ItemResult],
                    error: str | None = None) -> str:
    """The document's pages in item order, one heading each; errors and gaps made visible.

    A failed job's document opens with why it failed (`error`), before any page.
    """
    by_index = {r.index: r for r in results}
    parts: list[str] = []
    if error is not None:
        parts.append(f"> **This job failed:** {_last_line(error)}\n")
        if len(error.strip().splitlines()) > 1:
            parts.append("```text\n" + error.strip() + "\n```\n")
    parts.append(f"<!-- vlmq job {job.id}: {state}, {len(results)}/{job.items} items -->\n")
    for index, item in enumerate(job.payload().items):
        heading = item.source if item.page is None else f"{item.source} — page {item.page}"
        if item.custom_id is not None:
            heading += f" ({item.custom_id})"
        parts.append(f"## {heading}\n")
        r = by_index.get(index)
        if r is None and error is not None:
            parts.append("> _no result: the job failed before this item (see the top)_\n")
        elif r is None:
            parts.append(f"> _not done yet (job {state})_\n")
        elif r.error is not None:
            parts.append(f"> **Error:** {r.error}\n")
        elif not r.text:
            parts.append("_(no text)_\n")
        else:
            parts.append(r.text.rstrip("\n") + "\n")
    return "\n".join(parts)


