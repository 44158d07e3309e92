"""A fault a test can inject into the engine's generator step, through a real worker.

Containment must be proved where it lives: a failing step whose culprit the engine does not
know (an MLX error) must cost that row alone. MLX gives no way to make one row's step fail,
so this raises in place of the step while a chosen row is in the batch. It is off unless
VLMQ_FAULT_ROW is set, and a worker that has it set says so in its log.

VLMQ_FAULT_ROW="<job id>:<item index>[@<tokens>]": every step fails while that item is in
the batch and has generated at least <tokens> tokens (default 2, so the fault lands mid-
decode, beside other rows).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV = "VLMQ_FAULT_ROW"

# The rows in the batch at a step: (request key, tokens generated so far).
Rows = Sequence[tuple[Hashable, int]]
StepFault = Callable[[Rows], None]


class InjectedFault(RuntimeError):
    """What the injected step raises: to the engine, an error of unknown origin."""


@dataclass(frozen=True)
class RowFault:
    key: tuple[str, int]
    after_tokens: int = 2

    def __call__(self, rows: Rows) -> None:
        for key, tokens in rows:
            if key == self.key and tokens >= self.after_tokens:
                raise InjectedFault("injected step fault (VLMQ_FAULT_ROW)")


def parse(spec: str) -> RowFault:
    """`job:idx[@tokens]`; ValueError naming the format otherwise."""
    head, _, after = spec.partition("@")
    job, sep, idx = head.rpartition(":")
    if not sep or not job or not idx.isdigit() or (after and not after.isdigit()):
        raise ValueError(f"{ENV}={spec!r}: expected <job id>:<item index>[@<tokens>]")
    return RowFault((job, int(idx)), int(after) if after else 2)


def from_env() -> StepFault | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    fault = parse(spec)
    log.warning("%s is set: every generator step fails while item %d of job %s is in the "
                "batch (a test hook)", ENV, fault.key[1], fault.key[0])
    return fault
