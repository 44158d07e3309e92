"""What every vlmq command shares: exit codes and the one-line failure.

Exit codes are part of the interface so scripts can branch on them:
0 ok; 1 a job failed / not found / Redis unreachable or refusing writes (maxmemory, a
read-only replica); 2 bad input or usage (nothing was written to Redis; for `result`, an
-o path that cannot be written); 3 `wait --strict`: every job finished, but some items
failed; 124 `wait` timed out.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click

from vlmq.shared.keys import JOB_ID_SHAPE, QUEUE_SHAPE, SCHEDULE_SHAPE, IdShape, label_problem
from vlmq.stores.backends import STORES_ENV, StoreError, Stores

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_FAILED_ITEMS = 3
# `vlmq worker`: a configuration error (model, --blas, cache dir...) that a restart cannot
# fix (sysexits EX_CONFIG; the units vlmq service writes do not restart on it).
EXIT_CONFIG = 78
EXIT_TIMEOUT = 124


def fail(message: str, code: int) -> NoReturn:
    click.echo(f"vlmq: {message}", err=True)
    sys.exit(code)


class IdType(click.ParamType[str, Any]):
    """A command argument that is an id by its shape (shared/keys.py's IdShape): a
    malformed one is a usage error (exit 2, naming it and the shape) before any command
    reaches Redis, where `b-x:jobs` would name another key (issue 29)."""

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


def split_labels(values: Sequence[str]) -> dict[str, str]:
    """`key=value` strings as a dict; ValueError names the first one without a key or '='
    or one no job could carry (shared/keys.py's label_problem)."""
    labels: dict[str, str] = {}
    for raw in values:
        key, sep, value = raw.partition("=")
        if not sep or not key:
            raise ValueError(f"label {raw!r} is not key=value")
        problem = label_problem(key, value)
        if problem is not None:
            raise ValueError(problem)
        labels[key] = value
    return labels


def parse_labels(_ctx: click.Context, _param: click.Parameter,
                 values: Sequence[str]) -> dict[str, str]:
    """Click callback for repeatable `--label K=V` options."""
    try:
        return split_labels(values)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def one_line(text: str) -> str:
    return " ".join(text.split())


def _stores_callback(_ctx: click.Context, _param: click.Parameter,
                     value: tuple[str, ...]) -> Stores:
    try:
        return Stores.parse(value)
    except StoreError as exc:
        raise click.BadParameter(str(exc), param_hint="--store") from None


def store_option(func: F) -> F:
    """`--store NAME=URL` (repeatable; default $VLMQ_STORES): the command gets `stores`."""
    return click.option(
        "--store", "stores", multiple=True, envvar=STORES_ENV, metavar="NAME=URL",
        callback=_stores_callback,
        help="A store this machine reads inputs from by reference: NAME=file:///folder or "
             "NAME=s3://bucket/prefix (repeatable; default: $VLMQ_STORES, comma-separated). "
             "Machine configuration: the same NAME may be another path elsewhere.")(func)
