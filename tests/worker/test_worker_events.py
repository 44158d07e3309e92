"""The main loop's event queue, its Flight counter, the one dispatch and the text-layer
fallback stage (worker/events.py, collect.py, fallback.py): what pool threads learn of an
item reaches the writer and lands in real Redis; failed PDF pages read real text layers."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fpdf
import pytest
from PIL import Image
from redis import Redis

from tests.support.factories import SHA  # no blob is read: the items' outcomes are given
from vlmq.shared import results
from vlmq.shared.enqueue import enqueue, fetch_job
from vlmq.shared.keys import Keys
from vlmq.shared.messages import TEXT_FROM_LAYER, TEXT_FROM_MODEL, Item, JobPayload
from vlmq.worker.collect import Collector
from vlmq.worker.engine.batcher import EngineState, Finished, Output
from vlmq.worker.events import (
    Answered,
    EventQueue,
    Flight,
    LayerAnswered,
    PrepFailed,
    PrepRetry,
    Stage,
)
from vlmq.worker.item_order import ItemOrder
from vlmq.worker.job_settings import resolve_job
from vlmq.worker.jobs.rq_jobs import BatchWorker, JobLifecycle, Running
from vlmq.worker.prep import decode
from vlmq.worker.prep.fallback import Fallback, Layers
from vlmq.worker.results.writer import ResultWriter
from vlmq.worker.stats import WorkerStats

WAIT_S = 30.0


def finished(job_id: str, idx: int, text: str = "ok", reason: str = "stop") -> Finished:
    return Finished(key=(job_id, idx), text=text, finish_reason=reason, prompt_tokens=5,
                    completion_tokens=2, vision_cache_hit=False, error=None, timings={})


# --- Flight --------------------------------------------------------------------------------


def test_flight_counts_each_stage_and_refuses_to_go_below_zero() -> None:
    flight, engine = Flight(), EngineState()
    flight.enter(Stage.PREP)
    flight.enter(Stage.PREP)
    flight.enter(Stage.FALLBACK)
    engine.move(active=1)
    assert flight.preparing == 2
    assert flight.ahead(engine) == 2  # fallback reads and active rows are not ahead
    assert flight.total(engine) == 4
    flight.leave(Stage.FALLBACK)
    with pytest.raises(RuntimeError, match="more items left fallback"):
        flight.leave(Stage.FALLBACK)
    assert flight.total(engine) == 3


def test_hand_over_moves_an_item_to_the_engine_in_one_step_even_when_it_fails() -> None:
    flight, engine = Flight(), EngineState()
    flight.enter(Stage.PREP)
    flight.hand_over(lambda: engine.move(waiting=1))
    assert (flight.preparing, flight.ahead(engine), flight.total(engine)) == (0, 1, 1)

    def closed() -> None:
        raise RuntimeError("engine is closed")

    flight.enter(Stage.PREP)
    with pytest.raises(RuntimeError, match="closed"):
        flight.hand_over(closed)
    assert flight.preparing == 0  # counted out once, not left in flight for good


def test_a_stopping_loop_that_sees_nothing_in_flight_finds_every_event_queued() -> None:
    """The invariant the stop relies on: the count drops only after the put."""
    events, engine = EventQueue(), EngineState()
    n = 200
    for _ in range(n):
        events.flight.enter(Stage.PREP)
    start = threading.Event()

    def post(i: int) -> None:
        start.wait()
        events.post(PrepFailed("j", i, "bad page"), leaving=Stage.PREP)

    seen: list[int] = []
    with ThreadPoolExecutor(8) as pool:
        for i in range(n):
            pool.submit(post, i)
        start.set()
        while True:
            idle = events.flight.total(engine) == 0
            seen += [e.idx for e in events.drain() if isinstance(e, PrepFailed)]
            if idle:
                break
    assert sorted(seen) == list(range(n))


def test_drain_also_yields_what_is_posted_while_draining() -> None:
    events = EventQueue()
    events.post(PrepRetry("j", 0))
    out = []
    for event in events.drain():
        out.append(event)
        if len(out) == 1:
            events.post(PrepRetry("j", 1))
    assert out == [PrepRetry("j", 0), PrepRetry("j", 1)]


# --- dispatch, through real Redis ----------------------------------------------------------


class Outbox:
    """The engine's side as the collector reads it: answers handed in by the test."""

    def __init__(self) -> None:
        self.answers: list[Finished] = []

    def get_output(self, timeout: float) -> list[Output]:
        out: list[Output] = list(self.answers)
        self.answers = []
        return out


