"""The `vlmq` command: one root group that composes the producer's and the worker's commands.

It sits above both packages so neither imports the other: what one side needs of the other
(the scheduler loop beside a worker, the demo that enqueues and serves) is wired here. The
worker's commands are always present (they import only click) and themselves say when the
worker extra is missing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import click

from vlmq.cli import config
from vlmq.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_CODES,
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    JSON_META,
    collapse_whitespace,
    error_json,
    fail,
    json_wanted,
    no_color,
    show_error,
)
from vlmq.shared import constants as C

if TYPE_CHECKING:
    import threading

    from redis.exceptions import ResponseError

    from vlmq.stores.backends import Stores

# Every command but demo (below): the module whose register(group) adds it, and its
# one-line help. A command's module is imported only when that command runs, and
# `vlmq --help` lists these lines without importing any: so `vlmq jobs` never imports the
# worker's, the dashboard's or the metrics' modules, and each listing command starts with
# only what it uses. tests/cli/test_start_imports.py keeps each line equal to the
# command's own help.
COMMANDS: dict[str, tuple[str, str]] = {
    "enqueue": ("vlmq.cli.jobs", "Validate inputs, upload them once, and enqueue: a task "
                                 "subcommand, --manifest or --openai-batch."),
    "jobs": ("vlmq.cli.jobs", "List jobs, newest first: id, queue, task, status, items "
                              "done/failed/total, age, labels."),
    "status": ("vlmq.cli.jobs", "A job's or a batch's state and progress; with --label, "
                                "totals over every job carrying it; with neither, queue "
                                "depths, workers (full worker stats with --json) and "
                                "Redis's health."),
    "wait": ("vlmq.cli.results", "Wait for jobs with progress (a bar on a terminal, else a line "
             "every 10 % or 10 s); a batch id waits for the batch's end and "
                              "prints one line for it."),
    "result": ("vlmq.cli.results", "Print jobs' results in item order (partial while they run); "
               "a batch id prints its jobs' in batch order."),
    "cancel": ("vlmq.cli.jobs", "Cancel jobs (a batch id: every job of it not yet ended): a "
                                "queued job never runs; a running one is dropped by its worker "
                                "within seconds."),
    "retry": ("vlmq.cli.jobs", "Enqueue a new job with JOB_ID's settings and inputs; prints "
                               "the new id."),
    "delete": ("vlmq.cli.jobs", "Remove jobs with their item results and events (a running "
                                "job is dropped by its worker); a batch id removes its jobs "
                                "and the batch."),
    "reindex": ("vlmq.cli.jobs", "Index the jobs that are not (enqueued before vlmq kept job "
                                 "indexes) and drop the entries of jobs that are gone."),
    "export": ("vlmq.cli.export", "Write jobs' results to files: an item's source (its path "
                                  "relative to the folder it was enqueued from) is its place "
                                  "in the output tree."),
    "schedule": ("vlmq.cli.schedules", "Scheduled, incremental caption/OCR/extract runs over "
                                       "folders (stored in Redis; fired by `vlmq scheduler` "
                                       "or `vlmq worker --with-scheduler`, each due time "
                                       "exactly once)."),
    "scheduler": ("vlmq.cli.schedules", "Fire schedules when due (any number may run: each "
                                        "due time fires once), finish their runs (done "
                                        "marks, exports, sidecars)."),
    "worker": ("vlmq.cli.worker", "Serve jobs with one loaded model and a continuous "
                                  "batcher."),
    "model": ("vlmq.cli.worker", "Model utilities."),
    "dashboard": ("vlmq.cli.dashboard", "A web page over queues, workers and jobs: progress, "
                                        "and each page next to its text."),
    "api": ("vlmq.cli.api", "Serve OpenAI's Files, Batch and Chat Completions API: the "
                            "official SDKs submit bulk work and ask interactive questions "
                            "of vlmq's workers."),
    "metrics": ("vlmq.cli.metrics", "Serve fleet metrics for Prometheus at "
                                    "http://HOST:PORT/metrics."),
    "ask": ("vlmq.cli.ask", "Ask one question about one image now, ahead of the bulk "
                            "work; the answer prints as it is decoded."),
    "help": ("vlmq.cli.help", "Print an installed documentation page (no TOPIC: list them); "
                              "a command's name prints that command's --help."),
    "service": ("vlmq.cli.units", "launchd and systemd units that keep a worker running and "
                                  "stop it within --grace."),
}


def _redis_failure(exc: Exception, url: str) -> tuple[str, int] | None:
    """What to say and the exit code for an error from Redis, or None for any other. redis
    is imported here, once something failed: `vlmq jobs --help` never imports it."""
    from redis import exceptions as R

    from vlmq.producer.errors import JobNotFound
    from vlmq.shared.urls import redact_url

    if isinstance(exc, (R.ConnectionError, R.TimeoutError)):
        return f"error: cannot reach Redis at {redact_url(url)}: {exc}", EXIT_UNREACHABLE
    if isinstance(exc, R.ResponseError):
        # The server said no (maxmemory with noeviction, a read-only replica, ...):
        # an operator's problem, and the server's own message is what they need.
        return (f"error: {_refusal(exc)}: {server_message(exc)} (Redis at "
                f"{redact_url(url)})", EXIT_FAILED)
    if isinstance(exc, JobNotFound):
        return f"error: {exc}", EXIT_FAILED
    return None


# ctx.meta key: the command line shows help (or completes a word) and runs nothing.
_HELP_META = "vlmq.help"


class _Main(click.Group):
    """The root group: commands load when asked for (COMMANDS); Redis unreachable or
    refusing a command, or a job id not found, is one line (JSON under --json), for the
    producer's and the worker's commands alike; NO_COLOR turns colour off for all."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loaded: set[str] = set()
        self._named: set[str] = set()
        config.name_variables(self, config.ENV_PREFIX)

    def load(self, module: str) -> None:
        """Register a module's commands, once."""
        if module not in self._loaded:
            self._loaded.add(module)
            importlib.import_module(module).register(self)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS:
            self.load(COMMANDS[cmd_name][0])
        command = super().get_command(ctx, cmd_name)
        if command is not None and cmd_name not in self._named:
            self._named.add(cmd_name)
            config.name_variables(command, f"{config.ENV_PREFIX}_{config.word(cmd_name)}")
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(COMMANDS) | set(self.commands))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from COMMANDS' lines: `vlmq --help` imports no command."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = [(name, short_help(self, ctx, name, limit)) for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = config.hoist(args, self, ctx)
        ctx.meta[JSON_META] = json_wanted(args)
        ctx.meta[_HELP_META] = "--help" in args or ctx.resilient_parsing
        if no_color():
            ctx.color = False  # every command's context inherits it
        self._read_config(ctx, args)
        try:
            return super().parse_args(ctx, args)
        except click.BadParameter as exc:
            _misconfigured(exc)
            _usage_json(ctx, exc)
            raise
        except click.ClickException as exc:
            _usage_json(ctx, exc)
            raise

    def _read_config(self, ctx: click.Context, args: list[str]) -> None:
        """The config file's values become click's default_map, below flags and the
        environment; a file that cannot be used stops every command (exit 78)."""
        path, _named = config.config_path(args)
        if path is None:
            return
        try:
            table = config.load(path)
            config.check(ctx, self, table, path)
        except config.ConfigError as exc:
            fail(f"error: {exc}", EXIT_CONFIG)
        ctx.default_map = table
        ctx.meta[config.CONFIG_META] = path

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.BadParameter as exc:
            _misconfigured(exc)
            _usage_json(ctx, exc)
            raise
        except click.ClickException as exc:
            _usage_json(ctx, exc)
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise  # --help, ctx.exit, ^C: click's own
        except Exception as exc:
            failure = _redis_failure(exc, str(ctx.params.get("redis_url") or ""))
            if failure is None:
                raise
            fail(*failure)


