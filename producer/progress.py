"""Progress for long producer steps (hashing a folder, waiting for jobs): click's bar on a
terminal, else a line every 10 % or 10 s, so CI logs and pipes see it too."""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack

import click


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