class PrepTimes:
    def __init__(self) -> None:
        self.back: list[tuple[str, int]] = []

    def item_back(self, job_id: str, idx: int) -> float:
        self.back.append((job_id, idx))
        return 0.25


class NoLayers:
    """Text layers for jobs that read none (image items): asking for one is a bug here."""

    def known_layer(self, job_id: str, idx: int) -> tuple[bool, str | None]:
        return False, None

    def fallback_text(self, item: Item) -> str | None:
        raise AssertionError(f"no text layer should be read for {item.source}")


class Rig:
    """One worker's lifecycle, order, writer and collector over real Redis."""

    def __init__(self, redis: Redis, layers: Layers) -> None:
        self.redis = redis
        self.keys = Keys(f"t{uuid.uuid4().hex[:8]}")
        worker = BatchWorker(["ocr"], connection=redis, name=f"w-{uuid.uuid4().hex[:6]}")
        self.life = JobLifecycle(worker, keys=self.keys)
        self.life.register_birth()
        self.order: ItemOrder[Running] = ItemOrder()
        self.writer = ResultWriter(redis, self.keys, self.life, self.order,
                                   WorkerStats(worker.name, 4, 8))
        self.events = EventQueue()
        self.outbox = Outbox()
        self.prep = PrepTimes()
        self.pool = ThreadPoolExecutor(2)
        self.fallback = Fallback(layers, self.pool, self.order.jobs, self.events)
        self.collector = Collector(self.outbox, self.events, self.prep, self.fallback,
                                   self.writer, self.order)

    def start(self, n: int, task: str = "ocr", kind: str = "image",
              settings: dict[str, Any] | None = None) -> Running:
        """A job of `n` items taken, with every item handed out (as the prep stage does)."""
        items = tuple(Item(kind, SHA, f"doc-{i}.{kind}", page=i + 1 if kind == "pdf" else None)
                      for i in range(n))
        payload = JobPayload(task=task, items=items, settings=settings or {})
        enqueue(self.redis, payload, queue="ocr", keys=self.keys)
        running = self.life.take()
        assert isinstance(running, Running), running
        running.settings = resolve_job(running.payload, "qwen2_vl", None)
        running.pending.extend(range(n))
        self.order.add(running)
        for _ in range(n):
            assert self.order.next_item() is not None
        return running

    def close(self) -> None:
        self.pool.shutdown()
        self.life.register_death()


@pytest.fixture
def rig(redis: Redis) -> Iterator[Rig]:
    r = Rig(redis, NoLayers())
    yield r
    r.close()


def test_each_kind_of_outcome_reaches_redis_through_one_dispatch(redis: Redis,
                                                                 rig: Rig) -> None:
    running = rig.start(4)
    job_id = running.job_id
    rig.outbox.answers = [finished(job_id, 0, "a caption"),
                          finished(job_id, 1, "half a", reason="length")]
    rig.events.post(LayerAnswered(job_id, 2, "the page's own text", 0.5))
    rig.events.post(PrepFailed(job_id, 3, "cannot decode image: truncated"))
    rig.collector.collect(timeout=0)

    assert rig.prep.back == [(job_id, 0), (job_id, 1)]  # engine answers only
    stored = {r.index: r for r in results.read_items(redis, rig.keys, job_id)}
    assert stored[0].text == "a caption" and stored[0].ok
    assert stored[0].timings["preprocess_s"] == 0.25
    # An image has no text layer: the model's cut-off answer is recorded as it is.
    assert (stored[1].text, stored[1].finish_reason, stored[1].text_source) == (
        "half a", "length", TEXT_FROM_MODEL)
    assert stored[2].text == "the page's own text" and stored[2].text_source == TEXT_FROM_LAYER
    assert stored[3].error == "cannot decode image: truncated" and stored[3].text is None
    assert fetch_job(redis, job_id).get_status() == "finished"
    assert job_id not in rig.order.jobs


