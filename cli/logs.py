"""Logging for the long-running commands (worker, api, dashboard, scheduler, metrics): their
--log-level, -v, -q and --log-format (shared/logs.py's OPTIONS as click options), and the
one set-up each calls, so every command's lines look alike.

Text lines are `2026-12-06 23:00:00,123 INFO vlmq.worker: message` (local time); JSON
lines are one object each, with the time in UTC, for log shippers. `vlmq worker` takes the
same options as rows of its option table (worker/options.py), so that `vlmq service`
writes them into units; its command builds LogSettings from their values.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO, TypeVar

import click

from vlmq.shared import logs

F = TypeVar("F", bound=Callable[..., Any])

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The root handler's name: a second set-up replaces it rather than doubling every line.
HANDLER_NAME = "vlmq"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a message's newlines are escaped), so a
    log shipper needs no multi-line parsing."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in logs.FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


@dataclass(frozen=True)
class LogSettings:
    """The level and format the options chose."""

    level: str = logs.DEFAULT_LEVEL
    fmt: str = logs.DEFAULT_FORMAT

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> LogSettings:
        """From the options' values by name (a usage error when -v and -q are both given).
        What the command line says outranks what a variable or the config file says, as for
        every option: `-q` typed beats `verbose` from the file, `--log-level debug` typed
        beats `quiet` from the environment."""
        verbose, quiet = values["verbose"], values["quiet"]
        typed = _typed(("log_level", "verbose", "quiet"))
        if typed & {"verbose", "quiet"}:
            verbose, quiet = verbose and "verbose" in typed, quiet and "quiet" in typed
        elif "log_level" in typed:
            verbose = quiet = False
        try:
            level = logs.level_of(values["log_level"], verbose=verbose, quiet=quiet)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        return cls(level=level, fmt=values["log_format"])

    def configure(self, stream: TextIO | None = None) -> None:
        """Route every record to stderr in the chosen format. vlmq's loggers get the
        chosen level; other libraries at most info, since their debug lines (HTTP pools,
        image plugins) would bury vlmq's. Python warnings become log records too, so a
        JSON log stays JSON."""
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.set_name(HANDLER_NAME)
        handler.setFormatter(JsonFormatter() if self.fmt == "json"
                             else logging.Formatter(TEXT_FORMAT))
        root = logging.getLogger()
        for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
            root.removeHandler(old)
        root.addHandler(handler)
        level = logging.getLevelNamesMapping()[self.level.upper()]
        root.setLevel(max(level, logging.INFO))
        logging.getLogger("vlmq").setLevel(level)
        logging.captureWarnings(True)


def _typed(names: tuple[str, ...]) -> set[str]:
    """Which of these options the running command's line gave."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return set()
    return {name for name in names
            if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE}


def click_option(option: logs.LogOption) -> Callable[[F], F]:
    """One logging option as click's (`vlmq worker`'s table rows make the same)."""
    if option.choices:
        return click.option(option.flag, option.name, type=click.Choice(option.choices),
                             default=option.default, show_default=True, help=option.help)
    return click.option(option.flag, option.name, is_flag=True, default=False,
                        show_default=False, help=option.help)


def log_options(func: F) -> F:
    """Add --log-level, -v, -q and --log-format, passed on as one `log_setup` argument, a
    LogSettings; the command calls `log_setup.configure()` once its arguments are checked."""
    names = [option.name for option in logs.OPTIONS]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["log_setup"] = LogSettings.from_values({name: kwargs.pop(name) for name in names})
        return func(*args, **kwargs)

    out: Any = wrapper
    for option in reversed(logs.OPTIONS):
        out = click_option(option)(out)
    return out  # type: ignore[no-any-return]
