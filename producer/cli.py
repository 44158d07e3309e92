"""The `vlmq` command line: enqueue, status, wait, result (worker commands plug in below).

Exit codes are part of the interface so scripts can branch on them:
0 ok; 1 a job failed / not found / Redis unreachable or refusing writes (maxmemory, a
read-only replica); 2 bad input or usage (nothing was written to Redis; for `result`, an
-o path that cannot be written); 124 `wait` timed out.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import ResponseError as RedisResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from vlmq.producer.client import (
    Client,
    Job,
    JobNotFound,
    WaitTimeout,
    check_redis_url,
    redact_url,
    wait_all,
)
from vlmq.producer.inputs import PagesWithoutPdf
from vlmq.shared import constants as C
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.schema import ItemResult

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_TIMEOUT = 124

F = TypeVar("F", bound=Callable[..., Any])


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"vlmq: {message}", err=True)
    sys.exit(code)


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
            _fail(f"error: {exc}\nnothing was enqueued", EXIT_BAD_INPUT)

    return wrapper  # type: ignore[return-value]


class _Main(click.Group):
    """The root group: Redis unreachable or refusing a command, or a job id not found,
    is one line.

    Catching here rather than per command also covers the worker's commands, which
    register themselves on this group.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            url = redact_url(str(ctx.params.get("redis_url") or ""))
            _fail(f"error: cannot reach Redis at {url}: {exc}", EXIT_FAILED)
        except RedisResponseError as exc:
            # The server said no (maxmemory with noeviction, a read-only replica, ...):
            # an operator's problem, and the server's own message is what they need.
            url = redact_url(str(ctx.params.get("redis_url") or ""))
            _fail(f"error: {_refusal(exc)}: {_one_line(str(exc))} (Redis at {url})",
                  EXIT_FAILED)
        except JobNotFound as exc:
            _fail(f"error: {exc}", EXIT_FAILED)


def _refusal(exc: RedisResponseError) -> str:
    if isinstance(exc, RedisOutOfMemoryError):
        return "Redis is out of memory (maxmemory)"
    if isinstance(exc, RedisReadOnlyError):
        return "Redis is read-only (a replica?)"
    return "Redis refused a command"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _client(ctx: click.Context) -> Client:
    return Client(ctx.find_root().obj["redis_url"])


