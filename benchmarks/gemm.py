"""The BLAS under MLX's matmuls beside numpy's own, on this machine, side by side.

float32 (b x 512) @ (512 x 1408) (the bench model's MLP shape) at b = 1, 8, 32 and 64,
with 1 and 2 threads, in GFLOP/s (best of several repeats). Each row runs in a child
process of its own, since a BLAS is chosen once per process, before MLX loads:

- `worker`: what a worker loads at defaults (worker/model/blas.py's `auto`), through
  `mx.matmul` on the CPU stream;
- each other library found on the machine (`--also PATH` adds more), the same way;
- `numpy`: numpy's own BLAS (`np.matmul`), which the worker's must reach: the ratio
  worker/numpy is printed per shape.

    .venv/bin/python benchmarks/gemm.py            # ~1 min
    .venv/bin/python benchmarks/gemm.py --json-out figures.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SIZES = (1, 8, 32, 64)
THREADS = (1, 2)
K, N = 512, 1408


def _best_gflops(run: Any, b: int, seconds: float = 0.4) -> float:
    """Best rate over repeats of `run()` (one b x K x N product), after a warm-up."""
    for _ in range(3):
        run()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(5):
            run()
        best = min(best, (time.perf_counter() - t0) / 5)
    return 2 * b * K * N / best / 1e9


def child(kind: str, choice: str, threads: int) -> dict[str, Any]:
    """One row: (kind, the library that served it, {b: GFLOP/s})."""
    import numpy as np

    rng = np.random.default_rng(0)
    rates: dict[int, float] = {}
    if kind == "numpy":
        for b in SIZES:
            a, w = rng.standard_normal((b, K), np.float32), rng.standard_normal((K, N),
                                                                                  np.float32)
            rates[b] = _best_gflops(lambda a=a, w=w: np.matmul(a, w), b)
        return {"library": "numpy " + np.__version__, "rates": rates}
    from vlmq.worker.model import blas

    info = blas.select(choice, threads=threads)
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    for b in SIZES:
        a = mx.array(rng.standard_normal((b, K), np.float32))
        w = mx.array(rng.standard_normal((K, N), np.float32))
        rates[b] = _best_gflops(lambda a=a, w=w: mx.eval(a @ w), b)
    return {"library": info.describe(), "rates": rates}


def _run_child(kind: str, choice: str, threads: int) -> dict[str, Any]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, __file__, "--child", kind, choice, str(threads)],
                         env=env, capture_output=True, text=True, check=False, timeout=600)
    if out.returncode != 0:
        return {"library": f"failed: {out.stderr.strip().splitlines()[-1:]}", "rates": {}}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def candidates(also: list[str]) -> list[tuple[str, str]]:
    """(row name, --blas choice): the worker's default, then every library found."""
    from vlmq.worker.model import blas

    rows = [("worker", blas.AUTO)]
    found = [str(p) for p in blas.system_candidates() if p.exists()]
    found += [str(p) for _, p in blas.wheel_candidates()]
    found += [str(p) for p in blas.mkl_candidates()]
    seen: set[Path] = set()
    for path in [*found, *also]:
        real = Path(path).resolve()  # distribution links name one library several ways
        if real not in seen:
            seen.add(real)
            rows.append((Path(path).name, path))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--also", action="append", default=[], metavar="PATH",
                        help="another BLAS library to measure (repeatable)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    if args.child:
        kind, choice, threads = args.child
        print(json.dumps(child(kind, choice, int(threads))))
        return
    rows: list[dict[str, Any]] = []
    for threads in THREADS:
        numpy_row = _run_child("numpy", "", threads)
        rows.append({"row": "numpy", "threads": threads, **numpy_row})
        for name, choice in candidates(args.also):
            rows.append({"row": name, "threads": threads, **_run_child("mlx", choice, threads)})
    print(f"float32 (b x {K}) @ ({K} x {N}), GFLOP/s, best of repeats; "
          "ratio = this row / numpy at the same threads\n")
    print("| row | threads | " + " | ".join(f"b={b}" for b in SIZES) + " | library |")
    print("|---|---|" + "---|" * len(SIZES) + "---|")
    for r in rows:
        base = next(x for x in rows if x["row"] == "numpy" and x["threads"] == r["threads"])
        cells = []
        for b in SIZES:
            rate = r["rates"].get(str(b), r["rates"].get(b))
            ref = base["rates"].get(str(b), base["rates"].get(b))
            if rate is None:
                cells.append("-")
            elif r["row"] == "numpy" or not ref:
                cells.append(f"{rate:.1f}")
            else:
                cells.append(f"{rate:.1f} ({rate / ref:.2f}x)")
        print(f"| {r['row']} | {r['threads']} | " + " | ".join(cells) + f" | {r['library']} |")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
