"""Schema matching bounded over all rows of a step, not only per row.

The rule (worker/engine/match_budget.py) by itself, and the real engine with the tiny
model: constrained rows that each cost many model steps of matching (about 11 ms a step on
this CPU) beside an innocent caption job. What is asserted is the order in which rows come
back, not times: benchmarks/containment.py measures what the budget saves."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engine_rig import Rig
from vlmq.worker.engine.batcher import Finished, Request
from vlmq.worker.engine.match_budget import DEFER_STEPS, MatchBudget

# Each mask step walks a 30,000-character pattern: about 11 ms a step here. The per-row cut
# is lifted far above that (a loaded machine must not cut a row and change its tokens), so
# what these rows cost the others is the matching budget's alone to bound.
COSTLY = {"type": "object", "required": ["a"],
          "properties": {"a": {"type": "string", "pattern": "^(a{300}){100}$"}}}
INNOCENT_ROWS = 5
TOKENS = 24
NO_CUT_S = 5.0


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
    rows = [rig.request((tag, i), 40 + i, COSTLY, max_tokens=TOKENS) for i in range(n)]
    for r in rows:
        assert r.constraint is not None
        r.constraint.step_budget_s = NO_CUT_S
    return rows


def _tagged(got: dict[object, Finished], tag: str) -> int:
    return sum(1 for k in got if isinstance(k, tuple) and k[0] == tag)


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


def test_sixteen_costly_rows_do_not_hold_an_innocent_job_back(rig: Rig) -> None:
    """Submitted first, sixteen costly rows would be admitted before the innocent job and
    end with it or before it. Beside them an unconstrained row's step may hold only one
    row's matching, so most wait: the innocent job is back while they are not."""
    _innocent_seconds(rig, "warm", _costly(rig, "warm-c", 1))
    before = rig.engine.state.deferrals
    got: dict[object, Finished] = {}
    innocent = _innocents(rig, "many")
    costly = _costly(rig, "many-c", 16)
    for r in [*costly, *innocent]:
        rig.engine.submit(r)
    _back(rig, {r.key for r in innocent}, got)
    costly_back = _tagged(got, "many-c")
    _back(rig, {r.key for r in costly}, got)
    assert costly_back < 16 // 2, f"{costly_back} of 16 costly rows ended before the job"
    assert rig.engine.state.deferrals >= before
    for i in range(16):  # every costly row ran, as it would alone: cut at max_tokens
        f = got[("many-c", i)]
        assert f.finish_reason == "length" and "max_tokens" in (f.error or ""), f.error


def test_costly_rows_running_when_an_innocent_job_arrives_make_room(rig: Rig) -> None:
    """The issue's order: one extract job's rows of one schema fill the batch (nothing to
    protect: they run at full width), then a caption job arrives. The costly rows are
    deferred until the rest fit, so the caption job ends before the rows that were
    running when it came, and each deferred row ends with the tokens it has undeferred."""
    n = 12
    undeferred: dict[object, Finished] = {}
    ref = _costly(rig, "ref", n)
    for r in ref:
        rig.engine.submit(r)
    _back(rig, {r.key for r in ref}, undeferred)
    before = rig.engine.state.deferrals
    running = _costly(rig, "run", n)
    for r in running:
        rig.engine.submit(r)
    deadline = time.perf_counter() + 60
    while rig.engine.state.active < n and time.perf_counter() < deadline:
        time.sleep(0.01)
    got: dict[object, Finished] = {}
    _innocent_seconds(rig, "late", [], got)
    running_back = _tagged(got, "run")
    _back(rig, {r.key for r in running}, got)
    assert running_back < n, "every running costly row ended before the late job did"
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
