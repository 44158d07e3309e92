"""What does a hostile schema cost the innocent rows beside it? Alone, beside, and unbudgeted.

An innocent extract batch (`--rows` receipts) runs through the engine in-process, three ways
in one run:
1. alone;
2. beside `--attackers` rows whose schema is the pattern `^(a{700}){700}$` (about 1 s to
   build and 0.15-0.45 s a mask step), with the matcher's budgets as the worker runs them
   (worker/engine/constraints.py: built on a prep thread within BUILD_BUDGET_S, each step within
   STEP_BUDGET_S);
3. beside the same attackers with the budgets lifted, which is how every step used to pay
   for them.
The attackers' rows are built on a thread, as the worker's prep threads do, while the
innocent batch runs. Printed: the innocent batch's wall time each way and the ratios to
alone (the issue's bound: beside/alone <= 1.5), and whether the innocent tokens changed.

    .venv/bin/python benchmarks/containment.py --model bench
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

import common as C
import numpy as np
from PIL import Image
from structured import SCHEMA, run_batch  # a sibling script

HOSTILE = {"type": "string", "pattern": "^(a{700}){700}$"}
# Within the build budget and the fuel, but 0.05-0.1 s a mask step: cut by the step budget.
COSTLY = {"type": "string", "pattern": "^(a{300}){300}$"}


def _fate(f: Any) -> str:
    return f"ended: {(f.error or f.finish_reason)[:60]}..."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench", help="tiny, bench, or a model folder/hub id")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--attackers", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--side", type=int, default=224)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    from vlmq.worker.model import blas

    blas.select()
    from mlx_vlm import load

    from vlmq.worker.engine import constraints
    from vlmq.worker.engine.batcher import Engine, Request
    from vlmq.worker.model import mlx_adapter

    model_path = C.resolve_model(args.model)
    print(f"machine: {C.machine()}\nmodel: {model_path}; {args.rows} innocent rows, "
          f"{args.attackers} attackers ({HOSTILE['pattern']}) at {args.side} px")
    model, processor = load(model_path)
    rng = np.random.default_rng(0)
    def noise() -> Image.Image:
        return Image.fromarray(rng.integers(0, 256, (args.side, args.side, 3), dtype=np.uint8))

    preps = [mlx_adapter.prepare(processor, model.config, noise(), "Extract the receipt as JSON.")
             for _ in range(args.rows + args.attackers)]
    engine = Engine(model_path, max_batch=args.rows + args.attackers)
    engine.wait_ready(timeout=300)

    def innocents(structured: Any) -> list[Any]:
        return [Request(key=i, prepared=preps[i], cached_features=None,
                        max_tokens=args.max_tokens, temperature=0.0, stop=(),
                        constraint=structured.row(SCHEMA)) for i in range(args.rows)]

    def attack(structured: Any, step_budget_s: float, schema: dict[str, str]) -> list[str]:
        """Build and submit the attackers' rows on a thread, as prep does; their fate."""
        fates: list[str] = []
        for k in range(args.attackers):
            try:
                row = structured.row(schema)
            except constraints.ConstraintError as exc:
                fates.append(f"refused at build: {str(exc)[:48]}...")
                continue
            row.step_budget_s = step_budget_s
            engine.submit(Request(key=("attacker", k), prepared=preps[args.rows + k],
                                  cached_features=None, max_tokens=args.max_tokens,
                                  temperature=0.0, stop=(), constraint=row))
            fates.append("in the batch")
        return fates

    def beside(budgeted: bool, schema: dict[str, str] = HOSTILE
               ) -> tuple[float, dict[Any, Any], list[str]]:
        names = ("BUILD_BUDGET_S", "INITIAL_LEXER_FUEL", "STEP_LEXER_FUEL", "MAX_LEXER_STATES")
        saved = {n: getattr(constraints, n) for n in names}
        if not budgeted:  # no time budget, and llguidance's own default limits
            for n, v in zip(names, (1e9, 1_000_000, 200_000, 250_000), strict=True):
                setattr(constraints, n, v)
        try:
            structured = constraints.Structured(processor.tokenizer,
                                                mlx_adapter.eos_token_ids(processor))
            fates: list[str] = []
            builder = threading.Thread(target=lambda: fates.extend(
                attack(structured, constraints.STEP_BUDGET_S if budgeted else 1e9, schema)))
            builder.start()
            wall, got = run_batch(engine, innocents(structured))
            builder.join()
            time.sleep(0.2)
            while len(got) < args.rows + sum(f == "in the batch" for f in fates):
                for f in engine.get_finished(timeout=1.0):
                    got[f.key] = f
            fates = [f"{f}, {_fate(got[('attacker', k)])}" if f == "in the batch" else f
                     for k, f in enumerate(fates)]
            return wall, got, fates
        finally:
            for n, v in saved.items():
                setattr(constraints, n, v)

    warm = constraints.Structured(processor.tokenizer, mlx_adapter.eos_token_ids(processor))
    run_batch(engine, innocents(warm))
    alone_s, alone = run_batch(engine, innocents(warm))
    on_s, on, on_fates = beside(budgeted=True)
    off_s, off, off_fates = beside(budgeted=False)
    mid_s, mid, mid_fates = beside(budgeted=True, schema=COSTLY)
    engine.close(timeout=30)
    same_on = all(on[i].tokens == alone[i].tokens for i in range(args.rows))
    same_off = all(off[i].tokens == alone[i].tokens for i in range(args.rows))
    same_mid = all(mid[i].tokens == alone[i].tokens for i in range(args.rows))
    print(C.table(["innocent batch", "wall s", "x alone", "same tokens", "attackers"],
                  [["alone", alone_s, 1.0, "-", "-"],
                   ["beside, budgeted", on_s, on_s / alone_s, same_on, "; ".join(on_fates)],
                   ["beside, no budget", off_s, off_s / alone_s, same_off,
                    "; ".join(off_fates)],
                   [f"beside {COSTLY['pattern']}, budgeted", mid_s, mid_s / alone_s, same_mid,
                    "; ".join(mid_fates)]]))
    print(f"beside/alone with the budgets: {on_s / alone_s:.2f} (bound 1.5); without: "
          f"{off_s / alone_s:.2f}")
    C.emit_json({"alone_s": round(alone_s, 3), "budgeted_s": round(on_s, 3),
                 "unbudgeted_s": round(off_s, 3), "ratio_budgeted": round(on_s / alone_s, 3),
                 "ratio_unbudgeted": round(off_s / alone_s, 3), "same_tokens": same_on,
                 "ratio_step_budget": round(mid_s / alone_s, 3)},
                args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
