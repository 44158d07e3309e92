"""vlmq against the obvious alternatives, on the same items and the same loaded model.

In ONE process, one model load, the same pixels (rendered/decoded exactly as the worker
does), the same prompt, temperature 0:
  (a) sequential `mlx_vlm.generate`, one call per item (what a simple per-job RQ task does);
  (b) one `mlx_vlm.batch_generate` call over all items (it applies the chat template
      itself, has no temperature argument, and batches each same-shape group whole);
  (c) vlmq's Engine driven directly (adapter.prepare on this thread, MLX on its own);
  (d) the full vlmq path: enqueue through Redis, a `vlmq worker --burst` subprocess.
It also checks that (a) and (c) produce identical token ids item by item.

    .venv/bin/python benchmarks/baselines.py
    .venv/bin/python benchmarks/baselines.py --max-tokens 128 --max-batch 16
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import common as C

NOT_RUNNABLE = """\
Not compared here, and why (this machine: Linux x86, 2 CPU cores, no GPU, no network):
  - oMLX: an MLX server for Apple silicon (macOS/Metal only); nothing to install or run here.
  - olmOCR's pipeline: needs CUDA with vLLM (or sglang) and the 7B olmOCR checkpoint from
    the hub; no GPU and no hub access here.
  - RQ-based OCR/caption services: their per-job task is essentially path (a) (load once,
    one generate per item) plus queue overhead; none can be fetched without a network.
So this compares mlx-vlm's own entry points with vlmq's engine and full worker, on one CPU
machine with a tiny random-weight model. It shows relative costs of the code paths, not
the speed of a real model on Apple silicon, where these figures will differ."""


@dataclass
class PathResult:
    name: str
    seconds: float
    items: int
    tokens: int
    note: str = ""
    tokens_per_item: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    C.add_common_args(p)
    p.add_argument("--max-batch", type=int, default=8, help="for (c) and (d)")
    p.add_argument("--skip-worker", action="store_true", help="leave out (d); no Redis needed")
    return p.parse_args(argv)


def run_sequential(model: Any, processor: Any, prompt_text: str, images: list[Any],
                   max_tokens: int) -> PathResult:
    from mlx_vlm import generate

    ids: list[list[int]] = []
    texts: list[str] = []
    t0 = time.perf_counter()
    for img in images:
        r = generate(model, processor, prompt_text, image=[img], max_tokens=max_tokens,
                     temperature=0.0)
        ids.append(list(r.token_ids or []))
        texts.append(r.text)
    dt = time.perf_counter() - t0
    return PathResult("(a) sequential mlx_vlm.generate", dt, len(images),
                      sum(len(t) for t in ids), "1 item at a time", ids, texts)


def run_batch_generate(model: Any, processor: Any, prompt: str, images: list[Any],
                       max_tokens: int) -> tuple[PathResult, list[str]]:
    from mlx_vlm import batch_generate

    t0 = time.perf_counter()
    out = batch_generate(model, processor, images=images, prompts=[prompt] * len(images),
                         max_tokens=max_tokens)
    dt = time.perf_counter() - t0
    return PathResult("(b) mlx_vlm.batch_generate", dt, len(images),
                      int(out.stats.generation_tokens),
                      f"one call; each same-shape group is one batch (here {len(images)})"), \
        list(out.texts)


def run_engine(loaded: Any, prompt: str, images: list[Any], max_tokens: int,
               max_batch: int) -> PathResult:
    """vlmq's Engine on the already loaded model (its loader is stubbed to return it)."""
    from vlmq.worker import mlx_adapter as A
    from vlmq.worker.engine import Engine, Finished, Request

    with mock.patch.object(A, "load_model", lambda _path: loaded):
        engine = Engine(loaded.model_id, max_batch=max_batch)
        engine.wait_ready(timeout=60)
    processor, config = engine.processor, engine.model_config
    done: dict[int, Finished] = {}
    try:
        t0 = time.perf_counter()
        for i, img in enumerate(images):
            prepared = A.prepare(processor, config, img, prompt)
            engine.submit(Request(key=i, prepared=prepared, cached_features=None,
                                  max_tokens=max_tokens, temperature=0.0, stop=()))
        while len(done) < len(images):
            for f in engine.get_finished(timeout=1.0):
                if f.error:
                    raise RuntimeError(f"engine item {f.key} failed: {f.error}")
                done[int(f.key)] = f  # type: ignore[call-overload]
        dt = time.perf_counter() - t0
    finally:
        engine.close(timeout=10)
    ids = [done[i].tokens for i in range(len(images))]
    return PathResult("(c) vlmq Engine, direct", dt, len(images), sum(len(t) for t in ids),
                      f"max batch {max_batch}, prepare on this thread included", ids)


