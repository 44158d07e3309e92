"""What a long producer step reports as it goes, and to whom: the library counts and
phrases, the caller shows. Like rq's and arq's clients, the producer writes nothing to a
terminal itself; the CLI's bars and lines (cli/progress.py) are one such caller.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Protocol


class Progress(Protocol):
    """Told each new count of a step (items done, files hashed); `final` at the end."""

    def update(self, done: int, *, final: bool = False) -> None: ...


class ShowProgress(Protocol):
    """Opens a Progress for `total` units named `label`, closed with `stack`."""

    def __call__(self, stack: ExitStack, total: int, label: str) -> Progress: ...


class StatusLines(Protocol):
    """Told the upload budget's status lines. `line` may be a callable, so that a line the
    receiver does not show costs no Redis round trip; `force`: a line that must be shown
    (the first wait, a queue with no worker); `live`: one a terminal may rewrite in place
    until the next. `end` comes when a wait is over."""

    def __call__(self, line: str | Callable[[], str], *, force: bool, live: bool) -> None: ...

    def end(self) -> None: ...
