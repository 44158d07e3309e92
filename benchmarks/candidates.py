"""Optimisations that batching on a fast BLAS might make pay; measured, not yet built.

In one process, on the same items (same-shape photos, as pages of one scanned batch are):
  1. vision tower: one call per image (the engine today) against one call for N images;
  2. per-step overhead: the vlmq Engine against mlx-vlm's BatchGenerator driven bare with
     the same inputs (what the engine adds per decode step: bookkeeping, stop strings,
     emitting results);
  3. the prep pool: how long `prepare` takes per item with 1, 2 and 4 threads.

    python benchmarks/candidates.py --model bench
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C
import run as R


def timed(fn: Any, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench", help="tiny, bench or a model folder")
    p.add_argument("--items", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    from vlmq.worker.model import blas

    chosen = blas.select()
    import mlx.core as mx
    from mlx_vlm.generate import BatchGenerator

    from vlmq.worker.engine.batcher import Engine, Request
    from vlmq.worker.model import mlx_adapter
    from vlmq.worker.model.defaults import resolve

    print(f"0. float32 (b x 512) @ (512 x 1408), GFLOP/s, OpenBLAS threads 1 vs {blas.cores()}:")
    w = mx.random.normal((512, 1408))
    for threads in sorted({1, blas.cores()}):
        if not blas.set_threads(threads):
            print("   (no OpenBLAS loaded)")
            break
        row = []
        for b in (1, 8, 32):
            x = mx.random.normal((b, 512))
            mx.eval(x @ w)
            reps = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 1.0:
                mx.eval(x @ w)
                reps += 1
            row.append(f"b={b}: {2 * b * 512 * 1408 * reps / (time.perf_counter() - t0) / 1e9:.1f}")
        print(f"   {threads} thread(s): " + ", ".join(row))
    blas.set_threads(chosen.threads or blas.cores())

    model_path = C.resolve_model(args.model)
    print(f"machine: {C.machine()}\nBLAS: {chosen.describe()}\nmodel: {model_path}")
    loaded = mlx_adapter.load_model(model_path)
    model, processor, config = loaded.model, loaded.processor, loaded.model.config
    prompt = resolve(loaded.model_type, "ocr", None, args.max_tokens, 0.0, ()).prompt
    images = [R._photo(500 + i, R.PHOTO_SIZES[0]) for i in range(args.items)]
    prepared = [mlx_adapter.prepare(processor, config, im, prompt) for im in images]
    n = len(prepared)

    # 1. vision tower
    def per_image() -> list[Any]:
        return [mlx_adapter.vision_features(model, pr) for pr in prepared]

    def one_call() -> Any:
        dtype = model.vision_tower.patch_embed.proj.weight.dtype
        pix = mx.concatenate([mx.array(pr.pixel_values) for pr in prepared]).astype(dtype)
        grid = mx.concatenate([mx.array(pr.image_grid_thw) for pr in prepared])
        feats = model.vision_tower(pix, grid, output_hidden_states=False)
        mx.eval(feats)
        return feats

    per_image()  # warm-up
    one = np.array(one_call())
    sep = np.concatenate([np.array(f) for f in per_image()])
    t_sep, t_one = timed(per_image, args.repeat), timed(one_call, args.repeat)
    print(f"\n1. vision tower, {n} images of {images[0].size[0]}x{images[0].size[1]} px "
          f"({prepared[0].pixel_values.shape[0]} patches each):")
    print(f"   one call per image: {1000 * t_sep / n:.1f} ms/image; one call for all: "
          f"{1000 * t_one / n:.1f} ms/image (x{t_sep / t_one:.2f}); max |diff| "
          f"{float(np.abs(one - sep).max()):.2e}")

    # 2. per-step overhead: bare BatchGenerator vs the Engine, same inserted rows
    def bare() -> int:
        # Tower and embeddings included, as in the engine (one image at a time).
        kwargs = [mlx_adapter.build_prompt_kwargs(model, processor, pr,
                                                  mlx_adapter.vision_features(model, pr))
                  for pr in prepared]
        gen = BatchGenerator(model.language_model, processor, completion_batch_size=2 * n,
                             prefill_batch_size=n, compute_logprobs=False)
        gen.insert([ids for ids, _ in kwargs], max_tokens=[args.max_tokens] * n,
                   prompt_kwargs=[kw for _, kw in kwargs])
        tokens, done = 0, 0
        while done < n:
            _, responses = gen.next()
            for r in responses:
                tokens += 1
                done += r.finish_reason is not None
        gen.close()
        return tokens

    bare()
    t_bare = timed(bare, args.repeat)
    engine = Engine(model_path, max_batch=n)
    engine.wait_ready(timeout=300)
    eng_prepared = [mlx_adapter.prepare(engine.processor, engine.model_config, im, prompt)
                    for im in images]

    def through_engine() -> None:
        for i, pr in enumerate(eng_prepared):
            engine.submit(Request(key=i, prepared=pr, cached_features=None,
                                  max_tokens=args.max_tokens, temperature=0.0, stop=()))
        got = 0
        while got < n:
            got += len(engine.get_finished(timeout=1.0))

    through_engine()
    tokens0 = engine.state.tokens_generated
    t_eng = timed(through_engine, args.repeat)
    eng_tokens = (engine.state.tokens_generated - tokens0) // args.repeat
    engine.close(timeout=30)
    print(f"\n2. {n} rows, {args.max_tokens} new tokens, all inserted at once:")
    print(f"   bare BatchGenerator (same tower and embedding calls, then one insert): "
          f"{t_bare:.2f} s; vlmq Engine (items submitted together): {t_eng:.2f} s "
          f"({eng_tokens} tokens); engine/bare x{t_eng / t_bare:.2f}")

    # 3. prep pool
    print(f"\n3. prepare() for {n} items (decode done; processor + tokenizer):")
    for threads in (1, 2, 4):
        def prep(threads: int = threads) -> None:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda im: mlx_adapter.prepare(processor, config, im, prompt),
                              images))
        print(f"   {threads} threads: {1000 * timed(prep, args.repeat) / n:.1f} ms/item")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
