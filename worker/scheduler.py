"""Which item to prepare next, across every job in flight.

The job with the fewest items left goes first (shortest remaining first), ties to the job
taken earliest. A small job enqueued behind a 2,000-page PDF therefore joins the running
batches at once and finishes first, and a backlog of big jobs finishes one after another
rather than all together at the end, which frees room for the next job sooner.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from vlmq.shared.schema import JobPayload

H = TypeVar("H")


@dataclass
class JobState(Generic[H]):
    """Bookkeeping for one job in flight; `handle` is the RQ lifecycle's own record."""

    job_id: str
    handle: H
    payload: JobPayload
    pending: deque[int]
    already_done: int
    outstanding: set[int] = field(default_factory=set)
    finished_here: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def total(self) -> int:
        return len(self.payload.items)

    @property
    def complete(self) -> bool:
        return not self.pending and not self.outstanding


class Scheduler(Generic[H]):
    def __init__(self) -> None:
        self.jobs: OrderedDict[str, JobState[H]] = OrderedDict()

    def add(self, state: JobState[H]) -> None:
        self.jobs[state.job_id] = state

    def remove(self, job_id: str) -> JobState[H]:
        return self.jobs.pop(job_id)

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def unscheduled(self) -> int:
        return sum(len(j.pending) for j in self.jobs.values())

    @property
    def outstanding(self) -> int:
        return sum(len(j.outstanding) for j in self.jobs.values())

    def next_item(self) -> tuple[JobState[H], int] | None:
        """Pop one pending item of the job with the fewest left, or None if nothing is."""
        best: JobState[H] | None = None
        for state in self.jobs.values():  # insertion order: ties go to the earliest job
            left = len(state.pending) + len(state.outstanding)
            if state.pending and (best is None or
                                  left < len(best.pending) + len(best.outstanding)):
                best = state
        if best is None:
            return None
        idx = best.pending.popleft()
        best.outstanding.add(idx)
        return best, idx

    def retry_item(self, job_id: str, idx: int) -> None:
        """Put an item whose preparation hit a transient error back at the head of its job."""
        state = self.jobs.get(job_id)
        if state is not None and idx in state.outstanding:
            state.outstanding.discard(idx)
            state.pending.appendleft(idx)

    def finish_item(self, job_id: str, idx: int) -> JobState[H] | None:
        """Mark an item finished; returns its job, or None if the job is no longer here."""
        state = self.jobs.get(job_id)
        if state is None or idx not in state.outstanding:
            return None
        state.outstanding.discard(idx)
        state.finished_here += 1
        return state
