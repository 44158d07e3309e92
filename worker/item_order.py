"""Which item to prepare next, across every job in flight.

The job with the fewest items left goes first (shortest remaining first); among equals,
the job whose batch has the fewest items out (being prepared or generated), then the job
taken earliest. A small job enqueued behind a 2,000-page PDF therefore joins the running
batches at once and finishes first, and a backlog of big jobs finishes one after another
rather than all together at the end, which frees room for the next job sooner. The batch
tie-break carries the intake's fair turns (shared/fair.py) into the batch: a one-item
batch taken beside a backlog of another batch's one-item jobs gets the next free row, not
one behind every backlog item already prepared.

Interactive jobs (taken from the chat queue) go before all of that: their items are
prepared first, whatever the prep window holds.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from vlmq.shared import fair
from vlmq.shared.messages import JobPayload
from vlmq.worker.job_settings import JobSettings


@dataclass(frozen=True)
class Tally:
    """What a job's summary counts of one item written (its text is not kept)."""

    ok: bool
    prompt_tokens: int
    completion_tokens: int
    vision_cache_hit: bool
    result_cache_hit: bool
    text_source: str | None = None  # where its text came from; None: it has none
    prefix_tokens: int = 0  # prompt tokens a cached prefix spared its prefill


@dataclass(kw_only=True, eq=False)
class JobState:
    """One job in flight and where its items stand.

    The worker's record of a running job (rq_jobs.Running) extends this one, so a job is
    held once: the order, the result writer and the RQ lifecycle share that object.
    """

    job_id: str
    payload: JobPayload
    # Resolved once when the job starts (worker/job_settings.py); every reader uses it.
    settings: JobSettings | None = None
    pending: deque[int] = field(default_factory=deque)  # not yet handed to preparation
    outstanding: set[int] = field(default_factory=set)  # being prepared or generated
    already_done: int = 0      # items with a stored result when this worker took the job
    finished_here: int = 0     # items this worker has stored since
    # Those items, by index, as the summary counts them: a job whose every item is here
    # ends without reading its results back.
    written: dict[int, Tally] = field(default_factory=dict)
    verify: bool = False  # read the stored items back before ending (some went missing)
    # An interactive request (the chat queue): prepared and admitted before bulk work.
    interactive: bool = False
    started: float = field(default_factory=time.monotonic)

    @property
    def resolved(self) -> JobSettings:
        if self.settings is None:
            raise RuntimeError(f"job {self.job_id}: settings used before they were resolved")
        return self.settings

    @property
    def total(self) -> int:
        return len(self.payload.items)

    @property
    def left(self) -> int:
        """Items not yet come back (pending or out)."""
        return len(self.pending) + len(self.outstanding)

    @property
    def share(self) -> str:
        """The batch whose fair share the job counts in (shared/fair.py)."""
        return fair.share_of(self.payload)

    @property
    def complete(self) -> bool:
        """Every item has come back (its result may still wait to be written)."""
        return not self.pending and not self.outstanding


S = TypeVar("S", bound=JobState)
# The engine's priority is one number: items left, then (within the same items left) a
# batch's items out, up to this many.
SHARE_RANKS = 1024


class ItemOrder(Generic[S]):
    def __init__(self) -> None:
        self.jobs: OrderedDict[str, S] = OrderedDict()

    def add(self, state: S) -> None:
        self.jobs[state.job_id] = state

    def remove(self, job_id: str) -> S:
        return self.jobs.pop(job_id)

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def outstanding(self) -> int:
        return sum(len(j.outstanding) for j in self.jobs.values())

    def _out_by_share(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for state in self.jobs.values():
            if state.outstanding:
                out[state.share] = out.get(state.share, 0) + len(state.outstanding)
        return out

    def best(self) -> S | None:
        """The job next_item would take from, among those with a pending item: an
        interactive one first, then the one with the fewest items left, then the one whose
        batch has the fewest items out (ties to the earliest job); or None."""
        out = self._out_by_share()
        best: S | None = None
        rank = (0, 0, 0)
        for state in self.jobs.values():  # insertion order: ties go to the earliest job
            mine = (not state.interactive, state.left, out.get(state.share, 0))
            if state.pending and (best is None or mine < rank):
                best, rank = state, mine
        return best

    def priority(self, state: S) -> int:
        """The engine's admission priority for an item of `state` (lower first): its
        job's items left, then its batch's items out, as `best` ranks them."""
        out = sum(len(j.outstanding) for j in self.jobs.values() if j.share == state.share)
        return state.left * SHARE_RANKS + min(out, SHARE_RANKS - 1)

    def next_item(self) -> tuple[S, int] | None:
        """Pop one pending item of the job with the fewest left, or None if nothing is."""
        best = self.best()
        return None if best is None else self._take(best)

    def _take(self, state: S) -> tuple[S, int]:
        idx = state.pending.popleft()
        state.outstanding.add(idx)
        return state, idx

    def next_item_within(self, ahead: int, window: int, small: int) -> tuple[S, int] | None:
        """next_item, when `ahead` items prepared but not yet batched leave room: fewer
        than `window`, or, for a small job (at most `small` items left), fewer than
        window + small. The engine admits by items left, so a small job's items then pass
        the big jobs' already waiting there, as if the window had had room at its arrival.
        """
        best = self.best()
        if best is not None and best.interactive:
            return self._take(best)  # never kept waiting by the window
        if best is None or ahead >= window + small:
            return None
        if ahead >= window and best.left > small:
            return None
        return self._take(best)

    def retry_item(self, job_id: str, idx: int) -> None:
        """Put an item whose preparation hit a transient error back at the head of its job."""
        state = self.jobs.get(job_id)
        if state is not None and idx in state.outstanding:
            state.outstanding.discard(idx)
            state.pending.appendleft(idx)

    def item_returned(self, job_id: str, idx: int) -> S | None:
        """An item came back from preparation or the engine; returns its job, or None when
        the result is not wanted (the job was dropped, or this item already came back)."""
        state = self.jobs.get(job_id)
        if state is None or idx not in state.outstanding:
            return None
        state.outstanding.discard(idx)
        return state

    def redo(self, job_id: str, indexes: list[int]) -> None:
        """Schedule items again whose stored results vanished (they are missing, not done)."""
        state = self.jobs.get(job_id)
        if state is not None:
            state.pending.extendleft(sorted(set(indexes) - state.outstanding, reverse=True))
