"""The producer's commands: enqueue, jobs, status, cancel, retry, delete, reindex (wait and
result: cli/results.py).

They register on the root group (vlmq.cli.main), which also carries the worker's
commands; this module imports nothing from the worker. Exit codes: vlmq.cli.common.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from vlmq.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_TIMEOUT,
    JOB_ID,
    QUEUE,
    fail,
    package_version,
    parse_labels,
    store_option,
)
from vlmq.cli.options import job_options
from vlmq.producer.defaults import DEFAULT_MAX_PENDING_MB, JOB_ITEMS
from vlmq.producer.options import JobOptions
from vlmq.shared import constants as C
from vlmq.shared import settings as S
from vlmq.shared.errors import InputError, PayloadError

# The client and what it uses (redis, RQ, Pillow, PDFium) are imported by the command
# bodies that need them: `vlmq jobs --help` imports none of it.
if TYPE_CHECKING:
    from vlmq.producer.client import Client, Job, QueueInfo, WorkerInfo
    from vlmq.producer.job_sets import Batch
    from vlmq.producer.manifest import Group
    from vlmq.stores.backends import Stores

F = TypeVar("F", bound=Callable[..., Any])
JSON_HELP = "Print JSON instead of text."


def _handle_errors(func: F) -> F:
    """Map an enqueue's input errors to a stderr message and exit 2.

    Commands that read jobs do not use this: an unreadable job is still a job, and they
    show what is known about it (status, failure message) instead of one error line.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from vlmq.producer.upload import BudgetWaitTimeout
        from vlmq.shared import redis_checks

        try:
            return func(*args, **kwargs)
        except (InputError, PayloadError) as exc:
            fail(f"error: {exc}\nnothing was enqueued", EXIT_BAD_INPUT)
        except redis_checks.EvictionRefused as exc:
            fail(f"error: {exc}\nnothing was enqueued", EXIT_FAILED)
        except BudgetWaitTimeout as exc:  # the jobs enqueued before it stay (its message)
            fail(f"error: {exc}", EXIT_TIMEOUT)

    return wrapper  # type: ignore[return-value]


def _client(ctx: click.Context, stores: Stores | None = None,
            max_pending_mb: float = DEFAULT_MAX_PENDING_MB,
            allow_eviction: bool = False, wait_timeout: float | None = None) -> Client:
    from vlmq.cli.progress import StatusLines, warn
    from vlmq.producer.client import Client

    return Client(ctx.find_root().obj["redis_url"], stores=stores,
                  max_pending_mb=max_pending_mb, progress=StatusLines(),
                  allow_eviction=allow_eviction or None, wait_timeout=wait_timeout,
                  on_warning=warn)


def _allow_eviction(func: F) -> F:
    return click.option("--allow-eviction", is_flag=True,
                        help="Go on although Redis's maxmemory-policy may evict vlmq's keys "
                             f"(a warning still says so); also ${C.ALLOW_EVICTION_ENV}"
                             "=1.")(func)


def _label_filter(func: F) -> F:
    return click.option("--label", "labels", multiple=True, callback=parse_labels,
                        metavar="K=V", help="Only jobs carrying this label (repeatable; "
                                            "all must match).")(func)


def _json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help=JSON_HELP)(func)


def _is_batch(client: Client, job_id: str) -> bool:
    from vlmq.producer.job_sets import is_batch

    return is_batch(client, job_id)


def _job_json(job: Job) -> dict[str, Any]:
    return {"id": job.id, "queue": job.queue, "task": job.task, "items": job.items,
            "blobs": job.blobs, "uploaded": job.uploaded,
            "rejected": [{"path": p, "reason": r} for p, r in job.rejected],
            "not_media": _not_media_json(job)}


def _not_media_json(what: Job | Batch) -> list[dict[str, str]]:
    return [{"path": p, "kind": k, "reason": r} for p, k, r in what.not_media]


