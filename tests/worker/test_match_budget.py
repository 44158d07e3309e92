"""Schema matching bounded over all rows of a step, not only per row.

The rule (worker/engine/match_budget.py) by itself, and the real engine with the tiny
model: constrained rows that each stay under the per-row step cut (about 11 ms a step on
this CPU) beside an innocent caption job. Times are compared side by side in one run:
the innocent job beside sixteen such rows against the same job beside one."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engine_rig import Rig
from vlmq.worker.engine.batcher import Finished, Request
from vlmq.worker.engine.match_budget import DEFER_STEPS, MatchBudget

# Each mask step walks a 30,000-character pattern: about 11 ms a step here, under the
# 20 ms cut, so no row is cut; what it costs the others is the matching budget's to bound.
COSTLY = {"type": "object", "required": ["a"],
          "properties": {"a": {"type": "string", "pattern": "^(a{300}){100}$"}}}
INNOCENT_ROWS = 5
TOKENS = 24


def test_one_constrained_row_always_runs_and_more_only_within_the_budget() -> None:
    b = MatchBudget(share=1.0)
    assert b.admits([], 0.5)  # alone: whatever it costs (the per-row cut bounds it)
    assert not b.admits([0.001], 0.001)  # the model's time is not known yet
    b.observe(step_s=0.012, match_s=0.002)  # model 10 ms
    assert b.budget_s == pytest.approx(0.010)
    assert b.admits([0.004], 0.005) and not b.admits([0.004], 0.007)


def test_rows_over_the_budget_are_deferred_costliest_and_newest_first() -> None:
    b = MatchBudget(share=1.0)
    b.observe(step_s=0.010, match_s=0.0)  # budget 10 ms
    live = [0.004, 0.008, 0.008, 0.001]
    for _ in range(DEFER_STEPS - 1):
        assert b.defer(live) == []
    assert b.defer(live) == [2, 1]  # 21 ms -> 5 ms: the two 8 ms rows, the newer first
    assert b.defer([0.006, 0.008]) == []  # 14 ms: within the hysteresis (1.5 x budget)
    assert b.defer([0.030]) == []  # one row always stays
    assert b.defer([0.004, 0.005]) == []  # within the budget


@pytest.fixture(scope="module")
def rig(tiny_model: Path) -> Iterator[Rig]:
    r = Rig(tiny_model, 24)
    yield r
    r.close()


def _innocents(rig: Rig, tag: str) -> list[Request]:
    return [rig.request((tag, i), 10 + i, None, max_tokens=TOKENS)
            for i in range(INNOCENT_ROWS)]


def _costly(rig: Rig, tag: str, n: int) -> list[Request]:
    return [rig.request((tag, i), 40 + i, COSTLY, max_tokens=TOKENS) for i in range(n)]


def _back(rig: Rig, keys: set[object], got: dict[object, Finished]) -> None:
    """Collect into `got` until every key in `keys` came back (others may come too)."""
    deadline = time.perf_counter() + 120
    while not keys <= set(got) and time.perf_counter() < deadline:
        for f in rig.engine.get_finished(timeout=0.05):
            got[f.key] = f
    assert keys <= set(got), sorted(map(str, keys - set(got)))


def _innocent_seconds(rig: Rig, tag: str, beside: list[Request],
                      got: dict[object, Finished] | None = None
                      ) -> tuple[float, dict[object, Finished]]:
    """Seconds until the innocent job's last row came back, submitted after `beside`; its
    rows and `beside`'s are in the answer once all came back."""
    got = {} if got is None else got
    innocent = _innocents(rig, tag)
    t0 = time.perf_counter()
    for r in [*beside, *innocent]:
        rig.engine.submit(r)
    _back(rig, {r.key for r in innocent}, got)
    done = time.perf_counter() - t0
    _back(rig, {r.key for r in beside}, got)
    return done, got


def test_sixteen_costly_rows_slow_an_innocent_job_no_more_than_one_does(rig: Rig) -> None:
    """The stated factor: beside any number of constrained rows an unconstrained row's
    step is at most 2x its model time, or model time + one row's matching where that is
    more. So sixteen rows may cost the innocent job what one does (2x for noise)."""
    _innocent_seconds(rig, "warm", _costly(rig, "warm-c", 1))
    alone = statistics.median(_innocent_seconds(rig, f"alone{k}", [])[0] for k in range(3))
    one, _ = _innocent_seconds(rig, "one", _costly(rig, "one-c", 1))
    many, got = _innocent_seconds(rig, "many", _costly(rig, "many-c", 16))
    shown = (f"innocent job alone {alone:.2f} s, beside one costly row {one:.2f} s, beside "
             f"16 {many:.2f} s ({many / alone:.1f}x alone)")
    assert many <= 2 * one, shown
    for i in range(16):  # every costly row ran, as it would alone: cut at max_tokens
        f = got[("many-c", i)]
        assert f.finish_reason == "length" and "max_tokens" in (f.error or ""), f.error


def test_costly_rows_running_when_an_innocent_job_arrives_make_room(rig: Rig) -> None:
    """The issue's order: one extract job's rows of one schema fill the batch (nothing to
    protect: they run at full width), then a caption job arrives. The costly rows are
    deferred until the rest fit, the caption job takes about what it takes beside one
    costly row, and each deferred row ends with the tokens it has undeferred."""
    n = 12
    undeferred: dict[object, Finished] = {}
    ref = _costly(rig, "ref", n)
    for r in ref:
        rig.engine.submit(r)
    _back(rig, {r.key for r in ref}, undeferred)
    one, _ = _innocent_seconds(rig, "arr-one", _costly(rig, "arr-one-c", 1))
    before = rig.engine.state.deferrals
    running = _costly(rig, "run", n)
    for r in running:
        rig.engine.submit(r)
    deadline = time.perf_counter() + 60
    while rig.engine.state.active < n and time.perf_counter() < deadline:
        time.sleep(0.01)
    got: dict[object, Finished] = {}
    late, _ = _innocent_seconds(rig, "late", [], got)
    _back(rig, {r.key for r in running}, got)
    assert late <= 3 * one, f"innocent job arriving late {late:.2f} s, beside one {one:.2f} s"
    assert rig.engine.state.deferrals > before
    for i in range(n):
        assert got[("run", i)].tokens == undeferred[("ref", i)].tokens, i
        assert got[("run", i)].error == undeferred[("ref", i)].error


def test_rows_that_turn_out_costly_are_deferred_and_end_as_undeferred(rig: Rig) -> None:
    """A schema whose steps cost more than they seemed (here: marked as measured and
    free) gets all its rows admitted; the engine then defers the costliest until the rest
    fit, and each deferred row restarts and ends with the tokens it has undeferred."""
    undeferred = {k[1]: f for k, f in _innocent_seconds(
        rig, "lie-ref", _costly(rig, "lie-ref-c", 6))[1].items() if k[0] == "lie-ref-c"}
    costly = _costly(rig, "lie-c", 6)
    cost = costly[0].constraint.schema_cost if costly[0].constraint is not None else None
    assert cost is not None and all(r.constraint is not None
                                    and r.constraint.schema_cost is cost for r in costly)
    cost.per_step_s, cost.measured = 0.0, True
    before = rig.engine.state.deferrals
    _, got = _innocent_seconds(rig, "lie", costly)
    assert rig.engine.state.deferrals > before
    for i in range(6):
        assert got[("lie-c", i)].tokens == undeferred[i].tokens, i
        assert got[("lie-c", i)].error == undeferred[i].error
