"""What the prep and fallback threads hand the worker's main loop, and how much is out.

Pool threads never touch the scheduler or the result writer: what they learn about an
item becomes one of the events below, put on one EventQueue that only the main thread
drains (worker/collect.py dispatches them). The engine's answers become Answered events
there too, so every kind of outcome is handled in one place.

Flight counts the items out on pool threads, so a stopping worker waits on one number.
"""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from vlmq.worker.engine.batcher import EngineState, Finished


@dataclass(frozen=True)
class Answered:
    """The engine's answer for an item (made by the main loop from the engine's outbox)."""

    job_id: str
    idx: int
    finished: Finished
    prep_s: float


@dataclass(frozen=True)
class PrepFailed:
    """The item cannot be prepared (bad input, or a bug, already logged): it fails alone."""

    job_id: str
    idx: int
    message: str


@dataclass(frozen=True)
class PrepRetry:
    """Preparation hit a transient Redis error, not the item's fault: prepare it again."""

    job_id: str
    idx: int


@dataclass(frozen=True)
class LayerAnswered:
    """A PDF page answered by its text layer (text_layer prefer): no model run."""

    job_id: str
    idx: int
    text: str
    prep_s: float


# What the model or the preparation failed: a text layer may stand in (worker/prep/fallback.py).
Failure = Answered | PrepFailed


@dataclass(frozen=True)
class FellBack:
    """A failure to record, with its page's text layer when that answers it, else None."""

    failure: Failure
    layer: str | None


Event = Answered | PrepFailed | PrepRetry | LayerAnswered | FellBack


class Stage(enum.Enum):
    PREP = "prep"          # in the Preparer's pool (the prep window counts these)
    FALLBACK = "fallback"  # a failed page's text layer being read (outside the window)


class Flight:
    """Items out on pool threads whose outcome the main loop cannot see yet, by stage.

    Invariant: an item counts from its submission until its outcome is on the EventQueue
    or counted by the engine (EngineState.waiting), and the count drops only after that
    (an instant of both is fine; neither, never). So `total` is zero only once nothing
    more can come back but what the queues already hold.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._out = dict.fromkeys(Stage, 0)

    def enter(self, stage: Stage) -> None:
        with self._lock:
            self._out[stage] += 1

    def leave(self, stage: Stage) -> None:
        with self._lock:
            if self._out[stage] <= 0:
                raise RuntimeError(f"Flight: more items left {stage.value} than entered it")
            self._out[stage] -= 1

    def hand_over(self, submit: Callable[[], None]) -> None:
        """A prepared item goes from here to the engine in one step for readers: `submit`
        (Engine.submit, which counts it waiting) runs under this lock, and the item leaves
        PREP even when the submit raises (the engine closed)."""
        with self._lock:
            try:
                submit()
            finally:
                self._out[Stage.PREP] -= 1

    @property
    def preparing(self) -> int:
        return self._out[Stage.PREP]

    def ahead(self, engine: EngineState) -> int:
        """Items prepared or being prepared that the batch has not taken yet."""
        with self._lock, engine.lock:
            return self._out[Stage.PREP] + engine.waiting

    def total(self, engine: EngineState) -> int:
        """Everything still to come back from the pool threads or the engine."""
        with self._lock, engine.lock:
            return sum(self._out.values()) + engine.waiting + engine.active


class EventQueue:
    """The one queue from worker threads to the main loop, and their Flight.

    A queue.Queue, not a SimpleQueue: on CPython 3.11 a signal landing in
    SimpleQueue.get(timeout=...) can block that call for good (see EngineState.outbox).
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[Event] = queue.Queue()
        self.flight = Flight()

    def post(self, event: Event, *, leaving: Stage | None = None) -> None:
        """Put `event` for the main loop; with `leaving`, the item it is about then leaves
        that stage, after the put, as Flight's invariant asks."""
        try:
            self._queue.put(event)
        finally:
            if leaving is not None:
                self.flight.leave(leaving)

    def drain(self) -> Iterator[Event]:
        """Every event posted so far, and any posted while the caller handles them (a
        fallback decided at once), without waiting."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return
