"""What vlmq's log lines carry and how an operator picks them: the levels, the two formats,
the logging options of every long-running command, and the fields beyond the message.

Both sides read it: the worker's option table makes its rows from OPTIONS and its log
calls about a job pass `extra=job_fields(...)`; the CLI makes the same click options for
its other long-running commands and formats the lines (cli/logs.py). A JSON log line is
read by programs, so its field names are defined here once, like the protocol's.
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
DEFAULT_LEVEL = "info"
DEFAULT_FORMAT = "text"
# Record attributes (set with extra=) that a JSON line carries as fields when present.
JOB_ID = "job_id"
ITEM = "item"
FIELDS = (JOB_ID, ITEM)


def job_fields(job_id: str, item: int | None = None) -> dict[str, object]:
    """`extra=` of a log call about a job or one of its items: a JSON line then names them
    as fields, so one job's lines are found without parsing messages."""
    return {JOB_ID: job_id} if item is None else {JOB_ID: job_id, ITEM: item}


@dataclass(frozen=True)
class LogOption:
    """One logging option: a choice (`choices` given) or an on/off flag."""

    name: str
    flag: str
    help: str
    choices: tuple[str, ...] = ()
    default: str | bool = False


OPTIONS: tuple[LogOption, ...] = (
    LogOption("log_level", "--log-level", "The least severe lines logged. debug adds vlmq's "
              "own debug lines; other libraries stay at info.", LEVELS, DEFAULT_LEVEL),
    LogOption("verbose", "-v", "Log debug lines too (--log-level debug)."),
    LogOption("quiet", "-q", "Log warnings and errors only (--log-level warning)."),
    LogOption("log_format", "--log-format", "text: 'TIME LEVEL LOGGER: MESSAGE' lines; "
              "json: one JSON object per line with time, level, logger, message, and job_id "
              "and item where the line is about one.", FORMATS, DEFAULT_FORMAT),
)


def level_of(log_level: str, *, verbose: bool, quiet: bool) -> str:
    """The level the options ask for. -v and -q are shorthands that win over --log-level,
    so a level from a config file or the environment is overridden on the command line;
    both at once ask for two things (ValueError)."""
    if verbose and quiet:
        raise ValueError("-v and -q contradict each other: give one")
    if log_level not in LEVELS:
        raise ValueError(f"{log_level!r} is not a log level ({', '.join(LEVELS)})")
    return "debug" if verbose else "warning" if quiet else log_level