def test_a_retry_puts_the_item_back_first_in_its_job(rig: Rig) -> None:
    running = rig.start(3)
    rig.collector.dispatch(PrepRetry(running.job_id, 1))
    assert list(running.pending) == [1] and running.outstanding == {0, 2}
    assert rig.order.next_item() == (running, 1)


def test_outcomes_of_a_job_no_longer_here_write_nothing(redis: Redis, rig: Rig) -> None:
    running = rig.start(2)
    rig.writer.drop(running, "canceled")
    rig.collector.dispatch(Answered(running.job_id, 0, finished(running.job_id, 0), 0.1))
    rig.collector.dispatch(PrepFailed(running.job_id, 1, "bad"))
    rig.collector.collect(timeout=0)
    assert rig.writer.holding == 0
    assert results.read_items(redis, rig.keys, running.job_id) == []


def test_something_that_is_not_an_event_is_refused(rig: Rig) -> None:
    with pytest.raises(TypeError, match="not a worker event"):
        rig.collector.dispatch("item 3 done")  # type: ignore[arg-type]


# --- the fallback stage, on real text layers ------------------------------------------------

PAGE_TEXT = "Quarterly report {n}. Revenue rose while costs fell; the board approved the budget."


def digital_and_scanned(path: Path, kinds: str) -> bytes:
    """One page per letter: d = born digital (a real text layer), s = a scan (an image, no
    text)."""
    pdf = fpdf.FPDF(unit="mm")
    for n, kind in enumerate(kinds, start=1):
        pdf.add_page(format=(210, 297))
        if kind == "s":
            pdf.image(Image.new("L", (420, 594), 200), x=0, y=0, w=210, h=297)
        else:
            pdf.set_font("helvetica", size=12)
            pdf.multi_cell(180, 6, PAGE_TEXT.format(n=n))
    pdf.output(str(path))
    return path.read_bytes()


