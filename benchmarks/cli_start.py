"""How long `vlmq` takes to start for help and listing commands (the target: under
0.15 s for `vlmq --help`), side by side with the floors: bare Python,
`import click` and `import redis` (which every command that reads Redis pays).

Each command runs RUNS times in a fresh interpreter; the median wall time and the median
CPU time (user + system of the child: on a shared, loaded machine the wall time is the
load's, the CPU time much less so) are printed, with the number of modules it imported.
Run: `python benchmarks/cli_start.py [--runs 10]` with a Redis at $REDIS_URL (default
localhost). Another checkout: put a tree of its packages first on PYTHONPATH (as vlmq/cli,
vlmq/producer, ... links); the script runs `vlmq.cli.main` from whatever is importable.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

RUN = ("import sys\nfrom vlmq.cli.main import main\n"
       "try:\n    main(sys.argv[1:], prog_name='vlmq')\nfinally:\n"
       "    print(len(sys.modules), file=sys.stderr)\n")
COMMANDS = (("--help",), ("--version",), ("jobs", "--help"), ("status", "--help"),
            ("jobs", "--limit", "20"), ("status",), ("result", "0" * 32))
FLOORS = (("python", "pass"), ("import click", "import click"),
          ("import redis", "import redis"))


def measure(argv: list[str], runs: int) -> dict[str, float]:
    wall, cpu, mods = [], [], 0
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        wall.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        tail = proc.stderr.strip().splitlines()[-1:] or ["0"]
        mods = int(tail[0]) if tail[0].isdigit() else 0
    return {"wall_s": round(statistics.median(wall), 3),
            "cpu_s": round(statistics.median(cpu), 3), "modules": mods}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    out: dict[str, dict[str, float]] = {}
    for name, code in FLOORS:
        out[name] = measure([sys.executable, "-c", code], args.runs)
    for command in COMMANDS:
        out["vlmq " + " ".join(command)] = measure(
            [sys.executable, "-c", RUN, *command], args.runs)
    width = max(map(len, out))
    print(f"{'command':<{width}}  wall_s  cpu_s  modules   (median of {args.runs}; "
          f"load {os.getloadavg()[0]:.1f})")
    for name, row in out.items():
        print(f"{name:<{width}}  {row['wall_s']:6.3f}  {row['cpu_s']:5.3f}  {row['modules']:7}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
