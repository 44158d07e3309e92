"""Feeding the Preparer: which items go to the CPU pool now, and where each one goes next.

Items are prepared while fewer than the prep window are prepared-but-not-batched (a small
job may go the batch limit past it: ItemOrder.next_item_within). A prepared request goes to the
engine from the pool thread itself, so MLX never waits on the main loop; every other
outcome (answered by a text layer, failed, to retry) is an event for the main loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from functools import partial

from redis.exceptions import RedisError

from vlmq.shared.connection import transient
from vlmq.shared.logs import job_fields
from vlmq.worker.engine.batcher import Engine, EngineError
from vlmq.worker.events import EventQueue, LayerAnswered, PrepFailed, PrepRetry, Stage
from vlmq.worker.item_order import ItemOrder
from vlmq.worker.jobs.running import Running
from vlmq.worker.prep.preparer import FromLayer, Prepared, Preparer, PrepError

log = logging.getLogger("vlmq.worker")


class PrepStage:
    """The window over the Preparer's pool, and the pool's hand-off of what it prepared."""

    def __init__(self, preparer: Preparer, engine: Engine, order: ItemOrder[Running],
                 events: EventQueue, *, window: Callable[[int], int]) -> None:
        """`window`: the prep window for a batch limit (it follows the limit the engine
        measures); a job with no more items left than the limit may pass it."""
        self.preparer = preparer
        self.engine = engine
        self.order = order
        self.events = events
        self.window = window
        self._prep_s: dict[tuple[str, int], float] = {}  # item -> its preparation time

    def fill(self) -> int:
        """Submit items while the window has room; returns how many are then ahead of the
        batch (prepared or being prepared, not yet taken into it)."""
        flight, engine = self.events.flight, self.engine.state
        limit = engine.batch_limit
        while (nxt := self.order.next_item_within(flight.ahead(engine), self.window(limit),
                                                      limit)) is not None:
            state, idx = nxt
            flight.enter(Stage.PREP)
            fut = self.preparer.submit(state, idx)
            rank = self.order.priority(state)  # the engine's admission order
            fut.add_done_callback(partial(self._prepared, state.job_id, idx, rank,
                                          state.left))
        return flight.ahead(engine)

    def item_back(self, job_id: str, idx: int) -> float:
        """The engine answered the item: the vision-cache flight it owned ends, and this is
        how long its preparation took."""
        self.preparer.item_done(job_id, idx)
        return self._prep_s.pop((job_id, idx), 0.0)

    def _prepared(self, job_id: str, idx: int, rank: int, left: int,
                  fut: Future[tuple[Prepared, float]]) -> None:
        """Pool callback: a request to the engine at once, anything else to the main loop."""
        if fut.cancelled():  # shutting down: the item stays unwritten and is redone on resume
            self.events.flight.leave(Stage.PREP)
            return
        exc = fut.exception()
        if exc is not None:
            self.events.post(_failed(job_id, idx, exc), leaving=Stage.PREP)
            return
        req, prep_s = fut.result()
        if isinstance(req, FromLayer):
            self.events.post(LayerAnswered(job_id, idx, req.text, prep_s), leaving=Stage.PREP)
            return
        self._prep_s[(job_id, idx)] = prep_s
        try:
            self.events.flight.hand_over(partial(self.engine.submit,
                                                 replace(req, priority=rank,
                                                         job_left=left)))
        except EngineError:
            log.debug("engine closed before job %s item %d was submitted", job_id, idx,
                      extra=job_fields(job_id, idx))


def _failed(job_id: str, idx: int, exc: BaseException) -> PrepFailed | PrepRetry:
    """What a preparation's exception means for its item."""
    if isinstance(exc, RedisError) and transient(exc):
        return PrepRetry(job_id, idx)  # not the item's fault: prepare it again
    if isinstance(exc, PrepError):
        return PrepFailed(job_id, idx, str(exc))
    # A bug, not bad input: keep the traceback, fail only this item.
    log.error("job %s item %d: preparation failed", job_id, idx, exc_info=exc,
              extra=job_fields(job_id, idx))
    return PrepFailed(job_id, idx, f"{type(exc).__name__}: {exc}")
