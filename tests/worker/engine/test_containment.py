"""Containment in the batch itself: one row's failure, or one schema's cost, is that row's.

The real engine and the tiny model: rows that share a batch with a failing row finish with
the tokens they have alone (greedy), and the failing row's error names its own cause."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engine_rig import Rig
from tests.support.schemas import INVOICE, RECEIPT
from vlmq.worker.engine.batcher import Engine, Finished, Request, faults
from vlmq.worker.engine.constraints import ConstraintError

# Patterns that pass every check at enqueue, and cost llguidance seconds and gigabytes.
HOSTILE = ["^(a{1000}){1000}$", "^(a{2000}){2000}$", "^((a{100}){100}){100}$",
           "^(a{1000}b{1000}){1000}$"]
SLOW = "^(a{700}){700}$"


def _hostile(pattern: str) -> dict[str, object]:
    return {"type": "string", "pattern": pattern}


@pytest.fixture(scope="module")
def rig(tiny_model: Path) -> Iterator[Rig]:
    r = Rig(tiny_model, 4)
    yield r
    r.close()


@pytest.fixture(scope="module")
def alone(rig: Rig, tiny_model: Path) -> dict[object, Finished]:
    """Each innocent row run by itself at max batch 1: what it must end with beside others."""
    solo = Rig(tiny_model, 1)
    try:
        out: dict[object, Finished] = {}
        for key, seed, schema in _innocents():
            out.update(solo.run([solo.request(key, seed, schema, max_tokens=24)]))
        return out
    finally:
        solo.close()


def _innocents() -> list[tuple[object, int, dict[str, object] | None]]:
    return [(("cap", 0), 10, None), (("cap", 1), 11, None), (("ext", 0), 12, RECEIPT),
            (("ext", 1), 13, INVOICE)]


def _run_innocents_with(rig: Rig, extra: list[Request]) -> dict[object, Finished]:
    reqs = [rig.request(key, seed, schema, max_tokens=24) for key, seed, schema in _innocents()]
    reqs[2:2] = extra  # mid-batch, beside every innocent row
    return rig.run(reqs)


def _same_as_alone(got: Finished, alone: Finished) -> None:
    # An extract row cut at max_tokens fails the same way alone: only the innocent's own.
    assert (got.tokens, got.error, got.text) == (alone.tokens, alone.error, alone.text), got.key
    assert got.finish_reason != "error", got.error


@pytest.mark.parametrize("pattern", HOSTILE)
def test_a_hostile_schema_fails_its_own_row_at_build_naming_the_budget(
        rig: Rig, pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[str] = []
    build = rig.structured._build
    monkeypatch.setattr(rig.structured, "_build", lambda g: builds.append(g) or build(g))
    with pytest.raises(ConstraintError, match="too costly to match") as caught:
        rig.structured.row(_hostile(pattern))
    assert "budget" in str(caught.value)
    with pytest.raises(ConstraintError, match="too costly to match") as again:
        rig.structured.row(_hostile(pattern))  # the next item of that job fails at once:
    assert len(builds) == 1  # from what the first build found, not by building again
    assert str(again.value) == str(caught.value)


def test_a_row_over_the_step_budget_is_cut_and_the_others_keep_their_tokens(
        rig: Rig, alone: dict[object, Finished]) -> None:
    slow = rig.request("slow", 20, INVOICE, max_tokens=24)
    assert slow.constraint is not None
    slow.constraint.step_budget_s = 0.0  # every mask is late: cut at its first decode step
    got = _run_innocents_with(rig, [slow])
    err = got["slow"].error or ""
    assert got["slow"].finish_reason == "error" and "step budget" in err, err
    for key, _, _ in _innocents():
        _same_as_alone(got[key], alone[key])


def test_the_slow_pattern_never_costs_others_more_than_the_step_budget(
        rig: Rig, alone: dict[object, Finished]) -> None:
    """(a{700}){700} costs about 1 s to build and 0.15 s a mask step: either the build or
    the first late step ends it, and the innocent rows keep their tokens."""
    try:
        extra = [rig.request("slow", 21, _hostile(SLOW), max_tokens=24)]
    except ConstraintError as exc:  # over the build budget on this machine: fine as well
        assert "budget" in str(exc)
        extra = []
    got = _run_innocents_with(rig, extra)
    if extra:
        assert got["slow"].finish_reason == "error"
        assert "budget" in (got["slow"].error or "")
    for key, _, _ in _innocents():
        _same_as_alone(got[key], alone[key])


def test_a_failing_step_finds_its_culprit_and_the_other_rows_finish_as_alone(
        tiny_model: Path, alone: dict[object, Finished]) -> None:
    """A step that raises with no row named (as an MLX error would) while one row of five
    is in the batch: the engine reruns the rows apart, fails that row alone, and the four
    innocent rows end with their sequential tokens."""
    culprit = ("job-x", 7)
    rig = Rig(tiny_model, 4)
    rig.engine.close(timeout=10)
    rig.engine = Engine(str(tiny_model), max_batch=5, fault=faults.RowFault(culprit))
    rig.engine.wait_ready(timeout=60)
    try:
        got = _run_innocents_with(rig, [rig.request(culprit, 30, None, max_tokens=24)])
        isolations = rig.engine.stats()["isolations"]
    finally:
        rig.close()
    err = got[culprit].error or ""
    assert got[culprit].finish_reason == "error"
    assert "InjectedFault" in err and "fails alone" in err, err
    for key, _, _ in _innocents():
        _same_as_alone(got[key], alone[key])
    assert isolations >= 2  # halves, then halves again: log2 of the batch


def test_the_fault_hook_spec_is_checked() -> None:
    assert faults.parse("abc:3@5") == faults.RowFault(("abc", 3), 5)
    assert faults.parse("a:b:0") == faults.RowFault(("a:b", 0), 2)
    for bad in ("abc", "abc:x", ":1", "abc:1@x"):
        with pytest.raises(ValueError, match="VLMQ_FAULT_ROW"):
            faults.parse(bad)
