"""Every cost figure of the status and listing paths, side by side, each beside its target.

Costs that should follow a job's own work, measured by the scripts that own each one
(imported, not copied):

- benchmarks/producer_costs.py (each phase a child process on a private redis-server):
  one-item uploaded jobs/s at 1 k and 8 k pending, split_prepared at two sizes, items/s
  enqueueing 100 k distinct ~850-byte PNGs by reference (wall, and per producer CPU
  second: on a shared machine the wall figure is the load's), and the time to the first
  queued job of a 1 M-page set by reference (hard links of one 10 k-page PDF);
- benchmarks/job_bytes.py: Redis bytes a finished one-item job leaves, and a finished
  item of a 500-item job (less its text), through the real worker path without a model;
- benchmarks/status_costs.py (its own private redis-server): the longest single Redis
  command during `vlmq status` at 100 k queued jobs (SLOWLOG), `status BATCH` and the set-up
  of `wait BATCH` at 1 k and 90 k jobs, `vlmq jobs --limit 20` as a command at 100 k jobs.

The machine's load average is printed before and after: these are wall figures on
whatever else runs there. Nothing is asserted; the last line is JSON.

    .venv/bin/python benchmarks/costs.py            # the issue's sizes (5-15 minutes, by load)
    .venv/bin/python benchmarks/costs.py --quick    # smaller sets, for development (~2 minutes)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import producer_costs, status_costs
from benchmarks.common import emit_json, redis_url_or_private, table

# (pending low, pending high, jobs timed at each, files by reference, pages, one-item
# jobs for the bytes, queued jobs for status, small batch, large batch)
FULL = dict(low=1000, high=8000, timed=500, files=100_000, pages=1_000_000, jobs=200,
            queued=100_000, small=1000, large=90_000)
QUICK = dict(low=250, high=2000, timed=100, files=20_000, pages=100_000, jobs=50,
             queued=20_000, small=1000, large=9000)
ITEMS = 500  # the big job of the bytes figure: the 500-item job at every scale


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def producer_figures(size: dict[str, int], quick: bool) -> dict[str, dict[str, Any]]:
    """producer_costs' phases, each in a child of its own, on one private server."""
    ns = argparse.Namespace(files=size["files"], pages=size["pages"], per_pdf=10_000,
                            low=size["low"], high=size["high"], timed=size["timed"],
                            quick=quick)
    out: dict[str, dict[str, Any]] = {}
    with redis_url_or_private(None) as url, \
            tempfile.TemporaryDirectory(prefix="vlmq-costs-") as tmp:
        for phase in ("upload", "split", "refs", "pages"):
            work = Path(tmp) / phase
            work.mkdir()
            t0 = time.perf_counter()
            out[phase] = producer_costs._run(phase, url, work, ns)
            print(f"{phase}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def bytes_figures(jobs: int) -> dict[str, float]:
    """job_bytes.measure on a private server of its own (it counts every key there)."""
    from benchmarks import job_bytes

    with redis_url_or_private(None) as url:
        return job_bytes.measure(url, jobs=jobs, items=ITEMS)


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def rows(size: dict[str, int], p: dict[str, dict[str, Any]], b: dict[str, float],
         s: dict[str, Any]) -> list[list[str]]:
    """One row per acceptance figure: what, measured, target, met."""
    up, refs, pages, split = p["upload"], p["refs"], p["pages"], p["split"]
    small, big = sorted(split, key=int)
    ratio = up["jobs_s_low"] / up["jobs_s_high"]
    lo, hi = size["small"], size["large"]
    first = pages["first_s"]
    return [
        [f"upload: one-item jobs/s at {size['low']:,} / {size['high']:,} pending",
         f"{up['jobs_s_low']:.0f} / {up['jobs_s_high']:.0f} (ratio {ratio:.2f})",
         "ratio < 1.5", _mark(ratio < 1.5)],
        [f"split_prepared CPU s at {int(small):,} / {int(big):,} blobs",
         f"{split[small]['s']:.3f} / {split[big]['s']:.3f}",
         f"linear (x{int(big) // int(small)})",
         _mark(split[big]["s"] <= 1.5 * int(big) / int(small) * split[small]["s"])],
        ["Redis bytes per finished one-item job", f"{b['one_item_job']:,.0f}", "<= 1,500",
         _mark(b["one_item_job"] <= 1500)],
        [f"Redis bytes per finished item of a {ITEMS}-item job, less its text",
         f"{b['item']:,.0f} (+ {b['item_text']:.0f} text)", "<= 400 + text",
         _mark(b["item"] <= 400)],
        [f"longest Redis command in `vlmq status` at {s['queued']:,} queued",
         f"{s['status_longest_ms']:.2f} ms ({s['status_longest_cmd']})", "< 10 ms",
         _mark(s["status_longest_ms"] < 10)],
        [f"`status BATCH` at {lo:,} / {hi:,} jobs (s)",
         f"{s[f'batch_status_{lo}_s']:.4f} / {s[f'batch_status_{hi}_s']:.4f} "
         f"(ratio {s['batch_status_ratio']:.2f})", "ratio < 2",
         _mark(s["batch_status_ratio"] < 2)],
        [f"`wait BATCH` set-up at {lo:,} / {hi:,} jobs (s)",
         f"{s[f'batch_wait_{lo}_s']:.4f} / {s[f'batch_wait_{hi}_s']:.4f} "
         f"(ratio {s['batch_wait_ratio']:.2f})", "ratio < 2", _mark(s["batch_wait_ratio"] < 2)],
        [f"by reference: items/s over {size['files']:,} distinct small PNGs",
         f"{refs['items_s']:,.0f} wall ({refs['cpu_items_s']:,.0f} per producer CPU s)",
         ">= 20,000", _mark(refs["items_s"] >= 20_000)],
        [f"first job queued, {pages['pages']:,}-page set by reference",
         f"{first:.2f} s (all: {pages['all_s']:.1f} s)" if first is not None else "-",
         "< 1 s", _mark(first is not None and first < 1)],
        ["`vlmq --help` wall (start-up, no command module)", f"{s['help_cli_s']:.2f} s",
         "< 0.15 s", _mark(s["help_cli_s"] < 0.15)],
        # The whole listing command: redis-py's own import is most of it.
        [f"`vlmq jobs --limit 20` wall at {s['queued']:,} jobs", f"{s['jobs_cli_s']:.2f} s",
         "< 0.15 s", _mark(s["jobs_cli_s"] < 0.15)],
        ["producer peak RSS (MB)", f"refs {refs['rss_mb']:.0f}, pages {pages['rss_mb']:.0f}, "
         f"upload {up['rss_mb']:.0f}", "bounded by a few jobs", ""],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller sets (250/2000 pending, 20 k files, 100 k pages, "
                             "20 k queued, batches of 1 k and 9 k)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    print(f"load average at the start: {_load()}")
    t0 = time.perf_counter()
    producer = producer_figures(size, args.quick)
    stored = bytes_figures(size["jobs"])
    print(f"job bytes: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    status = status_costs.run(size["queued"], size["small"], size["large"])
    print(f"load average at the end: {_load()}; {time.perf_counter() - t0:.0f} s in all")
    print(table(["figure", "measured", "target", "met"], rows(size, producer, stored, status)))
    emit_json({"size": size, "producer": producer, "bytes": stored, "status": status,
               "load": os.getloadavg()}, args.json_out)


if __name__ == "__main__":
    main()
