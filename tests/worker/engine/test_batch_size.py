"""The batch's row limit follows measured throughput (worker/engine/batch_size.py), on a fake clock:
it grows while tokens/s rises, holds at the knee, never passes the cap, and measures again
when the work changes. Then the real engine: a small job still gets in at the knee."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.support.engine_rig import Rig
from tests.support.helpers import Clock
from vlmq.worker.engine.batch_size import SHORT_HOLD_S, BatchSizer, Shape
from vlmq.worker.engine.batcher import Engine, Request, bulk_shape

OCR = Shape(prompt=9, new_tokens=8, constrained=False)
CAPTION = Shape(prompt=8, new_tokens=5, constrained=False)


def _run(sizer: BatchSizer, clock: Clock, tok_s: Callable[[int], float], seconds: float,
         shape: Shape = OCR, rows: Callable[[int], int] | None = None,
         waiting: int = 10_000) -> list[int]:
    """Steps of a batch kept full (or at `rows(limit)`) for `seconds` of fake time, with
    `waiting` rows behind it: each row makes one token a step, at the batch's tokens/s
    for that many rows. Returns the limits it went through."""
    seen = [sizer.limit]
    end = clock.t + seconds
    while clock.t < end:
        n = rows(sizer.limit) if rows is not None else sizer.limit
        step_s = n / tok_s(n)
        clock.t += step_s
        if sizer.observe(n, n, step_s, shape, waiting=waiting):
            seen.append(sizer.limit)
    return seen


def _sizer(clock: Clock, cap: int = 64, **kw: float) -> BatchSizer:
    """A sizer reading one-second windows: the spans below are in units of it."""
    kw.setdefault("window_s", 1.0)
    return BatchSizer(cap, floor=8, clock=clock, **kw)


def test_rising_throughput_grows_the_batch_to_the_cap_and_holds() -> None:
    clock = Clock()
    sizer = _sizer(clock)
    assert _run(sizer, clock, lambda n: 40.0 * n, 60) == [8, 16, 32, 64]
    assert sizer.limit == 64 and "cap" in sizer.reason and sizer.held_until is not None


def test_throughput_flat_within_the_noise_keeps_doubling() -> None:
    """Readings swing by 10 % between windows while whole runs gain at bigger batches: a
    doubling that reads about the same is kept and doubled again, up to the cap."""
    clock = Clock()
    sizer = _sizer(clock)
    flat = {8: 300.0, 16: 280.0, 32: 310.0, 64: 270.0}  # within 15 % of the best
    assert _run(sizer, clock, flat.__getitem__, 60) == [8, 16, 32, 64]
    assert sizer.limit == 64 and "cap" in sizer.reason
    assert sizer.held_until is not None


def test_a_slow_drift_down_stops_at_the_best() -> None:
    clock = Clock()
    sizer = _sizer(clock)
    drift = {8: 300.0, 16: 270.0, 32: 250.0, 64: 230.0}  # each under 15 % of the one before
    assert _run(sizer, clock, drift.__getitem__, 60) == [8, 16, 32, 8]
    assert sizer.limit == 8 and "knee" in sizer.reason


def test_falling_throughput_goes_back_and_never_below_the_floor() -> None:
    clock = Clock()
    sizer = _sizer(clock)
    _run(sizer, clock, lambda n: 600.0 / n, 60)
    assert sizer.limit == 8
    assert min(sizer.readings) == 8  # nothing under the floor was ever tried


def test_the_knee_is_the_last_doubling_that_paid() -> None:
    clock = Clock()
    sizer = _sizer(clock)
    # +60 % to 16, +25 % to 32, -20 % at 64: the knee is 32.
    table = {8: 300.0, 16: 480.0, 32: 600.0, 64: 480.0}
    assert _run(sizer, clock, table.__getitem__, 60) == [8, 16, 32, 64, 32]
    assert sizer.limit == 32
    assert abs(sizer.readings[16] - 480.0) < 1e-6


def test_the_cap_bounds_every_try() -> None:
    clock = Clock()
    sizer = _sizer(clock, cap=20)
    assert _run(sizer, clock, lambda n: 40.0 * n, 60) == [8, 16, 20]
    fixed = _sizer(clock, cap=4)
    assert _run(fixed, clock, lambda n: 40.0 * n, 60) == [4]
    assert "fixed" in fixed.reason


def test_a_batch_the_work_cannot_fill_says_nothing() -> None:
    clock = Clock()
    sizer = _sizer(clock)
    assert _run(sizer, clock, lambda n: 40.0 * n, 60, rows=lambda limit: limit - 3,
                waiting=0) == [8]
    assert sizer.readings == {}


def test_turns_short_of_full_count_while_rows_wait_for_them() -> None:
    """Rows that end together leave the batch short while their places refill: the rate
    the limit really gives includes those turns."""
    clock = Clock()
    sizer = _sizer(clock)
    assert _run(sizer, clock, lambda n: 40.0 * n, 60, rows=lambda limit: limit - 3) == [
        8, 16, 32, 64]


def test_the_knee_is_measured_again_after_the_hold_and_when_the_work_changes() -> None:
    clock = Clock()
    sizer = _sizer(clock, hold_s=30)
    table = {8: 300.0, 16: 480.0, 32: 380.0}
    _run(sizer, clock, table.__getitem__, 20)
    assert sizer.limit == 16
    # After the hold the work pays more at 32 (say, a longer prompt mix): found again.
    better = {8: 300.0, 16: 480.0, 32: 700.0, 64: 500.0}
    _run(sizer, clock, better.__getitem__, 60)
    assert sizer.limit == 32
    # Caption-shaped work, settled for a few windows: measured from the floor again.
    seen = _run(sizer, clock, lambda n: 300.0, 40, shape=CAPTION)
    assert seen[:2] == [32, 8] and sizer.limit == 64 and "cap" in sizer.reason


def test_a_shape_that_flickers_changes_nothing() -> None:
    """Rows of mixed jobs come and go: a shape lasting under the settle time is noise."""
    clock = Clock()
    sizer = _sizer(clock, hold_s=1000)
    table = {8: 300.0, 16: 480.0, 32: 380.0}
    _run(sizer, clock, table.__getitem__, 20)
    assert sizer.limit == 16
    for _ in range(5):
        _run(sizer, clock, table.__getitem__, 0.5, shape=CAPTION)
        _run(sizer, clock, table.__getitem__, 0.5, shape=OCR)
    assert sizer.limit == 16 and 32 in sizer.readings  # no restart


def test_a_small_job_gets_a_row_while_the_batch_sits_at_its_knee(tiny_model: Path) -> None:
    """The batch at its limit with a big job's rows queued behind it: a one-item job's row
    (priority 1) is admitted at the next free row, ahead of every queued big-job row."""
    rig = Rig(tiny_model, 4)
    rig.engine.close(timeout=10)
    rig.engine = Engine(str(tiny_model), max_batch=4, auto_batch=True)
    rig.engine.wait_ready(timeout=60)
    try:
        assert rig.engine.stats()["batch_limit"] == 4  # the cap under the floor: the knee
        big = [rig.request(("big", k), 40 + k, None, max_tokens=24) for k in range(12)]
        for k, req in enumerate(big):
            req.priority = 12 - k
            rig.engine.submit(req)
        deadline = time.monotonic() + 60
        while rig.engine.state.active < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        queued = rig.engine.state.waiting
        small = rig.request(("small", 0), 99, None, max_tokens=8)
        small.priority = 1
        rig.engine.submit(small)
        order: list[object] = []
        deadline = time.monotonic() + 120
        while len(order) < 13 and time.monotonic() < deadline:
            order += [f.key for f in rig.engine.get_finished(timeout=0.2)]
    finally:
        rig.close()
    assert queued >= 6, queued  # the big job's rows really were waiting
    assert order.index(("small", 0)) <= 8, order  # it took the next free row, not the last
    assert rig.engine.stats()["peak_active"] == 4


def test_a_doubling_the_work_in_hand_cannot_fill_waits_for_more_work() -> None:
    """32 rows in the batch and 24 waiting cannot fill 64: the batch holds at 32 instead
    of taking every waiting row past its knee, and tries 64 once a backlog is there."""
    clock = Clock()
    sizer = _sizer(clock)
    seen = _run(sizer, clock, lambda n: 40.0 * n, 20, rows=lambda limit: min(limit, 32),
                waiting=24)
    assert seen == [8, 16, 32] and sizer.limit == 32, seen
    assert "cannot fill 64" in sizer.reason and sizer.held_until is not None
    _run(sizer, clock, lambda n: 40.0 * n, SHORT_HOLD_S / 2, waiting=24)
    assert sizer.limit == 32  # still held: looked at again only after the short hold
    assert _run(sizer, clock, lambda n: 40.0 * n, SHORT_HOLD_S * 3)[-1] == 64


def _row(max_tokens: int, *, interactive: bool = False) -> Request:
    return Request(key=object(), prepared=None, cached_features=None,  # type: ignore[arg-type]
                   max_tokens=max_tokens, temperature=0.0, stop=(), interactive=interactive)


def test_interactive_rows_do_not_move_the_shape_the_sizer_sees() -> None:
    """A question's short answer among OCR rows would change the shape (256 -> ~240 new
    tokens a row on average), and the sizer would start again from its floor at every
    question; the shape is its bulk rows' alone."""
    bulk = [_row(256) for _ in range(15)]
    alone = bulk_shape(bulk, [300] * 15)
    with_chat = bulk_shape([*bulk, _row(64, interactive=True)], [300] * 15 + [40])
    assert with_chat == alone
    # Counted as bulk, the same row would have moved it: the test can tell.
    assert bulk_shape([*bulk, _row(64)], [300] * 15 + [40]) != alone
    # Only interactive rows: theirs is the shape.
    assert bulk_shape([_row(64, interactive=True)], [40]).new_tokens == 6