def _warn_unserved(client: Client, queues: Sequence[str]) -> None:
    """Warn of a queue no worker serves, after a short grace: a worker started in the
    background a moment before (as the README does) names itself within it."""
    unserved = [q for q in dict.fromkeys(queues) if client.serving(q) == 0]
    deadline = time.monotonic() + C.UNSERVED_GRACE_S
    while unserved and time.monotonic() < deadline:
        time.sleep(0.1)
        unserved = [q for q in unserved if client.serving(q) == 0]
    for queue in unserved:
        click.echo(f"vlmq: warning: no live worker serves queue {queue!r}; the job "
                   f"waits until one starts (vlmq worker --model M --queues {queue})",
                   err=True)


def _set_json(what: Job | Batch) -> dict[str, Any]:
    """A job's keys as before, plus "batch" (null for one job) and "jobs"; a batch gives
    its id as "id" too, so a script passing "id" on to wait/result works either way."""
    from vlmq.producer.client import Job

    if isinstance(what, Job):
        return {**_job_json(what), "batch": None, "jobs": [_job_json(what)]}
    jobs = what.jobs()
    return {"id": what.id, "batch": what.id, "queue": ",".join(dict.fromkeys(
                j.queue for j in jobs)), "task": what.task, "items": what.items,
            "blobs": what.blobs, "uploaded": sum(j.uploaded for j in jobs),
            "rejected": [{"path": p, "reason": r} for p, r in what.rejected],
            "not_media": _not_media_json(what), "jobs": [_job_json(j) for j in jobs]}


def _report(client: Client, what: Job | Batch, as_json: bool) -> None:
    """Print the job id, or the batch id when the set became several jobs."""
    from vlmq.producer.client import Job
    from vlmq.producer.inputs import not_media_summary

    if as_json:
        click.echo(json.dumps(_set_json(what)))
    else:
        if what.not_media:
            click.echo(f"vlmq: {not_media_summary(what.not_media)}", err=True)
        for path, reason in what.rejected:
            click.echo(f"vlmq: skipped {path}: {reason}", err=True)
        click.echo(what.id)
    jobs = [what] if isinstance(what, Job) else what.jobs()
    _warn_unserved(client, [j.queue for j in jobs])


def _job_size(func: F, *, head: str = "") -> F:
    return click.option("--job-size", type=click.IntRange(1, C.MAX_ITEMS_PER_JOB),
                        default=JOB_ITEMS, show_default=True, metavar="N",
                        help=head + "Items per job: a larger set becomes a batch of jobs "
                             "of at most N items, which many workers share (its id is "
                             "printed; every job command takes it).")(func)


# The enqueue group's own options are those of --manifest and --openai-batch; a task
# subcommand has its own of the same names, given after it.
_FILE_ONLY = "With --manifest or --openai-batch: "


def _max_pending(func: F, *, head: str = "") -> F:
    func = click.option(
        "--wait-timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
        help=head + "Give up (exit 124) when a wait for room in the budget lasts SECONDS; "
             "the jobs enqueued so far stay queued. Default: wait while a live worker serves "
             "the pending jobs' queue, give up after 600 s with none.")(func)
    return click.option("--max-pending-mb", type=click.FloatRange(min=0, min_open=True),
                        metavar="MB", default=DEFAULT_MAX_PENDING_MB, show_default=True,
                        help=head + "Redis budget: this producer's uploaded inputs whose "
                             "jobs have not ended stay under MB; past it, enqueue waits for "
                             "workers to drain them.")(func)


# --- enqueue ------------------------------------------------------------------------------


@click.group(invoke_without_command=True)
@click.option("--manifest", type=click.Path(dir_okay=False), metavar="FILE.jsonl",
              help='Enqueue a batch manifest: one JSON request per line, {"custom_id", '
                   '"task", "file", "pages"?} plus any of ' + ", ".join(
                       f'"{s.name}"?' for s in S.rows("manifest"))
                   + "; files are relative to the manifest's folder. Lines with the same "
                     "task and settings share a job.")
