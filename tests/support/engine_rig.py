"""One tiny model loaded in a real engine, and the extract requests it is given: the
constrained-decoding tests (structured, containment, batch size) share it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.support.factories import random_image
from vlmq.worker.engine.batcher import Engine, Finished, Request
from vlmq.worker.engine.constraints import Structured
from vlmq.worker.item_order import SHARE_RANKS
from vlmq.worker.model import mlx_adapter

PROMPT = "Extract the fields of this document as JSON."
MAX_TOKENS = 220


def run(engine: Engine, reqs: list[Request], timeout: float) -> dict[object, Finished]:
    """Submits every request and collects each one's Finished, by key."""
    for r in reqs:
        engine.submit(r)
    got: dict[object, Finished] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(reqs) and time.monotonic() < deadline:
        for f in engine.get_finished(timeout=0.2):
            got[f.key] = f
    assert len(got) == len(reqs), f"{len(got)}/{len(reqs)} came back"
    return got


class Rig:
    """One model loaded in an engine at `max_batch`, and what builds its requests."""

    def __init__(self, model: Path, max_batch: int) -> None:
        from mlx_vlm import load

        self.engine = Engine(str(model), max_batch=max_batch)
        self.engine.wait_ready(timeout=120)
        self.model, self.processor = load(str(model))
        self.structured = Structured(self.processor.tokenizer,
                                     mlx_adapter.eos_token_ids(self.processor))

    def request(self, key: object, seed: int, schema: dict[str, Any] | None,
                max_tokens: int = MAX_TOKENS, size: tuple[int, int] = (112, 112)) -> Request:
        prep = mlx_adapter.prepare(self.processor, self.model.config, random_image(seed, size),
                                   PROMPT)
        return Request(key=key, prepared=prep, cached_features=None, max_tokens=max_tokens,
                       temperature=0.0, stop=(),
                       constraint=None if schema is None else self.structured.row(schema))

    def big_job(self, items: int, max_tokens: int) -> list[Request]:
        """The rows of one job of `items` items, ranked as the worker ranks such a job
        (worker/item_order.py): what small and interactive rows must pass."""
        rows = []
        for i in range(items):
            r = self.request(("big", i), 100 + i, None, max_tokens=max_tokens)
            r.priority, r.job_left = items * SHARE_RANKS, items
            rows.append(r)
        return rows

    def run(self, reqs: list[Request], timeout: float = 120) -> dict[object, Finished]:
        return run(self.engine, reqs, timeout)

    def close(self) -> None:
        self.engine.close(timeout=10)