def run_worker(args: argparse.Namespace, model_path: str, inputs: list[Path],
               workdir: Path) -> list[PathResult]:
    run = C.run_burst_worker(args.redis_url, model_path, inputs, max_batch=args.max_batch,
                             cache_dir=workdir / "worker-cache" / "vision",
                             max_tokens=args.max_tokens, side=args.side, label="baseline")
    job = run.jobs[0]
    return [
        PathResult("(d) vlmq worker via Redis", job.wall_s, job.items, job.tokens,
                   f"max batch {args.max_batch}; job wall time, model load excluded"),
        PathResult("(d') same, spawn -> last item", run.to_last_item_s, job.items, job.tokens,
                   "includes interpreter start, imports, model load"),
    ]


def parity(a: list[list[int]], c: list[list[int]], eos: frozenset[int]) -> tuple[int, int, str]:
    """Items whose token ids are identical; a trailing EOS is ignored on both sides."""
    def strip(t: list[int]) -> list[int]:
        return t[:-1] if t and t[-1] in eos else t

    same = sum(1 for x, y in zip(a, c, strict=True) if strip(x) == strip(y))
    first_diff = ""
    for i, (x, y) in enumerate(zip(a, c, strict=True)):
        if strip(x) != strip(y):
            pairs = enumerate(zip(x, y, strict=False))
            k = next((j for j, (p, q) in pairs if p != q), min(len(x), len(y)))
            first_diff = f"first mismatch: item {i} at token {k} ({len(x)} vs {len(y)} tokens)"
            break
    return same, len(a), first_diff


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_path = C.ensure_model(args.model)
    if not args.skip_worker:
        C.connect(args.redis_url).close()

    from vlmq.worker import mlx_adapter as A
    from vlmq.worker.model_defaults import resolve

    with tempfile.TemporaryDirectory(prefix="vlmq-bench-baselines-") as tmp:
        workdir = args.workdir or Path(tmp)
        inputs = C.make_inputs(workdir / "inputs", args.items, args.side)
        images = C.item_images(inputs, args.side)
        print(f"machine: {C.machine()}")
        loaded = A.load_model(model_path)
        model, processor = loaded.model, loaded.processor
        prompt = resolve(loaded.model_type, "ocr", None, args.max_tokens, 0.0, ()).prompt
        prompt_text = A.format_prompt(processor, model.config, prompt, num_images=1)
        print(f"model: {model_path} ({loaded.model_type}); {len(images)} items "
              f"({args.items // 2} PDF pages + {args.items - args.items // 2} images, all "
              f"{images[0].size[0]}x{images[0].size[1]} px), max {args.max_tokens} new "
              f"tokens, temperature 0, OCR prompt")
        eos_before = A.eos_token_ids(processor)

        from mlx_vlm import generate

        # Untimed warm-up so that no path pays first-call costs the others do not.
        generate(model, processor, prompt_text, image=[images[0]], max_tokens=4,
                 temperature=0.0)

        results = [run_sequential(model, processor, prompt_text, images, args.max_tokens)]
        print(f"  {results[-1].name}: {results[-1].seconds:.2f} s", flush=True)
        batch, batch_texts = run_batch_generate(model, processor, prompt, images,
                                                args.max_tokens)
        results.append(batch)
        print(f"  {batch.name}: {batch.seconds:.2f} s", flush=True)
        eos_after = A.eos_token_ids(processor)
        results.append(run_engine(loaded, prompt, images, args.max_tokens, args.max_batch))
        print(f"  {results[-1].name}: {results[-1].seconds:.2f} s", flush=True)
        if not args.skip_worker:
            results.extend(run_worker(args, model_path, inputs, workdir))
            print(f"  {results[-2].name}: {results[-2].seconds:.2f} s", flush=True)

    base = results[0]
    print()
    print(C.table(["path", "items", "tokens", "seconds", "items/s", "tok/s",
                   "items/s vs (a)", "tok/s vs (a)", "note"],
                  [[r.name, r.items, r.tokens, r.seconds, r.items_per_s, r.tokens_per_s,
                    f"x{r.items_per_s / base.items_per_s:.2f}",
                    f"x{r.tokens_per_s / base.tokens_per_s:.2f}", r.note] for r in results]))
    print()
    same, n, diff = parity(results[0].tokens_per_item, results[2].tokens_per_item,
                           eos_before | eos_after)
    print(f"token parity (a) sequential generate vs (c) vlmq Engine: {same}/{n} items with "
          f"identical token ids{'; ' + diff if diff else ''}")
    if eos_before != eos_after:
        print(f"note: mlx_vlm.generate changed the tokenizer's EOS set from "
              f"{sorted(eos_before)} to {sorted(eos_after)} (it resets stopping_criteria)")
    same_text = sum(1 for x, y in zip(results[0].texts, batch_texts, strict=True) if x == y)
    print(f"text parity (a) vs (b) batch_generate (indicative; (b) returns text only): "
          f"{same_text}/{n} items")
    print("notes: (a)-(c) start from already rendered/decoded images and a warmed-up model;"
          "\n  (d) starts from files in Redis, so it also pays blob fetch, PDF render, image "
          "decode\n  and its process's first MLX calls, and it uses the OCR task's stop "
          "strings as a real\n  job does, so its token count can be lower than (a)-(c), "
          "which stop on EOS only.")
    print()
    print(NOT_RUNNABLE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