@click.option("--openai-batch", metavar="FILE.jsonl", type=click.Path(dir_okay=False),
              help='Enqueue an OpenAI Batch input file: one chat request per line, '
                   '{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}, '
                   "each with one image (a data: URI or a file:// path; http(s) is refused) "
                   "and a prompt; a json_schema response_format is task extract. Read the "
                   "answers with vlmq result --format openai-batch.")
@click.option("--queue", metavar="NAME", type=QUEUE,
              help="With --manifest or --openai-batch: one queue for every job (default: "
                   "each task's own).")
@click.option("--skip-bad", is_flag=True,
              help="With --manifest or --openai-batch: enqueue the good lines and list the "
                   "bad ones.")
@click.option("--label", "labels", multiple=True, callback=parse_labels, metavar="K=V",
              help="With --manifest or --openai-batch: label every job (repeatable).")
@click.option("--model-map", "model_map", multiple=True, metavar="NAME=CHECKPOINT",
              help="With --openai-batch: lines asking for model NAME run on workers "
                   "serving CHECKPOINT (repeatable). Other names are recorded, not "
                   "enforced, unless --strict-model.")
@click.option("--strict-model", is_flag=True,
              help="With --openai-batch: a line's model must be the one its worker serves "
                   "(default: any worker of the queue answers it).")
@click.option("--json", "as_json", is_flag=True, help=_FILE_ONLY + JSON_HELP)
@functools.partial(_job_size, head=_FILE_ONLY)
@functools.partial(_max_pending, head=_FILE_ONLY)
@_allow_eviction
@store_option
@click.pass_context
@_handle_errors
def enqueue(ctx: click.Context, manifest: str | None, openai_batch: str | None,
            queue: str | None, skip_bad: bool, labels: dict[str, str],
            model_map: tuple[str, ...], strict_model: bool, as_json: bool,
            job_size: int, max_pending_mb: float, wait_timeout: float | None,
            allow_eviction: bool, stores: Stores) -> None:
    """Validate inputs, upload them once, and enqueue: a task subcommand, --manifest or
    --openai-batch."""
    if ctx.invoked_subcommand is not None:
        ctx.meta["vlmq.allow_eviction"] = allow_eviction  # before the task or after it
        _refuse_file_options(ctx)
        return
    if (model_map or strict_model) and openai_batch is None:
        raise click.UsageError("--model-map and --strict-model go with --openai-batch")
    if manifest is not None and openai_batch is not None:
        raise click.UsageError("give --manifest or --openai-batch, not both")
    if manifest is None and openai_batch is None:
        click.echo(ctx.get_help())
        ctx.exit(EXIT_BAD_INPUT)
    base = JobOptions.build(queue=queue, labels=labels or None)
    if openai_batch is not None:
        from vlmq.producer.openai_files import ModelPolicy, read_batch_file, submit_batch_file

        models = ModelPolicy.parse(model_map, strict=strict_model)
        with _client(ctx, stores, max_pending_mb, allow_eviction, wait_timeout) as client, \
                tempfile.TemporaryDirectory(prefix="vlmq-batch-") as spool:
            read = read_batch_file(openai_batch, base, spool=Path(spool), skip_bad=skip_bad,
                                   job_size=job_size, models=models)
            made = submit_batch_file(client, read, labels=labels, stores=stores)
            _made(client, made, read.rejected, as_json)
        return
    groups, rejected = _read_manifest(manifest, base, skip_bad=skip_bad, job_size=job_size)
    _submit_groups(ctx, groups, rejected, labels, as_json, stores, max_pending_mb,
                   allow_eviction, wait_timeout)


