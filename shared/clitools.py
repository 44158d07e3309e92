"""What every vlmq command shares: exit codes and the one-line failure.

Exit codes are part of the interface so scripts can branch on them:
0 ok; 1 a job failed / not found / Redis unreachable or refusing writes (maxmemory, a
read-only replica); 2 bad input or usage (nothing was written to Redis; for `result`, an
-o path that cannot be written); 3 `wait --strict`: every job finished, but some items
failed; 124 `wait` timed out.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NoReturn

import click

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_FAILED_ITEMS = 3
EXIT_TIMEOUT = 124


def fail(message: str, code: int) -> NoReturn:
    click.echo(f"vlmq: {message}", err=True)
    sys.exit(code)


def split_labels(values: Sequence[str]) -> dict[str, str]:
    """`key=value` strings as a dict; ValueError names the first one without a key or '='."""
    labels: dict[str, str] = {}
    for raw in values:
        key, sep, value = raw.partition("=")
        if not sep or not key:
            raise ValueError(f"label {raw!r} is not key=value")
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
