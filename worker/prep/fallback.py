"""The text-layer fallback: a PDF page the model (or its preparation) failed may still be
answered by the page's own text layer, when its job asks for that.

A stage beside the Preparer: the main loop hands it each failure, and it posts a FellBack
event for it, at once when there is nothing to read (the job does not ask, the page is
not a PDF page of an OCR job, or the prefer check read the layer already), else once a
pool thread has read the layer, which may wait on a render process.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from functools import partial
from typing import Protocol

from vlmq.shared.messages import Item
from vlmq.worker.engine.batcher import Finished
from vlmq.worker.events import EventQueue, Failure, FellBack, Stage
from vlmq.worker.item_order import JobState

log = logging.getLogger("vlmq.worker")

# Ends of a model run that leave a page unread: a text layer may stand in.
MODEL_FAILED = ("length", "repetition", "error")


class Layers(Protocol):
    """Where a page's text layer comes from (the worker's Preparer)."""

    def known_layer(self, job_id: str, idx: int) -> tuple[bool, str | None]: ...

    def fallback_text(self, item: Item) -> str | None: ...


def model_failed(f: Finished) -> bool:
    return f.error is not None or f.finish_reason in MODEL_FAILED


class Fallback:
    """Decides, per failed item, whether its text layer is read, and reads it on `pool`."""

    def __init__(self, layers: Layers, pool: Executor, jobs: Mapping[str, JobState],
                 events: EventQueue) -> None:
        self.layers = layers
        self.pool = pool
        self.jobs = jobs  # the order's jobs in flight
        self.events = events

    def forget(self, job_id: str, idx: int) -> None:
        """The model answered the item: what the prefer check read of its layer goes."""
        self.layers.known_layer(job_id, idx)

    def route(self, failure: Failure) -> None:
        """Post FellBack for `failure`: now, or once its page's layer has been read."""
        # Asked first, whatever the item: what the prefer check read is forgotten once asked.
        known, text = self.layers.known_layer(failure.job_id, failure.idx)
        item = self._page(failure)
        if item is None or known:
            self.events.post(FellBack(failure, text if item is not None else None))
            return
        self.events.flight.enter(Stage.FALLBACK)  # keeps a stop waiting until it is back
        try:
            fut = self.pool.submit(self.layers.fallback_text, item)
        except RuntimeError:  # the pool is shutting down: record the failure as it is
            self.events.post(FellBack(failure, None), leaving=Stage.FALLBACK)
            return
        fut.add_done_callback(partial(self._read, failure))

    def _page(self, failure: Failure) -> Item | None:
        """The item when its text layer may answer it: a PDF page of an OCR job whose
        text_layer is not off (a page's text is an OCR answer, not a caption or an
        extraction); None otherwise, or when its job is gone."""
        state = self.jobs.get(failure.job_id)
        if state is None or state.payload.task != "ocr" or state.resolved.text_layer == "off":
            return None
        item = state.payload.items[failure.idx]
        return item if item.kind == "pdf" else None

    def _read(self, failure: Failure, fut: Future[str | None]) -> None:
        """Pool callback: the layer's text, or None (the item keeps its failure alone)."""
        layer = None
        if not fut.cancelled():
            exc = fut.exception()
            if exc is None:
                layer = fut.result()
            else:  # a bug: the item keeps the model's failure alone
                log.error("text layer fallback failed", exc_info=exc)
        self.events.post(FellBack(failure, layer), leaving=Stage.FALLBACK)