def short_help(group: click.Group, ctx: click.Context, name: str, limit: int = 45) -> str:
    """A command's line in `vlmq --help`: COMMANDS' where it has one, else the command's."""
    line = COMMANDS.get(name, ("", ""))[1]
    if line:  # shortened as click shortens a command's own help
        return click.Command(name, help=line).get_short_help_str(limit)
    command = group.get_command(ctx, name)
    return "" if command is None else command.get_short_help_str(limit)


def _misconfigured(exc: click.BadParameter) -> None:
    """A value refused that came from a config file or a variable: exit 78, naming it."""
    problem = config.misconfigured(exc)
    if problem is not None:
        fail(f"error: {problem}", EXIT_CONFIG)


def _usage_json(ctx: click.Context, exc: click.ClickException) -> None:
    """A usage error or ClickException as every other failure: JSON on stderr under
    --json, else click's report with the `vlmq: error:` prefix; then exit with its code."""
    if ctx.meta.get(JSON_META):
        click.echo(error_json(exc.format_message(), exc.exit_code), err=True)
    else:
        show_error(exc)
    ctx.exit(exc.exit_code)


# redis-py prefixes a pipeline's error with the failed command, arguments and all: a
# blob upload's SET would print the image's bytes.
_PIPELINE_HEAD = "Command # "
_PIPELINE_TAIL = " of pipeline caused error: "
_MESSAGE_MAX = 500


