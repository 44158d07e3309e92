"""benchmarks/run.py keeps working: every system runs on 4 items through real Redis.

Speed is the harness's business, never asserted here; this checks that each system
served every item, that one repetition guard reaches every system that can have one, and
that the final JSON line carries the figures the README names.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vlmq.worker.model import blas

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RUN = BENCH / "run.py"
KEYS = ("D_over_A", "D_over_B", "D_over_C", "D_over_E", "D_over_D_ref",
        "small_job_p95_D_over_B", "small_job_p95_D_over_C", "small_job_p95_D_over_E",
        "guard", "E_guard", "busy", "enqueue_items_per_s", "peak_rss_mb")


def _harness(redis_url: str, model: Path, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(RUN), "--model", str(model), "--sizes", "1,3",
         "--max-tokens", "4", "--spacing", "0.1", "--redis-url", redis_url, "--no-flush",
         "--no-enqueue-bench", "--workdir", str(tmp_path), "--json-out",
         str(tmp_path / "out.json"), *extra],
        capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "out.json").read_text()) == last
    return last


@pytest.mark.slow
def test_harness_runs_every_system_on_four_items(redis_url: str, tiny_model: Path,
                                                 tmp_path: Path) -> None:
    last = _harness(redis_url, tiny_model, tmp_path)
    assert set(KEYS) <= set(last)
    assert set(last["raw"]) == {"A", "B", "C", "D", "E"}  # D_ref: bench model only
    for name, fig in last["raw"].items():
        assert fig["items"] == 4, name
        assert fig["tokens"] > 0, name
        assert len(fig["latencies_s"]) == 2, name
    assert last["guard"] == "off" and last["E_guard"] == "off"
    assert last["raw"]["D"]["failed"] == 0
    fast = "mkl " if blas.mkl_candidates() else "openblas "  # what a worker loads here
    assert last["raw"]["D"]["blas"].startswith(fast)
    assert last["raw"]["E"]["blas"].startswith(fast)  # the worker's BLAS, not MLX's
    assert sum(last["raw"]["E"]["finish_reasons"].values()) == 4
    assert last["busy"] > 0 and last["peak_rss_mb"] > 0
    assert last["D_over_E"] > 0


@pytest.mark.slow
def test_guard_flag_reaches_every_system(redis_url: str, tiny_model: Path,
                                         tmp_path: Path) -> None:
    last = _harness(redis_url, tiny_model, tmp_path, "--guard", "--systems", "A,B,C,D")
    assert last["guard"].startswith("on (period <= 64, repeats >= 8, span >= 32")
    assert last["E_guard"] is None  # E not run
    assert set(last["raw"]) == {"A", "B", "C", "D"}
    for name, fig in last["raw"].items():
        assert fig["items"] == 4, name
        assert fig["guard_cuts"] == 0, name  # 4 tokens never make a loop


def _load_run() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import run
    finally:
        sys.path.remove(str(BENCH))
    return run


def test_guard_to_eos_forces_eos_once_the_tail_loops() -> None:
    """B's guard: logits pass through until the generated tail loops, then only EOS can
    follow; clones share the count of rows cut, never the tokens."""
    import mlx.core as mx

    from vlmq.worker.engine.repetition import RepetitionGuard

    run = _load_run()
    guard = RepetitionGuard(max_period=4, min_repeats=2, min_span=4)
    proc = run.GuardToEos(guard, eos=3)
    other = proc.clone()
    logits = mx.array([[0.0, 5.0, 1.0, -2.0, 0.5]])
    assert proc(mx.array([9, 9, 9]), logits) is logits  # end of prefill: untouched
    # "7 8" twice: a loop of period 2 over 4 tokens, found once the 4th token is in
    seen = [int(mx.argmax(proc.process_last_token(token, logits), axis=-1).item())
            for token in (7, 8, 7, 8)]
    assert seen == [1, 1, 1, 3]
    assert proc.cuts == [4] and other.cuts is proc.cuts
    assert other.tokens == []
    assert run.guard_flags(None) == ["--repetition-repeats", "0"]
    assert run.guard_flags(guard) == ["--repetition-repeats", "2", "--repetition-min-span", "4",
                                      "--repetition-period", "4", "--on-repetition", "stop"]
