"""How the CLI shows what a long producer step reports: click's bar on a terminal, else a
line every 10 % or 10 s, so CI logs and pipes see it too; and the upload budget's status
lines, rewritten in place on a terminal. The producer only counts and phrases
(producer/progress.py); the drawing is here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import ExitStack

import click

# At most one status line this often unless one is forced: CI logs stay short.
STATUS_EVERY_S = 10.0


class ProgressBar:
    """Progress on a terminal: click's bar, moved on to each new count."""

    def __init__(self, stack: ExitStack, total: int, label: str) -> None:
        self.bar = stack.enter_context(click.progressbar(
            length=total, label=label, file=sys.stderr, show_pos=True, show_eta=True))
        self.shown = 0

    def update(self, done: int, *, final: bool = False) -> None:
        if done > self.shown:
            self.bar.update(done - self.shown)
            self.shown = done


class ProgressLines:
    """Progress without a terminal (CI logs, pipes): a line every 10 % or every 10 s."""

    EVERY_S = 10.0
    STEP = 0.1

    def __init__(self, total: int, label: str) -> None:
        self.total = total
        self.label = label
        self.started = time.monotonic()
        self.last_t = self.started
        self.last_step = -1

    def update(self, done: int, *, final: bool = False) -> None:
        now = time.monotonic()
        step = int(done / self.total / self.STEP) if self.total else 10
        if step > self.last_step or now - self.last_t >= self.EVERY_S or final:
            if final and step == self.last_step and now - self.last_t < self.EVERY_S:
                return
            pct = 100 * done / self.total if self.total else 100.0
            click.echo(f"{self.label} {done}/{self.total} ({pct:.0f}%) after "
                       f"{now - self.started:.0f}s", err=True)
            self.last_step, self.last_t = step, now


def display(stack: ExitStack, total: int, label: str) -> ProgressBar | ProgressLines:
    """A bar (closed with `stack`) on a terminal, lines elsewhere."""
    return ProgressBar(stack, total, label) if sys.stderr.isatty() else ProgressLines(total, label)


class StatusLines:
    """The upload budget's status lines on stderr, at most one every STATUS_EVERY_S
    seconds unless forced. `live` lines (waiting) are rewritten in place on a terminal
    until the next forced one; a line given as a callable is built only when shown, so a
    line not shown costs the producer no Redis round trip."""

    def __init__(self) -> None:
        self._said = time.monotonic()  # the first line after STATUS_EVERY_S
        self._open = False  # a live line is on the terminal

    def __call__(self, line: str | Callable[[], str], *, force: bool, live: bool) -> None:
        now = time.monotonic()
        in_place = live and sys.stderr.isatty()
        if not (force or in_place or now - self._said >= STATUS_EVERY_S):
            return
        text = line() if callable(line) else line
        if in_place:
            click.echo("\r\x1b[2K" + text, err=True, nl=False)
        else:
            click.echo(("\r\x1b[2K" if self._open else "") + text, err=True)
        self._open = in_place
        self._said = now

    def end(self) -> None:
        """Ends a line rewritten in place, once the wait is over."""
        if self._open:
            click.echo("", err=True)
            self._open = False


def warn(text: str) -> None:
    """A warning the producer reports (an evicting Redis allowed), as the CLI says it."""
    click.echo(f"vlmq: warning: {text}", err=True)