def server_message(exc: ResponseError) -> str:
    """The server's own words, never the payload: a pipeline's quoted command is cut to its
    name, anything unprintable is escaped, and the rest capped at _MESSAGE_MAX characters.
    """
    text = str(exc)
    if text.startswith(_PIPELINE_HEAD) and _PIPELINE_TAIL in text:
        head, _, reason = text.rpartition(_PIPELINE_TAIL)
        number, _, command = head[len(_PIPELINE_HEAD):].partition(" (")
        name = command.split(" ", 1)[0]
        text = f"{reason} (in {name if name.isalpha() else 'a'} command {number} of a pipeline)"
    text = collapse_whitespace(text).encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    return text if len(text) <= _MESSAGE_MAX else text[:_MESSAGE_MAX] + "…"


def _refusal(exc: ResponseError) -> str:
    from redis.exceptions import OutOfMemoryError, ReadOnlyError

    if isinstance(exc, OutOfMemoryError):
        return "Redis is out of memory (maxmemory)"
    if isinstance(exc, ReadOnlyError):
        return "Redis is read-only (a replica?)"
    return "Redis refused a command"


def _check_url(ctx: click.Context, _param: click.Parameter, value: str) -> str:
    # One line and exit 2 rather than click's usage block: the URL usually comes from
    # REDIS_URL in the environment, where the usage text would not help. Not for help or
    # completion: the check imports redis, which they never need.
    if ctx.meta.get(_HELP_META):
        return value
    from vlmq.shared.connection import check_url

    try:
        return check_url(value)
    except ValueError as exc:
        fail(f"error: {exc} (from --redis-url or REDIS_URL)", EXIT_BAD_INPUT)


_HELP = ("vlmq: a Redis job queue for bulk vision-language work (OCR, captioning).\n\n"
         "Exit codes: " + ", ".join(f"{code} {kind}" for code, (kind, _) in EXIT_CODES.items())
         + "; what each means, --json errors and shell completion: `vlmq help jobs`.")


@click.group(cls=_Main, help=_HELP,
             context_settings={"auto_envvar_prefix": config.ENV_PREFIX})
@click.option("--redis-url", envvar=["VLMQ_REDIS_URL", "REDIS_URL"],
              default=C.DEFAULT_REDIS_URL, show_default=True, callback=_check_url,
              help="Redis to use (env VLMQ_REDIS_URL or REDIS_URL); before or after the "
                   "command. Key prefix: env VLMQ_PREFIX.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              metavar="FILE",
              help="TOML file of option values, below flags and the environment (env "
                   f"{config.CONFIG_ENV}; default: {config.CONFIG_NAME} in "
                   "$XDG_CONFIG_HOME/vlmq, ~/.config/vlmq); before or after the command. "
                   "Every option also reads VLMQ_<COMMAND>_<OPTION>: `vlmq help config`.")
@click.version_option(package_name="vlmq", prog_name="vlmq",
                      message="%(prog)s %(version)s")
@click.pass_context
def main(ctx: click.Context, redis_url: str, config_file: str | None) -> None:
    """The root: _HELP is its help (the exit codes from cli/common.py's table)."""
    # A plain dict, so that both sides read it without importing each other; the worker's
    # --with-scheduler runs the scheduler loop through it.
    ctx.obj = {"redis_url": redis_url, "start_scheduler": _start_scheduler}


def _start_scheduler(redis_url: str, stores: Stores | None = None
                     ) -> tuple[threading.Thread, threading.Event]:
    """server.scheduler.start_scheduler_thread, imported only by a worker that runs it. Its
    warnings are log records, in the worker's log format."""
    import logging

    from vlmq.server.scheduler import start_scheduler_thread

    return start_scheduler_thread(redis_url, stores,
                                  on_warning=logging.getLogger("vlmq.scheduler").warning)


@main.command("demo")
@click.option("--model", default=None,
              help="Model to use: a folder, a hub id, or a name, as `vlmq worker --model` "
                   "(default: reader, vlmq's tiny reader shipped in the package; tiny: "
                   "random weights built offline). A folder of that name in the current "
                   "directory wins.")
@click.option("--max-batch", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--json", "as_json", is_flag=True,
              help="Print what the demo did as one JSON object on stdout (notes and "
                   "errors on stderr).")
@click.pass_context
def demo_cmd(ctx: click.Context, model: str | None, max_batch: int, as_json: bool) -> None:
    """Enqueue the bundled sample, run a burst worker on it, and show results and stats."""
    from vlmq.cli import worker

    worker.require_worker_extra()
    from vlmq.cli.demo import run_demo

    ctx.exit(run_demo(redis_url=ctx.obj["redis_url"], model=model, max_batch=max_batch,
                      as_json=as_json))


if __name__ == "__main__":  # python -m vlmq.cli.main (as python -X importtime does)
    main()
