"""The job options as click flags, one per row of shared/settings.py: the producer keeps
the data (JobOptions); only the CLI turns a bad value into a message and an exit code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import click

from vlmq.cli.common import EXIT_BAD_INPUT, fail, parse_labels
from vlmq.producer.options import JobOptions, read_schema_file
from vlmq.shared import settings as S
from vlmq.shared.errors import PayloadError

F = TypeVar("F", bound=Callable[..., Any])


def schema_option(_ctx: click.Context, _param: click.Parameter,
                   value: str | None) -> dict[str, Any] | None:
    """Click callback of `--schema FILE`: the file read and checked before anything else
    runs, so a bad schema exits 2 with Redis untouched."""
    if value is None:
        return None
    try:
        return read_schema_file(value)
    except PayloadError as exc:
        raise click.BadParameter(str(exc)) from None


def _click_type(s: S.Setting) -> Any:
    if s.kind == "int":
        return click.IntRange(int(s.lo or 0), int(s.hi or 0))
    if s.kind == "float":
        return click.FloatRange(s.lo, s.hi)
    if s.kind == "choice":
        return click.Choice(s.choices)
    return None


def _click_options(s: S.Setting, override: Mapping[str, Any]) -> list[Callable[[F], F]]:
    dest = s.name
    if s.switches:  # flag-style options that all set one value
        return [click.option(sw.flag, dest, flag_value=sw.value, default=None, help=sw.help)
                for sw in s.switches]
    kw: dict[str, Any] = {"help": s.help, "metavar": s.metavar}
    if s.kind in ("strs", "labels"):
        kw["multiple"] = True
    if s.kind == "labels":
        kw["callback"] = parse_labels
    if s.kind == "schema":
        kw["callback"] = schema_option
    kind = _click_type(s)
    if kind is not None:
        kw["type"] = kind
    kw.update(override)
    return [click.option(s.cli_flag, dest, **kw)]


def _given(value: Any) -> Any:
    """click's "not given": None, or an empty tuple for a repeatable option."""
    return None if value in ((), {}) else value


def job_options(scope: str | None = None, *, exclude: Iterable[str] = (),
                refused: str = "nothing was enqueued",
                **overrides: Mapping[str, Any]) -> Callable[[F], F]:
    """Add a click option per setting (those `scope` may carry, less `exclude`) and pass
    them on as one `options` argument, a JobOptions. `overrides`: click keywords by
    setting name (a command's own help or default)."""
    chosen = [s for s in (S.rows("cli") if scope is None else S.rows(scope))
              if s.name not in set(exclude)]

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {s.name: _given(kwargs.pop(s.name)) for s in chosen}
            try:
                kwargs["options"] = JobOptions.build(**values)
            except PayloadError as exc:
                fail(f"error: {exc}\n{refused}", EXIT_BAD_INPUT)
            return func(*args, **kwargs)

        out: Any = wrapper
        for s in reversed(chosen):
            for option in reversed(_click_options(s, overrides.get(s.name, {}))):
                out = option(out)
        return out  # type: ignore[no-any-return]

    return decorate
