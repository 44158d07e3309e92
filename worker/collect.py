"""The main loop's results phase: every outcome of every item, handled in one place.

Engine answers (as Answered) and the events the pool threads posted are dispatched one by
one: a good answer or a text-layer answer is recorded; a failure goes to the fallback
stage, whose FellBack is recorded with or without the layer's text; a transient prep
error puts the item back in its job. Then the writer stores what it holds and ends the
jobs that are complete.

What a streamed row decoded (the engine's Streamed) goes to its job's token stream
(worker/results/tokens.py): the Deltas are written before the turn's results, and a
result's End after it.
"""

from __future__ import annotations

import time
from typing import Protocol, cast

from vlmq.worker.engine.batcher import Finished, Output, Streamed
from vlmq.worker.events import (
    Answered,
    Event,
    EventQueue,
    FellBack,
    LayerAnswered,
    PrepFailed,
    PrepRetry,
)
from vlmq.worker.item_order import ItemOrder
from vlmq.worker.jobs.running import Running
from vlmq.worker.prep.fallback import Fallback, model_failed
from vlmq.worker.results.tokens import TokenStreams
from vlmq.worker.results.writer import ResultWriter
from vlmq.worker.stats import WorkerStats


class Answers(Protocol):
    """Where the engine's answers wait (Engine)."""

    def get_output(self, timeout: float) -> list[Output]: ...


class PrepTimes(Protocol):
    """What preparation knows of an item once its answer is back (PrepStage)."""

    def item_back(self, job_id: str, idx: int) -> float: ...


class Collector:
    def __init__(self, engine: Answers, events: EventQueue, prep: PrepTimes,
                 fallback: Fallback, writer: ResultWriter, order: ItemOrder[Running], *,
                 tokens: TokenStreams | None = None, stats: WorkerStats | None = None
                 ) -> None:
        self.tokens = tokens
        self.stats = stats
        self.engine = engine
        self.events = events
        self.prep = prep
        self.fallback = fallback
        self.writer = writer
        self.order = order

    def collect(self, timeout: float) -> None:
        """Handle what came back (waiting up to `timeout` for the engine's first answer),
        write it, and finish the jobs it completed."""
        for out in self.engine.get_output(timeout=timeout):
            if isinstance(out, Streamed):
                self.streamed(out)
            else:
                self.dispatch(self.answered(out))
        for event in self.events.drain():
            self.dispatch(event)
        if self.tokens is not None:
            self.tokens.flush()  # the Deltas before the results they lead to
        self.writer.flush()
        if self.tokens is not None:
            self.tokens.flush()  # the Ends of the results just stored
        self.writer.finish_complete()

    def streamed(self, s: Streamed) -> None:
        """Text a streamed row decoded: to its job's token stream, while the job is ours."""
        job_id, idx = cast(tuple[str, int], s.key)
        state = self.order.jobs.get(job_id)
        if state is None or idx not in state.outstanding or self.tokens is None:
            return
        if self.tokens.delta(state, s.text) and self.stats is not None:
            self.stats.first_token(job_id, time.monotonic() - state.started)

    def answered(self, f: Finished) -> Answered:
        job_id, idx = cast(tuple[str, int], f.key)
        return Answered(job_id, idx, f, self.prep.item_back(job_id, idx))

    def dispatch(self, event: Event) -> None:
        """The one place an item's outcome is acted on."""
        match event:
            case Answered(job_id=job_id, idx=idx, finished=f) if not model_failed(f):
                self.fallback.forget(job_id, idx)
                self.writer.record_finished(job_id, idx, f, event.prep_s)
            case Answered() | PrepFailed():
                self.fallback.route(event)
            case FellBack(failure=Answered() as a, layer=layer):
                self.writer.record_finished(a.job_id, a.idx, a.finished, a.prep_s, layer=layer)
            case FellBack(failure=PrepFailed() as p, layer=layer):
                self.writer.record_failure(p.job_id, p.idx, p.message, layer=layer)
            case LayerAnswered(job_id=job_id, idx=idx, text=text, prep_s=prep_s):
                self.writer.record_layer(job_id, idx, text, prep_s)
            case PrepRetry(job_id=job_id, idx=idx):
                self.order.retry_item(job_id, idx)
            case _:  # a new kind of event needs its case here
                raise TypeError(f"not a worker event: {event!r}")