def _refuse_file_options(ctx: click.Context) -> None:
    """The options of --manifest/--openai-batch typed before a task subcommand: refused,
    since the task would not see them (its own go after it). Values from the environment
    or a config file's [enqueue] table are not typed there: they stand for the file
    forms only."""
    typed = [name for name, source in ((p.name, ctx.get_parameter_source(p.name))
                                       for p in ctx.command.params if p.name)
             if source == click.core.ParameterSource.COMMANDLINE and name != "allow_eviction"]
    if typed:
        raise click.UsageError("--manifest/--openai-batch/--queue/--skip-bad/--label/"
                               "--json/--job-size/--max-pending-mb/--wait-timeout/--store "
                               "before the task go with --manifest or --openai-batch only; "
                               "put them after the task")


def _read_manifest(manifest: str | None, base: JobOptions, *, skip_bad: bool, job_size: int
                   ) -> tuple[list[Group], list[tuple[int, str]]]:
    """The jobs of a manifest, and its rejected lines (an OpenAI batch file goes through
    openai_files' own reader, whose batch keeps the file's order and skipped lines)."""
    from vlmq.producer.manifest import read_manifest

    assert manifest is not None
    return read_manifest(manifest, base, skip_bad=skip_bad, job_size=job_size)


def _made(client: Client, made: Job | Batch, rejected: Sequence[tuple[int, str]],
          as_json: bool) -> None:
    """Print what a manifest or an OpenAI batch file made, and the lines it skipped."""
    from vlmq.producer.client import Job

    jobs = [made] if isinstance(made, Job) else made.jobs()
    if as_json:
        click.echo(json.dumps({"batch": None if isinstance(made, Job) else made.id,
                               "jobs": [_job_json(j) for j in jobs],
                               "rejected": [{"line": n, "reason": r} for n, r in rejected]}))
    else:
        for number, reason in rejected:
            click.echo(f"vlmq: skipped line {number}: {reason}", err=True)
        click.echo(made.id)
    _warn_unserved(client, [j.queue for j in jobs])


def _submit_groups(ctx: click.Context, groups: Sequence[Group],
                   rejected: Sequence[tuple[int, str]], labels: dict[str, str],
                   as_json: bool, stores: Stores, max_pending_mb: float,
                   allow_eviction: bool, wait_timeout: float | None) -> None:
    """Enqueue a manifest's (or an OpenAI batch's) jobs and print what was made."""
    from vlmq.producer.job_sets import Part, submit_parts

    for group in groups:  # files in a store go by reference
        group.prepared = group.prepared.by_reference(stores)
    with _client(ctx, stores, max_pending_mb, allow_eviction, wait_timeout) as client:
        made = submit_parts(client, [Part(g.task, g.prepared, g.options) for g in groups],
                            labels=labels)
        _made(client, made, rejected, as_json)


def _set_command(task: str) -> Callable[..., None]:
    prompt_help = {"generate": "Prompt text.",
                   "extract": "Prompt text (default: one built from the schema, naming its "
                              "fields)."}.get(task, "Prompt text (default: the model's own "
                                                    "for the task).")
    extract = task == "extract"

    @click.argument("paths", nargs=-1, required=True)
    @click.option("--pages", metavar="RANGE",
                  help="Pages of each PDF and TIFF, e.g. 1-3,7 (default all).")
    @click.option("--recursive", "-r", is_flag=True, help="Descend into folders.")
    @click.option("--skip-bad", is_flag=True,
                  help="Enqueue the good files and report the bad ones (default: reject all).")
    @_json_option
    @_job_size
    @_max_pending
    @_allow_eviction
    # batch: vlmq sets it when a set becomes a batch; schema: extract's alone.
    @job_options(exclude=("batch",) if extract else ("batch", "schema"),
                 prompt={"help": prompt_help, "required": task == "generate"},
                 queue={"default": C.DEFAULT_QUEUE[task], "show_default": True},
                 schema={"required": extract})
    @store_option
    @click.pass_context
    @_handle_errors
    def command(ctx: click.Context, paths: tuple[str, ...], pages: str | None,
                recursive: bool, skip_bad: bool, options: JobOptions, as_json: bool,
                job_size: int, max_pending_mb: float, wait_timeout: float | None,
                allow_eviction: bool, stores: Stores) -> None:
        from vlmq.cli.progress import display
        from vlmq.producer.page_specs import PagesWithoutPdf

        allow = allow_eviction or bool(ctx.meta.get("vlmq.allow_eviction"))
        with _client(ctx, stores, max_pending_mb, allow, wait_timeout) as client:
            try:
                job = client.submit_set(task, paths, options, pages=pages,
                                        recursive=recursive, skip_bad=skip_bad,
                                        job_size=job_size,
                                        progress=None if as_json else display)
            except PagesWithoutPdf as exc:
                raise PagesWithoutPdf("--pages") from exc  # name the option the user typed
            _report(client, job, as_json)

    return command


