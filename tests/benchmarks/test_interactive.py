"""benchmarks/interactive.py's figures: percentiles as numpy computes them, seeded moments
inside the bulk's span, and the issue's three target ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import interactive as I

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "interactive.py"


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0],
                                    [float(x) for x in range(20, 0, -1)]])
@pytest.mark.parametrize("q", [0, 50, 95, 100])
def test_percentile_is_numpys_linear_one(values: list[float], q: float) -> None:
    assert I.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_no_values_give_zero() -> None:
    assert I.percentile([], 95) == 0.0


def test_summarize_reads_ttft_and_total_apart() -> None:
    timings = [I.Timing(ttft_s=0.1 * i, total_s=1.0 + i, tokens=64) for i in range(1, 21)]
    s = I.summarize(timings)
    assert s["n"] == 20
    assert s["ttft_p50_s"] == pytest.approx(1.05)
    assert s["ttft_p95_s"] == pytest.approx(1.905)
    assert s["total_p50_s"] == pytest.approx(11.5)


def test_moments_are_seeded_sorted_and_inside_the_spread() -> None:
    at = I.moments(20, 100.0, seed=7)
    assert at == I.moments(20, 100.0, seed=7) != I.moments(20, 100.0, seed=8)
    assert at == sorted(at) and len(at) == 20
    lo, hi = I.SPREAD
    assert all(lo * 100 <= x <= hi * 100 for x in at)


def _system(idle: float, load: float, bulk: float, load_bulk: float) -> dict[str, object]:
    return {"idle": {"ttft_p95_s": idle}, "load": {"ttft_p95_s": load},
            "bulk_pages_per_s": bulk, "load_pages_per_s": load_bulk}


def test_targets_are_the_issues_three_ratios() -> None:
    figures = {"vlmq": _system(0.2, 0.3, 10.0, 9.5), "mlx_vlm": _system(0.2, 4.0, 8.0, 7.0)}
    t = I.targets(figures)
    assert t["vlmq_ttft_p95_load_over_idle"] == 1.5
    assert t["vlmq_ttft_p95_load_over_mlx_vlm"] == 0.075
    assert t["vlmq_bulk_with_over_without"] == 0.95
    assert t["met"] == {"load_over_idle": True, "over_mlx_vlm": True, "bulk_kept": True}
    missed = I.targets({"vlmq": _system(0.2, 0.5, 10.0, 8.0)})
    assert missed["vlmq_ttft_p95_load_over_mlx_vlm"] is None
    assert missed["met"] == {"load_over_idle": False, "over_mlx_vlm": None,
                             "bulk_kept": False}
    assert "NOT met" in I.report({"vlmq": {**_system(0.2, 0.5, 10.0, 8.0),
                                           "idle": I.summarize([I.Timing(0.2, 1.0, 8)]),
                                           "load": I.summarize([I.Timing(0.5, 1.5, 8)])}})


@pytest.mark.slow
def test_the_harness_runs_both_systems_on_a_few_pages(tiny_model: Path, tmp_path: Path) -> None:
    """Every phase of both systems runs and the last line carries the figures; the
    figures themselves are the harness's business, never asserted."""
    out = subprocess.run(
        [sys.executable, str(HARNESS), "--quick", "--model", str(tiny_model), "--pages", "4",
         "--requests", "2", "--workdir", str(tmp_path), "--json-out",
         str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "out.json").read_text()) == last
    assert set(last["met"]) == {"load_over_idle", "over_mlx_vlm", "bulk_kept"}
    for system in ("vlmq", "mlx_vlm"):
        figures = last["systems"][system]
        assert figures["idle"]["n"] == figures["load"]["n"] == 2
        assert figures["bulk_pages_per_s"] > 0 and figures["load_pages_per_s"] > 0
