"""Does the continuous batcher pay? The same job through a real worker at --max-batch 1 vs 8.

Each run is a fresh `vlmq worker --burst` subprocess (as in production) with its own empty
--cache-dir, so the vision cache helps neither side. Two times are printed per run:
the job's own wall time (worker-side, model load excluded) and spawn -> last item.

    .venv/bin/python benchmarks/batching.py                      # 1,4,8,16 x3, 16 items
    .venv/bin/python benchmarks/batching.py --batches 1,8 --repeat 1 --max-tokens 128
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import common as C


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(p)
    p.add_argument("--batches", default="1,4,8,16",
                   help="comma-separated --max-batch values; the first is the ratio base")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs per batch size, interleaved; medians are reported")
    return p.parse_args(argv)


def run_batches(redis_url: str, model: str, inputs: list[Path], workdir: Path,
                batches: list[int], repeat: int, max_tokens: int,
                side: int) -> dict[int, list[C.WorkerRun]]:
    """Interleave batch sizes (1,8,1,8...) so drift on the machine hits both alike."""
    out: dict[int, list[C.WorkerRun]] = {b: [] for b in batches}
    for r in range(repeat):
        for b in batches:
            cache = workdir / f"b{b}-r{r}" / "vision"
            run = C.run_burst_worker(redis_url, model, inputs, max_batch=b, cache_dir=cache,
                                     max_tokens=max_tokens, side=side, label=f"b{b}r{r}")
            job = run.jobs[0]
            print(f"  max-batch {b:>2} run {r + 1}: {job.ok}/{job.items} ok, "
                  f"{job.tokens} tokens, job {job.wall_s:.2f} s, "
                  f"spawn->last item {run.to_last_item_s:.2f} s, "
                  f"process {run.process_s:.2f} s", flush=True)
            out[b].append(run)
    return out


def report(runs: dict[int, list[C.WorkerRun]]) -> None:
    rows = []
    base = next(iter(runs))
    figures: dict[int, tuple[float, float, float]] = {}
    for b, rs in runs.items():
        wall = C.median([r.jobs[0].wall_s for r in rs])
        items = rs[0].jobs[0].items
        tokens = C.median([r.jobs[0].tokens for r in rs])
        spawn = C.median([r.to_last_item_s for r in rs])
        t = rs[0].jobs[0].timings
        figures[b] = (items / wall, tokens / wall, items / spawn)
        rows.append([b, items, int(tokens), wall, items / wall, tokens / wall, spawn,
                     items / spawn, t.get("vision_s", 0.0), rs[0].stat("tower_calls")])
    print()
    print(C.table(["max batch", "items", "tokens", "job s", "items/s", "tok/s",
                   "spawn->last s", "items/s incl. start", "sum vision s", "tower calls"],
                  rows))
    print()
    b_items, b_tok, b_spawn = figures[base]
    for b, (items_s, tok_s, spawn_s) in figures.items():
        if b == base:
            continue
        print(f"ratio max-batch {b}/{base}: items/s x{items_s / b_items:.2f}, "
              f"tok/s x{tok_s / b_tok:.2f}, items/s incl. worker start "
              f"x{spawn_s / b_spawn:.2f}")
    print("(job s = worker-side job wall time, model load excluded; 'sum vision s' adds the "
          "first run's per-item tower times: the tower runs one image at a time at insert, "
          "so that share of the job does not shrink with --max-batch)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with C.redis_url_or_private(args.redis_url) as args.redis_url:
        return run(args)


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    model = C.ensure_model(args.model)
    C.connect(args.redis_url).close()
    with tempfile.TemporaryDirectory(prefix="vlmq-bench-batching-") as tmp:
        workdir = args.workdir or Path(tmp)
        inputs = C.make_inputs(workdir / "inputs", args.items, args.side)
        C.print_header(model, args.items, args.side,
                       f"max {args.max_tokens} new tokens, temperature 0")
        runs = run_batches(args.redis_url, model, inputs, workdir, batches, args.repeat,
                           args.max_tokens, args.side)
    report(runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