enqueue.command("ocr", help="OCR PDFs and TIFFs (one item per page) and page images, given "
                            "as files, folders or globs.")(_set_command("ocr"))
enqueue.command("caption", help="Caption images given as files, folders or globs. A PDF is "
                                "captioned page by page (each page one item).")(
    _set_command("caption"))
enqueue.command("generate", help="Run one prompt (--prompt, required) over images and PDF "
                                 "pages.")(_set_command("generate"))
enqueue.command("extract", help="Extract structured data from images and PDF/TIFF pages: "
                                "each item's answer is a JSON object that follows --schema "
                                "(a JSON Schema file), enforced while it is decoded.")(
    _set_command("extract"))


# --- jobs / status ---------------------------------------------------------------------------


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


@click.command("jobs")
@click.option("--queue", metavar="NAME", type=QUEUE, help="Only jobs on this queue.")
@click.option("--status", "state", type=click.Choice(C.JOB_STATES),
              help="Only jobs in this state.")
@_label_filter
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="Show at most N jobs.")
@_json_option
@click.pass_context
def jobs_cmd(ctx: click.Context, queue: str | None, state: str | None,
             labels: dict[str, str], limit: int, as_json: bool) -> None:
    """List jobs, newest first: id, queue, task, status, items done/failed/total, age, labels.

    With no match it says which filter matched nothing (to stderr under --json, where
    stdout is the empty list).
    """
    filters = {"--queue": queue, "--status": state,
               **{f"--label {k}={v}": {k: v} for k, v in labels.items()}}
    with _client(ctx) as client:
        rows = client.jobs(queue=queue, status=state, labels=labels, limit=limit)
        empty = _no_match(client, filters) if not rows else ""
    if as_json:
        click.echo(json.dumps([r.to_dict() | {"age_s": r.age_s()} for r in rows]))
        if empty:
            click.echo(f"vlmq: {empty}", err=True)
        return
    if not rows:
        click.echo(empty)
        return
    table = [("ID", "QUEUE", "TASK", "STATUS", "DONE/FAILED/TOTAL", "AGE", "LABELS")]
    table += [(r.id, r.queue, r.task, r.status, f"{r.done}/{r.failed}/{r.total}",
               _age(r.age_s()), " ".join(f"{k}={v}" for k, v in r.labels.items()))
              for r in rows]
    _print_table(table)


def _no_match(client: Client, filters: dict[str, Any]) -> str:
    """Why a listing is empty: no jobs at all, the filter that alone matches nothing, or
    that each matches some jobs but not together (one small read per filter given)."""
    given = {flag: value for flag, value in filters.items() if value is not None}
    if not client.jobs(limit=1):
        return f"no jobs: none in this Redis db under key prefix {client.keys.prefix!r}"
    if not given:
        return "no jobs"
    for flag, value in given.items():
        alone = {"queue": value} if flag == "--queue" else (
            {"status": value} if flag == "--status" else {"labels": value})
        if not client.jobs(limit=1, **alone):
            shown = flag if flag.startswith("--label") else f"{flag} {value}"
            return f"no jobs: none matches {shown}"
    return ("no jobs: each of " + ", ".join(
        f if f.startswith("--label") else f"{f} {v}" for f, v in given.items())
        + " matches some jobs, but none matches all")


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


