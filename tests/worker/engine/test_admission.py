"""Admission (worker/engine/admission.py): the batch holds at its measured knee for big
jobs, and a small job takes an express row past it at once, within the KV budget.

The rule by itself beside a sizer that a fake clock has driven to its knee, then the real
engine with the tiny model: a one-item job submitted while a 40-item job fills the batch
starts at the next step, and every output equals its output without the other job."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engine_rig import Rig
from tests.support.helpers import Clock
from vlmq.worker.engine.admission import Waiting, admits, bulk_prefill_rows, express_rows
from vlmq.worker.engine.batch_size import BatchSizer, Shape
from vlmq.worker.engine.batcher import Finished, Request
from vlmq.worker.item_order import SHARE_RANKS

OCR = Shape(prompt=9, new_tokens=8, constrained=False)


def _at_knee() -> BatchSizer:
    """A sizer whose batch stopped paying past 16 rows, holding there (fake time)."""
    clock = Clock()
    sizer = BatchSizer(64, floor=8, clock=clock)
    rate = {8: 200.0, 16: 320.0, 32: 240.0}
    for _ in range(10_000):
        n = sizer.limit
        clock.t += n / rate[n]
        sizer.observe(n, n, n / rate[n], OCR, waiting=1_000)
        if sizer.held_until is not None and sizer.limit == 16:
            break
    assert sizer.limit == 16 and "knee" in sizer.reason, sizer.reason
    return sizer


def test_rows_queue_in_the_generator_no_deeper_than_two_prefill_batches() -> None:
    """A row admitted behind prompts still waiting in the generator waits for all of
    them, whatever its priority: at most two prefill batches wait there (one prefilling,
    one queued); the caller also admits at most a prefill batch a turn."""
    assert bulk_prefill_rows(8, last_interactive=None, now=0.0) == 16
    assert bulk_prefill_rows(8, last_interactive=None, now=0.0, prompts_in_flight=11) == 5
    assert bulk_prefill_rows(8, last_interactive=None, now=0.0, prompts_in_flight=16) == 0
    assert bulk_prefill_rows(8, last_interactive=None, now=0.0, prompts_in_flight=20) == 0
    # A person on the machine: one at a time, once no row waits for its first token.
    assert bulk_prefill_rows(8, last_interactive=0.0, now=1.0) == 1
    assert bulk_prefill_rows(8, last_interactive=0.0, now=1.0, prompts_in_flight=1) == 0


def test_a_small_job_passes_a_full_batch_at_its_knee_and_a_big_one_waits() -> None:
    limit = _at_knee().limit
    reserve = express_rows(limit)
    assert reserve == 4
    room = {"limit": limit, "capacity": 64 + express_rows(64), "kv_in_flight": 1_000,
            "kv_budget": 100_000}
    big = Waiting(job_left=40, kv_cost=300, biggest_live=40)
    small = Waiting(job_left=1, kv_cost=300, biggest_live=40)
    assert admits(big, live=limit - 1, **room)
    assert not admits(big, live=limit, **room)  # the knee holds for big jobs
    assert admits(small, live=limit, **room)
    assert admits(Waiting(job_left=reserve, kv_cost=300, biggest_live=40),
                  live=limit + reserve - 1, **room)
    assert not admits(small, live=limit + reserve, **room)  # the express rows are full
    assert not admits(Waiting(job_left=reserve + 1, kv_cost=300, biggest_live=40),
                      live=limit, **room)
    assert not admits(Waiting(job_left=0, kv_cost=300, biggest_live=40), live=limit,
                      **room)  # not known


def test_a_batch_of_one_item_jobs_keeps_no_express_row_for_one_more() -> None:
    """A backlog of one-item jobs fills the batch: another one-item job takes the next
    free row (the worker's priority orders them), not a row past the knee."""
    room = {"limit": 16, "capacity": 80, "kv_in_flight": 1_000, "kv_budget": 100_000}
    assert not admits(Waiting(job_left=1, kv_cost=300, biggest_live=1), live=16, **room)
    assert admits(Waiting(job_left=1, kv_cost=300, biggest_live=2), live=16, **room)


def test_the_kv_budget_and_the_capacity_bind_the_express_rows_too() -> None:
    small = Waiting(job_left=1, kv_cost=500, biggest_live=40)
    assert not admits(small, live=16, limit=16, capacity=20, kv_in_flight=99_600,
                      kv_budget=100_000)
    assert not admits(small, live=4, limit=4, capacity=4, kv_in_flight=0, kv_budget=10**6)
    # Alone, a row over the whole budget still runs (it runs by itself).
    assert admits(Waiting(job_left=1, kv_cost=10**7), live=0, limit=16, capacity=20,
                  kv_in_flight=0, kv_budget=100_000)


BIG, SMALL_TOKENS, BIG_TOKENS, ROWS = 40, 8, 24, 4
# The most steps from the engine seeing the one-item job to its first token, whatever the
# batch holds: the step running then, two for each of the two prefill batches of the big
# job's prompts the generator may hold (a prompt step, then the step that samples their
# first tokens, each after a decoding step), and two for its own.
FIRST_TOKEN_STEPS = 7


@pytest.fixture(scope="module")
def rig(tiny_model: Path) -> Iterator[Rig]:
    r = Rig(tiny_model, ROWS)  # a fixed limit of 4 rows: the knee, as far as this test goes
    yield r
    r.close()


def _small(rig: Rig) -> Request:
    r = rig.request(("small", 0), 7, None, max_tokens=SMALL_TOKENS)
    r.priority, r.job_left = SHARE_RANKS, 1
    return r


def _collect(rig: Rig, n: int) -> dict[object, Finished]:
    got: dict[object, Finished] = {}
    for _ in range(6000):
        for f in rig.engine.get_finished(timeout=0.1):
            got[f.key] = f
        if len(got) == n:
            break
    assert len(got) == n, f"{len(got)}/{n} came back"
    return got


def test_a_one_item_job_starts_at_the_next_step_beside_a_full_batch(rig: Rig) -> None:
    alone = rig.run([_small(rig)])[("small", 0)]
    without = rig.run(rig.big_job(BIG, BIG_TOKENS), timeout=300)
    big = rig.big_job(BIG, BIG_TOKENS)
    for r in big:
        rig.engine.submit(r)
    early: dict[object, Finished] = {}
    for _ in range(3000):  # until the big job fills the batch
        if rig.engine.state.active >= ROWS:
            break
        early.update((f.key, f) for f in rig.engine.get_finished(timeout=0.01))
    assert rig.engine.state.active == ROWS and not early
    rig.engine.submit(_small(rig))
    got = _collect(rig, BIG + 1)
    small = got[("small", 0)]
    waited = small.first_step - small.seen_step
    print(f"first token {waited} steps after it was seen")
    assert waited <= FIRST_TOKEN_STEPS, f"the one-item job's first token took {waited} steps"
    big_done_before = sum(1 for k, f in got.items()
                          if k != ("small", 0) and f.admitted_step + len(f.tokens)
                          <= small.admitted_step)
    assert big_done_before < ROWS, "it waited for a big row to end"
    assert small.tokens == alone.tokens
    for i in range(BIG):
        assert got[("big", i)].tokens == without[("big", i)].tokens, i