class PdfLayers:
    """Text layers of one real PDF, read as the Preparer reads them (in this process);
    reads wait for `gate`, so a test sees them in flight."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.known: dict[tuple[str, int], str | None] = {}  # what a prefer check read
        self.reads: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def known_layer(self, job_id: str, idx: int) -> tuple[bool, str | None]:
        if (job_id, idx) in self.known:
            return True, self.known.pop((job_id, idx))
        return False, None

    def fallback_text(self, item: Item) -> str | None:
        assert item.page is not None and self.gate.wait(WAIT_S)
        self.reads.append(item.page)
        layer = decode.pdf_text_layer(self.data, item.page)
        return layer.text if layer.usable("fallback") else None


@pytest.fixture
def pdf_rig(redis: Redis, tmp_path: Path) -> Iterator[tuple[Rig, PdfLayers]]:
    layers = PdfLayers(digital_and_scanned(tmp_path / "mixed.pdf", "dsdd"))
    r = Rig(redis, layers)
    yield r, layers
    layers.gate.set()
    r.close()


def settle(rig: Rig) -> None:
    """Collect until nothing is out on the pool any more."""
    engine = EngineState()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        idle = rig.events.flight.total(engine) == 0
        rig.collector.collect(timeout=0)
        if idle:
            return
        time.sleep(0.01)
    raise AssertionError("fallback reads still in flight")


def words(text: str | None) -> str:
    return " ".join((text or "").split())


def test_failed_pages_fall_back_to_their_layer_read_on_the_pool(
        redis: Redis, pdf_rig: tuple[Rig, PdfLayers]) -> None:
    rig, layers = pdf_rig
    running = rig.start(4, kind="pdf")
    job_id = running.job_id
    layers.gate.clear()
    rig.outbox.answers = [
        finished(job_id, 0, "Quarterly rep", reason="length"),  # cut at max_tokens
        Finished(key=(job_id, 1), text="", finish_reason="error", prompt_tokens=0,
                 completion_tokens=0, vision_cache_hit=False, error="vision tower failed",
                 timings={}),
        finished(job_id, 3, "the model's own reading"),
    ]
    rig.events.post(PrepFailed(job_id, 2, "page render ran out of memory"))
    rig.collector.collect(timeout=0)

    # Three reads out on the pool: a stopping worker waits for them, the job is not done.
    assert rig.events.flight.total(EngineState()) == 3
    assert results.read_items(redis, rig.keys, job_id)[0].index == 3
    assert fetch_job(redis, job_id).get_status() == "started"
    layers.gate.set()
    settle(rig)

    assert sorted(layers.reads) == [1, 2, 3]  # the answered page was never read
    stored = {r.index: r for r in results.read_items(redis, rig.keys, job_id)}
    cut = stored[0]
    assert words(cut.text) == PAGE_TEXT.format(n=1) and cut.ok
    assert (cut.text_source, cut.finish_reason, cut.model_text) == (
        TEXT_FROM_LAYER, "length", "Quarterly rep")
    scan = stored[1]  # no text layer: the model's failure stands
    assert scan.error == "vision tower failed" and scan.text is None
    rendered = stored[2]
    assert words(rendered.text) == PAGE_TEXT.format(n=3)
    assert (rendered.text_source, rendered.model_error) == (
        TEXT_FROM_LAYER, "page render ran out of memory")
    assert stored[3].text == "the model's own reading" and stored[3].text_source == "model"
    assert fetch_job(redis, job_id).get_status() == "finished"


@pytest.mark.parametrize(("task", "settings"), [("ocr", {"text_layer": "off"}),
                                                ("caption", {})])
def test_no_layer_is_read_for_a_job_that_does_not_take_one(
        redis: Redis, pdf_rig: tuple[Rig, PdfLayers], task: str,
        settings: dict[str, Any]) -> None:
    rig, layers = pdf_rig
    running = rig.start(1, task=task, kind="pdf", settings=settings)
    rig.collector.dispatch(PrepFailed(running.job_id, 0, "render failed"))
    assert rig.events.flight.total(EngineState()) == 0  # decided at once, nothing out
    rig.collector.collect(timeout=0)
    assert layers.reads == []
    [stored] = results.read_items(redis, rig.keys, running.job_id)
    assert stored.error == "render failed" and stored.text_source == "model"


def test_a_layer_the_prefer_check_read_is_used_without_a_second_read(
        redis: Redis, pdf_rig: tuple[Rig, PdfLayers]) -> None:
    rig, layers = pdf_rig
    running = rig.start(2, kind="pdf", settings={"text_layer": "prefer"})
    layers.known[(running.job_id, 0)] = "read by the prefer check"
    layers.known[(running.job_id, 1)] = "not needed: the model answered"
    rig.outbox.answers = [finished(running.job_id, 0, "", reason="repetition"),
                          finished(running.job_id, 1, "fine")]
    rig.collector.collect(timeout=0)
    assert layers.reads == [] and layers.known == {}  # both forgotten once asked
    stored = {r.index: r for r in results.read_items(redis, rig.keys, running.job_id)}
    assert stored[0].text == "read by the prefer check"
    assert stored[0].text_source == TEXT_FROM_LAYER
    assert stored[1].text == "fine"


def test_a_pool_shut_down_records_the_failure_as_it_is(
        redis: Redis, pdf_rig: tuple[Rig, PdfLayers]) -> None:
    rig, layers = pdf_rig
    running = rig.start(1, kind="pdf")
    rig.pool.shutdown()
    rig.collector.dispatch(PrepFailed(running.job_id, 0, "render failed"))
    assert rig.events.flight.total(EngineState()) == 0
    rig.collector.collect(timeout=0)
    assert layers.reads == []
    [stored] = results.read_items(redis, rig.keys, running.job_id)
    assert stored.error == "render failed"
