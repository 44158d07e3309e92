"""What every vlmq command shares: exit codes, the one-line failure, --json errors.

Exit codes are part of the interface so scripts can branch on them (EXIT_CODES; the table
in docs/jobs.md "Exit codes" is this one): a command that cannot reach Redis exits 69
whenever that happens, at its start or in the middle of a wait, so 1 always means a job
(or an id) and never the connection.

Every command imports this module before it runs: it imports nothing heavy (no redis,
no Pillow), so `vlmq X --help` stays fast.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from vlmq.producer.labels import split_labels
from vlmq.shared import constants as C
from vlmq.shared.keys import JOB_ID_SHAPE, QUEUE_SHAPE, SCHEDULE_SHAPE, IdShape

if TYPE_CHECKING:
    from vlmq.stores.backends import Stores

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_FAILED_ITEMS = 3
EXIT_UNREACHABLE = 69  # sysexits EX_UNAVAILABLE
# A configuration error that a restart cannot fix: a missing install extra; the worker's
# model, --blas, cache dir... (sysexits EX_CONFIG; the units `vlmq service` writes do not
# restart on it).
EXIT_CONFIG = 78
EXIT_TIMEOUT = 124

# Each code, the name a --json error carries as "kind", and what it means. docs/jobs.md's
# table is checked against it (tests/cli/test_conventions.py).
EXIT_CODES: dict[int, tuple[str, str]] = {
    EXIT_OK: ("ok", "done: every job asked about finished, or the command did its work"),
    EXIT_FAILED: ("failed", "a job failed, was canceled or is not found; an item failed or "
                            "was refused (export); Redis refused a command (maxmemory, a "
                            "read-only replica) or may evict keys"),
    EXIT_BAD_INPUT: ("usage", "bad input or usage: an unknown option or choice, a malformed "
                              "id, an unreadable input file, an -o path that cannot be "
                              "written; nothing was written to Redis"),
    EXIT_FAILED_ITEMS: ("failed_items", "`wait --strict`: every job finished, but some "
                                        "items failed"),
    EXIT_UNREACHABLE: ("redis_unreachable", "Redis cannot be reached, at the start or "
                                            "until `wait --timeout` passed"),
    EXIT_CONFIG: ("config", "a configuration no restart can fix: an install extra the "
                            "command needs is missing; `vlmq worker`: a missing model folder, "
                            "a bad --store or --blas; its service is not restarted"),
    EXIT_TIMEOUT: ("timeout", "`wait --timeout`, or enqueue's `--wait-timeout`, passed"),
}

# ctx.meta key: the command line asked for --json, so errors are JSON on stderr too.
JSON_META = "vlmq.json"


def json_wanted(args: Sequence[str]) -> bool:
    """Whether a command line asks for --json (before any `--`): known while it is parsed,
    so a usage error in it is JSON already."""
    head = list(args)
    return "--json" in (head[:head.index("--")] if "--" in head else head)


def no_color() -> bool:
    """https://no-color.org: any non-empty NO_COLOR turns colour off."""
    return bool(os.environ.get("NO_COLOR"))


def _json_errors() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get(JSON_META))


def package_version() -> str:
    """vlmq's installed version, from its package metadata as `vlmq --version` reads it."""
    from importlib.metadata import version

    return version("vlmq")


def error_json(message: str, code: int) -> str:
    """A failure as --json prints it on stderr: {"error": {"code", "kind", "message"}}."""
    text = message.removeprefix("error: ")
    kind = EXIT_CODES.get(code, ("failed", ""))[0]
    return json.dumps({"error": {"code": code, "kind": kind, "message": text}})


def _say(message: str) -> None:
    # Red on a terminal; click drops the colour elsewhere, and NO_COLOR drops it
    # everywhere (the root group sets ctx.color).
    click.echo(click.style("vlmq:", fg="red", bold=True) + f" {message}", err=True)


def fail(message: str, code: int) -> NoReturn:
    """Say why on stderr (one JSON object under --json) and exit with `code`."""
    if _json_errors():
        click.echo(error_json(message, code), err=True)
    else:
        _say(message)
    sys.exit(code)


class ConfigError(click.ClickException):
    """A configuration that no restart can fix (a missing install extra, a store that
    cannot be parsed): exit 78, which the service units vlmq writes do not restart."""

    exit_code = EXIT_CONFIG


def show_error(exc: click.ClickException) -> None:
    """click's report of `exc` (a usage error's usage line and hint first) with the
    `vlmq: error:` prefix of every other failure in place of click's `Error:`, so one
    prefix finds them all."""
    buf = io.StringIO()
    exc.show(buf)
    text, line = buf.getvalue(), f"Error: {exc.format_message()}\n"
    if text.endswith(line) and len(text) > len(line):
        click.echo(text[:-len(line)], err=True, nl=False)
    _say(f"error: {exc.format_message()}")


class IdType(click.ParamType[str, Any]):
    """A command argument that is an id by its shape (shared/keys.py's IdShape): a
    malformed one is a usage error (exit 2, naming it and the shape) before any command
    reaches Redis, where `b-x:jobs` would name another key."""

    def __init__(self, shape: IdShape) -> None:
        self.shape = shape
        self.name = shape.kind

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        problem = self.shape.problem(value)
        if problem is not None:
            self.fail(problem, param, ctx)
        return str(value)


JOB_ID = IdType(JOB_ID_SHAPE)
QUEUE = IdType(QUEUE_SHAPE)
SCHEDULE_NAME = IdType(SCHEDULE_SHAPE)


def parse_labels(_ctx: click.Context, _param: click.Parameter,
                 values: Sequence[str]) -> dict[str, str]:
    """Click callback for repeatable `--label K=V` options."""
    try:
        return split_labels(values)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def collapse_whitespace(text: str) -> str:
    return " ".join(text.split())


def _stores(value: tuple[str, ...], config: bool) -> Stores:
    from vlmq.stores.backends import StoreError, Stores

    try:
        return Stores.parse(value)
    except StoreError as exc:
        if config:
            raise ConfigError(f"invalid value for --store: {exc}") from None
        raise click.BadParameter(str(exc), param_hint="--store") from None


def _stores_callback(_ctx: click.Context, _param: click.Parameter,
                     value: tuple[str, ...]) -> Stores:
    return _stores(value, config=False)


def _config_stores_callback(_ctx: click.Context, _param: click.Parameter,
                            value: tuple[str, ...]) -> Stores:
    return _stores(value, config=True)


def store_option(func: F) -> F:
    """`--store NAME=URL` (repeatable; default $VLMQ_STORES): the command gets `stores`."""
    return _store_option(func, _stores_callback)


def config_store_option(func: F) -> F:
    """store_option for a service (`vlmq worker`): its stores are the machine's
    configuration (a unit's environment), so one it cannot parse is a ConfigError."""
    return _store_option(func, _config_stores_callback)


def _store_option(func: F, callback: Callable[..., Stores]) -> F:
    return click.option(
        "--store", "stores", multiple=True, envvar=C.STORES_ENV, metavar="NAME=URL",
        callback=callback,
        help="A store this machine reads inputs from by reference: NAME=file:///folder or "
             "NAME=s3://bucket/prefix (repeatable; default: $VLMQ_STORES, comma-separated). "
             "Machine configuration: the same NAME may be another path elsewhere.")(func)
