"""benchmarks/run.py keeps working: every system runs on 4 items through real Redis.

Speed is the harness's business, never asserted here; this checks that each system
served every item and that the final JSON line carries the figures the README names.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
KEYS = ("D_over_A", "D_over_B", "D_over_C", "D_over_D_ref", "small_job_p95_D_over_B", "busy",
        "enqueue_items_per_s", "peak_rss_mb")


def test_harness_runs_every_system_on_four_items(redis_url: str, tiny_model: Path,
                                                 tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(RUN), "--model", str(tiny_model), "--sizes", "1,3",
         "--max-tokens", "4", "--spacing", "0.1", "--redis-url", redis_url, "--no-flush",
         "--no-enqueue-bench", "--workdir", str(tmp_path), "--json-out",
         str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "out.json").read_text()) == last
    assert set(KEYS) <= set(last)
    assert set(last["raw"]) == {"A", "B", "C", "D"}  # D_ref: bench model only
    for name, fig in last["raw"].items():
        assert fig["items"] == 4, name
        assert fig["tokens"] > 0, name
        assert len(fig["latencies_s"]) == 2, name
    assert last["raw"]["D"]["failed"] == 0
    assert last["raw"]["D"]["blas"].startswith("openblas ")
    assert last["busy"] > 0 and last["peak_rss_mb"] > 0