@click.command("status")
@click.argument("job_id", required=False, type=JOB_ID)
@_label_filter
@_json_option
@_allow_eviction
@click.pass_context
def status_cmd(ctx: click.Context, job_id: str | None, labels: dict[str, str],
               as_json: bool, allow_eviction: bool) -> None:
    """A job's or a batch's state and progress; with --label, totals over every job
    carrying it;
    with neither, queue depths, workers (full worker stats with --json) and Redis's health.

    Exit 1 when the job is not a readable vlmq job (its status and error still shown), and
    when Redis may evict keys (maxmemory-policy not noeviction) without --allow-eviction.
    """
    if job_id is not None and labels:
        raise click.UsageError("give a JOB_ID or --label, not both")
    with _client(ctx) as client:
        if job_id is not None and _is_batch(client, job_id):
            _batch_status(client.batch(job_id), as_json)
        elif job_id is not None:
            job = client.job(job_id)
            _job_status(job, as_json)
            if job.problem is not None:
                sys.exit(EXIT_FAILED)
        elif labels:
            _group_status(client.group_status(labels), as_json)
        else:
            _overview(client, as_json, allow_eviction)


def _batch_status(batch: Batch, as_json: bool) -> None:
    status = batch.status()
    if as_json:
        click.echo(json.dumps(status))
        return
    items = status["items"]
    click.echo(f"batch {batch.id}  task {batch.task}")
    click.echo(f"status: {status['status']}")
    if batch.labels:
        click.echo("labels: " + "  ".join(f"{k}={v}" for k, v in batch.labels.items()))
    click.echo(f"jobs: {status['jobs']}: " + (", ".join(
        f"{n} {s}" for s, n in status["by_status"].items()) or "none"))
    click.echo(f"items: {items['done']}/{items['total']} done, {items['failed']} failed")
    if status["missing"]:
        click.echo(f"{status['missing']} job(s) never enqueued (the producer stopped): "
                   f"vlmq cancel {batch.id} ends the batch without them")


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
    from vlmq.producer.upload import retention

    kept = retention(job.client.redis, job.client.keys, job.id,
                     None if job.problem is not None else job.payload())
    if as_json:
        click.echo(json.dumps({"id": job.id, "queue": job.queue, "task": job.task,
                               "status": state, "done": done, "total": total,
                               "failed": failed, "labels": job.labels, "summary": summary,
                               "error": error, "problem": job.problem, "kept": kept}))
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
    click.echo(f"kept: results {kept['results']}; inputs {kept['inputs']}")


def _days(seconds: int) -> str:
    return f"{seconds // 86400} days"


def _stat(stats: dict[str, str], key: str, fmt: str = "{}", scale: float = 1.0) -> str:
    raw = stats.get(key)
    if raw is None:
        return "-"
    try:
        return fmt.format(float(raw) * scale)
    except ValueError:
        return raw


def _redis_health(client: Client, allow_eviction: bool) -> tuple[dict[str, str], str | None,
                                                                   str | None]:
    """Redis's health for status, its warning, and its refusal (an evicting Redis)."""
    from vlmq.shared import redis_checks

    health = redis_checks.health(client.redis).to_dict()
    try:
        warning = redis_checks.check_eviction(client.redis, allow_eviction or None)
    except redis_checks.EvictionRefused as exc:
        return health, None, str(exc)
    persistence = redis_checks.persistence_warning(client.redis)
    return health, " ".join(w for w in (warning, persistence) if w) or None, None


