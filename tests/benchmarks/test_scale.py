"""benchmarks/scale.py keeps working end to end on small sets (a check, not the figures).

It starts its own redis-server and workers; the figures it prints are never asserted,
only that every part ran and the last line carries them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCALE = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"


def test_scale_runs_every_part_on_small_sets(tiny_model: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(SCALE), "--model", str(tiny_model), "--small", "--sizes", "30,60",
         "--repeat", "1", "--workdir", str(tmp_path), "--json-out", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "out.json").read_text()) == last
    assert set(last["listing"]) == {"30", "60", "cli_startup_s"}
    for n in ("30", "60"):
        times = last["listing"][n]
        assert {"jobs_limit_20_s", "jobs_in_process_s", "dashboard_overview_s",
                "dashboard_jobs_s", "status_label_s"} <= set(times), n
    for key in ("queued_image_ref_bytes", "queued_image_upload_bytes", "queued_page_ref_bytes",
                "finished_item_bytes", "drain_jobs_per_s", "pickup_ms_median",
                "extrapolated_1M_pages_queued_ref_mb", "extrapolated_1M_pages_finished_mb"):
        assert last[key] is not None and last[key] > 0, key
    assert last["drain_statuses"] == {"finished": 60}
    assert last["worker"]["backlog_items"] == 60
    assert last["worker"]["rss_ready_mb"] > 0