def _check_url(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    # One line and exit 2 rather than click's usage block: the URL usually comes from
    # REDIS_URL in the environment, where the usage text would not help.
    try:
        return check_redis_url(value)
    except ValueError as exc:
        _fail(f"error: {exc} (from --redis-url or REDIS_URL)", EXIT_BAD_INPUT)


@click.group(cls=_Main)
@click.option("--redis-url", envvar="REDIS_URL", default=C.DEFAULT_REDIS_URL,
              show_default=True, callback=_check_url,
              help="Redis to use (env REDIS_URL). Key prefix: env VLMQ_PREFIX.")
@click.pass_context
def main(ctx: click.Context, redis_url: str) -> None:
    """vlmq: a Redis job queue for bulk vision-language work (OCR, captioning)."""
    # A plain dict: the worker commands (vlmq.worker.cli) read ctx.obj["redis_url"] too.
    ctx.obj = {"redis_url": redis_url}


# --- enqueue ------------------------------------------------------------------------------


def _parse_labels(_ctx: click.Context, _param: click.Parameter,
                  values: Sequence[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for raw in values:
        key, sep, value = raw.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{raw!r} is not key=value")
        labels[key] = value
    return labels


def _common_options(func: F) -> F:
    options = [
        click.option("--prompt", help="Prompt text (default: the model's own for the task)."),
        click.option("--model", help="Model id the worker should use (default: its own)."),
        click.option("--max-tokens", type=click.IntRange(min=1),
                     help="Most tokens to generate per item."),
        click.option("--max-side", type=click.IntRange(*C.MAX_SIDE_RANGE), metavar="PX",
                     help="Resize so the longer side is at most PX pixels "
                          "(default: the model's own)."),
        click.option("--temperature", type=click.FloatRange(0.0, C.MAX_TEMPERATURE),
                     help="Sampling temperature, 0 = greedy (default: the model's own)."),
        click.option("--stop", multiple=True, help="Extra stop string (repeatable)."),
        click.option("--label", "labels", multiple=True, callback=_parse_labels,
                     metavar="K=V", help="Label stored with the job (repeatable)."),
        click.option("--job-id", metavar="ID",
                     help="Use this job id ([A-Za-z0-9_-]); refused if a job with it exists, "
                          "so a re-run script cannot enqueue the same work twice."),
        click.option("--json", "as_json", is_flag=True, help="Print a JSON object."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _queue_option(default: str) -> Callable[[F], F]:
    return click.option("--queue", default=default, show_default=True, metavar="NAME",
                        help="Queue to put the job on; workers take jobs from the queues "
                             "they are started with.")


def _report(job: Job, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({
            "id": job.id, "queue": job.queue, "items": job.items, "blobs": job.blobs,
            "uploaded": job.uploaded,
            "rejected": [{"path": p, "reason": r} for p, r in job.rejected],
        }))
        return
    for path, reason in job.rejected:
        click.echo(f"vlmq: skipped {path}: {reason}", err=True)
    click.echo(job.id)


@main.group()
def enqueue() -> None:
    """Validate inputs, upload them once, and enqueue one job."""


@enqueue.command()
@click.argument("files", nargs=-1, required=True)
@click.option("--pages", metavar="RANGE", help="Pages of each PDF, e.g. 1-3,7 (default all).")
@_queue_option("ocr")
@_common_options
@click.pass_context
@_handle_errors
def ocr(ctx: click.Context, files: tuple[str, ...], pages: str | None, queue: str,
        prompt: str | None, model: str | None, max_tokens: int | None, max_side: int | None,
        temperature: float | None, stop: tuple[str, ...], labels: dict[str, str],
        job_id: str | None, as_json: bool) -> None:
    """OCR PDFs (one item per page) and page images."""
    with _client(ctx) as client:
        try:
            job = client.ocr(files, pages, max_side=max_side, prompt=prompt, queue=queue,
                             model=model, max_tokens=max_tokens, temperature=temperature,
                             stop=stop, labels=labels, job_id=job_id)
        except PagesWithoutPdf as exc:
            raise PagesWithoutPdf("--pages") from exc  # name the option the user typed
        _report(job, as_json)


def _set_command(task: str, needs_prompt: bool) -> Callable[..., None]:
    @click.argument("paths", nargs=-1, required=True)
    @click.option("--recursive", "-r", is_flag=True, help="Descend into folders.")
    @click.option("--skip-bad", is_flag=True,
                  help="Enqueue the good files and report the bad ones (default: reject all).")
    @_queue_option(task)
    @_common_options
    @click.pass_context
    @_handle_errors
    def command(ctx: click.Context, paths: tuple[str, ...], recursive: bool, skip_bad: bool,
                queue: str, prompt: str | None, model: str | None, max_tokens: int | None,
                max_side: int | None, temperature: float | None, stop: tuple[str, ...],
                labels: dict[str, str], job_id: str | None, as_json: bool) -> None:
        if needs_prompt and not prompt:
            raise click.UsageError("--prompt is required")
        with _client(ctx) as client:
            kwargs: dict[str, Any] = dict(
                recursive=recursive, skip_bad=skip_bad, queue=queue, model=model,
                max_tokens=max_tokens, max_side=max_side, temperature=temperature,
                stop=stop, labels=labels, job_id=job_id)
            if task == "generate":
                assert prompt is not None
                job = client.generate(paths, prompt, **kwargs)
            else:
                job = client.caption(paths, prompt=prompt, **kwargs)
            _report(job, as_json)

    return command


enqueue.command(
    "caption",
    help="Caption images given as files, folders or globs.")(_set_command("caption", False))
enqueue.command(
    "generate",
    help="Run one prompt (--prompt, required) over images.")(_set_command("generate", True))


# --- status / wait / result -----------------------------------------------------------------


@main.command()
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.pass_context
def status(ctx: click.Context, job_id: str | None, as_json: bool) -> None:
    """A job's state and progress; without JOB_ID, queue depths and workers.

    Exit 1 when the job is not a readable vlmq job (its status and error still shown).
    """
    with _client(ctx) as client:
        if job_id is not None:
            job = client.job(job_id)
            _job_status(job, as_json)
            if job.problem is not None:
                sys.exit(EXIT_FAILED)
        else:
            _overview(client, as_json)


def _job_status(job: Job, as_json: bool) -> None:
    state = job.status()
    done, total = job.progress()
    failed = job.failed_items()
    summary = job.summary() if state == "finished" else None
    error = job.error() if state == "failed" else None
    if as_json:
        click.echo(json.dumps({"id": job.id, "queue": job.queue, "status": state,
                               "done": done, "total": total, "failed": failed,
                               "labels": job.labels, "summary": summary, "error": error,
                               "problem": job.problem}))
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
    click.echo("queues:" if queues else "queues: none")
    width = max((len(n) for n in queues), default=0)
    for q in queues.values():
        click.echo(f"  {q.name:<{width}}  queued {q.queued:<6} started {q.started:<4} "
                   f"failed {q.failed:<4} finished {q.finished}")
    click.echo("workers:" if workers else "workers: none")
    for w in workers:
        head = f"  {w.name}  {w.state or '?'}"
        if w.queues:
            head += f"  [{', '.join(w.queues)}]"
        click.echo(head)
        if w.stats.get("blas"):
            click.echo(f"    blas: {w.stats['blas']}")
        if w.stats:
            click.echo("    " + "  ".join(f"{k}={v}" for k, v in sorted(w.stats.items())))


@main.command()
@click.argument("job_ids", nargs=-1, required=True)
@click.option("--timeout", type=click.FloatRange(min=0), metavar="S",
              help="Give up after S seconds (exit 124).")
@click.pass_context
def wait(ctx: click.Context, job_ids: tuple[str, ...], timeout: float | None) -> None:
    """Wait for jobs with a progress bar; exit 1 if any did not finish, 124 on timeout."""
    with _client(ctx) as client:
        jobs = [client.job(j) for j in job_ids]
        try:
            statuses = wait_all(jobs, timeout=timeout, progress=True)
        except WaitTimeout as exc:
            _fail(str(exc), EXIT_TIMEOUT)
        bad = False
        for job in jobs:
            state = statuses[job.id]
            line = f"{job.id}: {state}"
            if state != "finished":
                bad = True
                error = job.error()
                if error:
                    line += f": {_last_line(error)}"
            click.echo(line)
        if bad:
            sys.exit(EXIT_FAILED)


@main.command()
@click.argument("job_id")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "json", "md"]), default="jsonl",
              show_default=True,
              help="jsonl: one item result per line; json: one object with the job's status "
                   "and summary; md: a readable document, one section per page or image.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write here instead of stdout.")
@click.pass_context
def result(ctx: click.Context, job_id: str, fmt: str, output: str | None) -> None:
    """Print a job's results in item order (partial while it runs).

    Exit 1 when the job failed; the results it has are still printed, and the failure
    message is on stderr (and in the json and md output).
    """
    with _client(ctx) as client:
        job = client.job(job_id)
        state = job.status()
        if job.problem is not None:
            error = job.error()
            detail = f"\nerror: {error.strip()}" if error else ""
            _fail(f"error: job {job.id} is not a readable vlmq job: {job.problem}\n"
                  f"status: {state}{detail}", EXIT_FAILED)
        results = list(job.results())
        error = job.error() if state == "failed" else None
        if fmt == "jsonl":
            text = "".join(json.dumps(r.to_dict()) + "\n" for r in results)
        elif fmt == "json":
            text = json.dumps({"id": job.id, "status": state, "labels": job.labels,
                               "summary": job.summary() if state == "finished" else None,
                               "error": error,
                               "items": [r.to_dict() for r in results]}, indent=2) + "\n"
        else:
            text = render_markdown(job, state, results, error)
        if len(results) < job.items:
            click.echo(f"vlmq: job {job.id} is {state}: {len(results)}/{job.items} items "
                       "done; results are partial", err=True)
    if output:
        try:
            with open(output, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            _fail(f"error: cannot write {output}: {exc.strerror or exc}", EXIT_BAD_INPUT)
    else:
        click.echo(text, nl=False)
    if error is not None:
        click.echo(f"vlmq: job {job.id} failed: {_last_line(error)}", err=True)
        sys.exit(EXIT_FAILED)


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


# Worker commands live with the worker (which imports without MLX); attach them if present.
if importlib.util.find_spec("vlmq.worker.cli") is not None:
    from vlmq.worker.cli import register as _register_worker_commands

    _register_worker_commands(main)