def _overview(client: Client, as_json: bool, allow_eviction: bool = False) -> None:
    from vlmq.producer.fleet import OTHER_QUEUES
    from vlmq.shared import fair

    queues = client.queues()
    workers = client.workers()
    waiting = fair.waiting(client.redis, client.keys,
                           [q for q in queues if q != OTHER_QUEUES])
    health, warning, refused = _redis_health(client, allow_eviction)
    if as_json:
        click.echo(json.dumps({
            "version": package_version(),
            "queues": {q.name: {**vars(q), **({"shares": waiting[q.name].to_dict()}
                                              if q.name in waiting else {})}
                       for q in queues.values()},
            "workers": [{"name": w.name, "state": w.state, "queues": list(w.queues),
                         "stats": w.stats, "shares": [
                             {"batch": s.batch or None, "jobs": s.jobs, "items": s.items}
                             for s in fair.parse_shares(w.stats.get("shares"))]}
                        for w in workers],
            "redis": {**health, "warning": warning, "error": refused},
        }))
    else:
        _overview_text(queues, workers)
        _shares_text(waiting, workers)
        click.echo(f"redis: maxmemory-policy {health['maxmemory_policy']}, persistence "
                   f"{health['persistence']}, run_id {health['run_id'][:8]}")
    if warning:
        click.echo(f"vlmq: warning: {warning}", err=True)
    if refused:
        fail(f"error: {refused}", EXIT_FAILED)


def _overview_text(queues: dict[str, QueueInfo], workers: Sequence[WorkerInfo]) -> None:
    from vlmq.producer.fleet import OTHER_QUEUES

    if queues:
        # At most C.MAX_SHOWN_QUEUES rows, the last one summing the queues not shown.
        _print_table([("QUEUE", "QUEUED", "ITEMS", "STARTED", "FAILED", "FINISHED")] + [
            (f"{q.name}: {q.queues} queues" if q.name == OTHER_QUEUES else q.name,
             str(q.queued), str(q.queued_items), str(q.started), str(q.failed),
             str(q.finished))
            for q in queues.values()])
    else:
        click.echo("queues: none")
    click.echo(f"kept: results {_days(C.RESULT_TTL_S)} after a job ends (--result-ttl), "
               f"{_days(C.FAILURE_TTL_S)} after it fails; inputs while their jobs run, then "
               f"{S.KEEP_INPUTS_S} s (--keep-inputs), or with a failed job's record")
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


def _shares_text(waiting: dict[str, Any], workers: Sequence[WorkerInfo]) -> None:
    """The share between batches: each queue's waiting batches (the next few in turn) and
    each worker's jobs in hand by batch."""
    from vlmq.shared import fair

    for queue, w in waiting.items():
        if w.batches:
            click.echo(f"{queue}: {w.batches} batch(es) waiting, next in turn: " + ", ".join(
                f"{fair.shown(b)} ({n} jobs)" for b, n in w.next))
    for worker in workers:
        shares = fair.parse_shares(worker.stats.get("shares"))
        if shares:
            click.echo(f"{worker.name} shares: " + ", ".join(
                f"{fair.shown(s.batch)} {s.jobs} jobs/{s.items} items" for s in shares))


# --- cancel / retry / delete -------------------------------------------------------------------


@click.command("cancel")
@click.argument("job_ids", nargs=-1, required=True, type=JOB_ID)
@_json_option
@click.pass_context
def cancel_cmd(ctx: click.Context, job_ids: tuple[str, ...], as_json: bool) -> None:
    """Cancel jobs (a batch id: every job of it not yet ended): a queued job never runs; a
    running one is dropped by its worker within seconds. Items already done stay
    readable. Exit 1 if any could not be canceled."""
    from vlmq.producer.job_admin import CannotCancel

    out: dict[str, str] = {}
    with _client(ctx) as client:
        for job_id in job_ids:
            try:
                if _is_batch(client, job_id):
                    n = client.batch(job_id).cancel()
                    out[job_id] = f"canceled ({n} job(s) had not ended)"
                else:
                    client.cancel(job_id)
                    out[job_id] = "canceled"
            except (CannotCancel, PayloadError) as exc:
                out[job_id] = f"error: {exc}"
    if as_json:
        click.echo(json.dumps(out))
    else:
        for job_id, what in out.items():
            click.echo(f"{job_id}: {what}")
    if any(v.startswith("error: ") for v in out.values()):
        sys.exit(EXIT_FAILED)


