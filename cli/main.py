"""The `vlmq` command: one root group that composes the producer's and the worker's commands.

It sits above both packages so neither imports the other: what one side needs of the other
(the scheduler loop beside a worker, the demo that enqueues and serves) is wired here. The
worker's commands are always present (they import only click) and themselves say when the
worker extra is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

import click
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import ReadOnlyError as RedisReadOnlyError
from redis.exceptions import ResponseError as RedisResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from vlmq.cli import jobs as producer_cli
from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, fail, one_line
from vlmq.producer.client import check_redis_url, redact_url
from vlmq.producer.errors import JobNotFound
from vlmq.shared import constants as C

# Modules whose commands register only when a command not yet known is asked for (or the
# list is shown): `vlmq jobs` starts without importing the worker's, the schedules', the
# exports' or the dashboard's modules. Each has register(group), as producer_cli.
LATER = ("vlmq.cli.export", "vlmq.cli.schedules", "vlmq.cli.worker",
         "vlmq.cli.dashboard", "vlmq.cli.metrics", "vlmq.cli.units")


class _Main(click.Group):
    """The root group: Redis unreachable or refusing a command, or a job id not found,
    is one line, for the producer's and the worker's commands alike."""

    _all_loaded = False

    def load_all(self) -> None:
        """Register every command (LATER's), once."""
        if not self._all_loaded:
            self._all_loaded = True
            for name in LATER:
                importlib.import_module(name).register(self)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and not self._all_loaded:
            self.load_all()
            command = super().get_command(ctx, cmd_name)
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        self.load_all()
        return super().list_commands(ctx)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            url = redact_url(str(ctx.params.get("redis_url") or ""))
            fail(f"error: cannot reach Redis at {url}: {exc}", EXIT_FAILED)
        except RedisResponseError as exc:
            # The server said no (maxmemory with noeviction, a read-only replica, ...):
            # an operator's problem, and the server's own message is what they need.
            url = redact_url(str(ctx.params.get("redis_url") or ""))
            fail(f"error: {_refusal(exc)}: {server_message(exc)} (Redis at {url})",
                 EXIT_FAILED)
        except JobNotFound as exc:
            fail(f"error: {exc}", EXIT_FAILED)


# redis-py prefixes a pipeline's error with the failed command, arguments and all: a
# blob upload's SET would print the image's bytes.
_PIPELINE_HEAD = "Command # "
_PIPELINE_TAIL = " of pipeline caused error: "
_MESSAGE_MAX = 500


def server_message(exc: RedisResponseError) -> str:
    """The server's own words, never the payload: a pipeline's quoted command is cut to its
    name, anything unprintable is escaped, and the rest capped at _MESSAGE_MAX characters.
    """
    text = str(exc)
    if text.startswith(_PIPELINE_HEAD) and _PIPELINE_TAIL in text:
        head, _, reason = text.rpartition(_PIPELINE_TAIL)
        number, _, command = head[len(_PIPELINE_HEAD):].partition(" (")
        name = command.split(" ", 1)[0]
        text = f"{reason} (in {name if name.isalpha() else 'a'} command {number} of a pipeline)"
    text = one_line(text).encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    return text if len(text) <= _MESSAGE_MAX else text[:_MESSAGE_MAX] + "…"


def _refusal(exc: RedisResponseError) -> str:
    if isinstance(exc, RedisOutOfMemoryError):
        return "Redis is out of memory (maxmemory)"
    if isinstance(exc, RedisReadOnlyError):
        return "Redis is read-only (a replica?)"
    return "Redis refused a command"


def _check_url(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    # One line and exit 2 rather than click's usage block: the URL usually comes from
    # REDIS_URL in the environment, where the usage text would not help.
    try:
        return check_redis_url(value)
    except ValueError as exc:
        fail(f"error: {exc} (from --redis-url or REDIS_URL)", EXIT_BAD_INPUT)


@click.group(cls=_Main)
@click.option("--redis-url", envvar="REDIS_URL", default=C.DEFAULT_REDIS_URL,
              show_default=True, callback=_check_url,
              help="Redis to use (env REDIS_URL). Key prefix: env VLMQ_PREFIX.")
@click.pass_context
def main(ctx: click.Context, redis_url: str) -> None:
    """vlmq: a Redis job queue for bulk vision-language work (OCR, captioning)."""
    # A plain dict, so that both sides read it without importing each other; the worker's
    # --with-scheduler runs the producer's scheduler loop through it.
    ctx.obj = {"redis_url": redis_url, "start_scheduler": _start_scheduler}


def _start_scheduler(*args: Any, **kwargs: Any) -> Any:
    """producer.schedule.start_scheduler_thread, imported only by a worker that runs it."""
    from vlmq.producer.ops.schedules import start_scheduler_thread

    return start_scheduler_thread(*args, **kwargs)


@main.command("demo")
@click.option("--model", default=None,
              help="Model to use (default: build the tiny random-weight model).")
@click.option("--max-batch", type=click.IntRange(1, 256), default=8, show_default=True)
@click.pass_context
def demo_cmd(ctx: click.Context, model: str | None, max_batch: int) -> None:
    """Enqueue the bundled sample, run a burst worker on it, and show results and stats."""
    from vlmq.cli import worker as worker_cli

    worker_cli.require_worker_extra()
    from vlmq.cli.demo import run_demo

    ctx.exit(run_demo(redis_url=ctx.obj["redis_url"], model=model, max_batch=max_batch))


producer_cli.register(main)