@click.command("retry")
@click.argument("job_id", type=JOB_ID)
@click.option("--failed-only", is_flag=True,
              help="Only the items that failed or have no result (default: every item).")
@_json_option
@click.pass_context
def retry_cmd(ctx: click.Context, job_id: str, failed_only: bool, as_json: bool) -> None:
    """Enqueue a new job with JOB_ID's settings and inputs; prints the new id.

    The new job's labels carry retry_of=JOB_ID. Inputs come from Redis (the job's blobs),
    so they must not have expired. A batch id retries its jobs as a new batch.
    """
    with _client(ctx) as client:
        try:
            new: Job | Batch = (client.batch(job_id).retry(failed_only=failed_only)
                                if _is_batch(client, job_id)
                                else client.job(job_id).retry(failed_only=failed_only))
        except PayloadError as exc:
            fail(f"error: cannot retry {job_id}: {exc}", EXIT_BAD_INPUT)
        _report(client, new, as_json)


@click.command("delete")
@click.argument("job_ids", nargs=-1, required=True, type=JOB_ID)
@click.option("--purge-blobs", is_flag=True,
              help="Also remove the jobs' inputs that no remaining job refers to.")
@_json_option
@click.pass_context
def delete_cmd(ctx: click.Context, job_ids: tuple[str, ...], purge_blobs: bool,
               as_json: bool) -> None:
    """Remove jobs with their item results and events (a running job is dropped by its
    worker); a batch id removes its jobs and the batch. Every id is checked first: an
    unknown one deletes nothing."""
    with _client(ctx) as client:
        batches = [client.batch(i) for i in job_ids if _is_batch(client, i)]
        singles = [i for i in job_ids if i not in {b.id for b in batches}]
        for job_id in singles:
            client.job(job_id)  # raises JobNotFound before anything is deleted
        count = len(singles) + sum(len(b.jobs()) for b in batches)
        purged = sum(b.delete(purge_blobs=purge_blobs) for b in batches)
        purged += client.delete(singles, purge_blobs=purge_blobs)
    if as_json:
        click.echo(json.dumps({"deleted": list(job_ids), "blobs_purged": purged}))
    else:
        click.echo(f"deleted {count} job(s)"
                   + (f", purged {purged} blob(s)" if purge_blobs else ""))


@click.command("reindex")
@_json_option
@click.pass_context
def reindex_cmd(ctx: click.Context, as_json: bool) -> None:
    """Index the jobs that are not (enqueued before vlmq kept job indexes) and drop the
    entries of jobs that are gone. It reads every job hash: run it once after an upgrade,
    not routinely (workers sweep expired entries themselves)."""
    from vlmq.shared import job_index

    with _client(ctx) as client:
        seen = job_index.reindex(client.redis, client.keys)
        laps = int(client.redis.zcard(client.keys.jobs_index)) // job_index.SCAN_COUNT + 1
        gone = sum(job_index.sweep(client.redis, client.keys, limit=job_index.SCAN_COUNT)
                   for _ in range(laps))
    if as_json:
        click.echo(json.dumps({"jobs": seen, "pruned": gone}))
    else:
        click.echo(f"indexed {seen} job(s); dropped {gone} entry(ies) of jobs gone")


def register(group: click.Group) -> None:
    """Attach the producer's commands to the root group."""
    for command in (enqueue, jobs_cmd, status_cmd, cancel_cmd, retry_cmd, delete_cmd,
                    reindex_cmd):
        group.add_command(command)

