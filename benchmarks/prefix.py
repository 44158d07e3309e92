"""Prefix reuse, side by side in one run, in the engine (no Redis, no worker).

1. The share of an item's time spent in prefill, caption shape (32 new tokens) and OCR
   shape (256), one row at a time: a 1-token request is the prefill; the rest is decode.
2. A first caption pass over N images, then a second pass with a new prompt, and a retry
   of the first pass with a higher max_tokens, for (1) the vision cache only (the tower
   skipped on the second pass; every prompt token prefilled again) and (2) the vision
   cache plus prefix reuse (--prefix-cache-mb). Prints the passes' seconds, the ratios
   (2)/(1) and the prompt tokens prefilled per item, from the engine's own counts.
3. `--server`: the same passes through mlx-vlm's server with APC_ENABLED=1 (system E of
   run.py, benchmarks/server_e.py), timed the same way.

The bench models are random: `bench` (qwen2_vl, whose mlx-vlm template puts the prompt
before the image, so only the retry can reuse) and `bench25` (qwen2_5_vl, image first).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import table
from vlmq.worker.model import blas

CAPTION = "Describe this image in one sentence."
NEW = "Write a short caption for this photo, naming the main object."


def model_path(name: str, root: Path) -> str:
    from vlmq.worker.model.tiny import build_tiny_model

    arch, size = {"bench": ("qwen2_vl", "bench"), "bench25": ("qwen2_5_vl", "bench"),
                  "tiny": ("qwen2_vl", "tiny"), "tiny25": ("qwen2_5_vl", "tiny")}[name]
    return str(build_tiny_model(root / f"{arch}-{size}", arch=arch, seed=0, size=size))


def at_pixels(model: str, side: int, root: Path) -> str:
    """The model with its processor's pixel cap at side x side (the tiny builds cap images
    at 224 x 224, 64 image tokens; 448 px is 256 tokens, as a real Qwen-VL makes it): a
    folder of links to the weights beside a changed preprocessor_config.json."""
    src = Path(model)
    dst = root / f"{src.name}-{side}px"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        target = dst / f.name
        if f.name != "preprocessor_config.json" and not target.exists():
            target.symlink_to(f.resolve())
    pre = json.loads((src / "preprocessor_config.json").read_text())
    pre["max_pixels"] = side * side
    pre["size"] = {**pre.get("size", {}), "longest_edge": side * side}
    (dst / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return str(dst)


def images(n: int, side: int) -> list[Any]:
    from tests.support.factories import random_image

    return [random_image(1000 + i, (side, side)) for i in range(n)]


class Run:
    """One engine and the vision cache a worker would keep beside it (features by image)."""

    def __init__(self, model: str, budget: int, max_batch: int) -> None:
        from mlx_vlm import load

        from vlmq.worker.engine.batcher import Engine

        self.engine = Engine(model, max_batch=max_batch, prefix_cache_bytes=budget)
        self.engine.wait_ready(timeout=600)
        self.model, self.processor = load(model)
        self.features: dict[int, tuple[Any, str, Any]] = {}

    def requests(self, imgs: list[Any], prompt: str, max_tokens: int, tag: str) -> list[Any]:
        from vlmq.worker.engine.batcher import Request
        from vlmq.worker.model import mlx_adapter

        out = []
        for i, img in enumerate(imgs):
            hit = self.features.get(i)
            if hit is not None:
                prep = mlx_adapter.prepare_from_grid(self.processor, self.model.config, hit[2],
                                                     prompt)
                cached: tuple[Any, str] | None = (hit[0], hit[1])
            else:
                prep = mlx_adapter.prepare(self.processor, self.model.config, img, prompt)
                cached = None
            grid = prep.image_grid_thw

            def keep(feats: Any, dtype: str, i: int = i, grid: Any = grid) -> None:
                self.features[i] = (feats, dtype, grid)

            out.append(Request(key=(tag, i), prepared=prep, cached_features=cached,
                               on_features=keep, max_tokens=max_tokens, temperature=0.0,
                               stop=(), prefix_key=f"img-{i}"))
        return out

    def run(self, reqs: list[Any]) -> tuple[float, dict[Any, Any], int]:
        before = self.engine.state.prefill_tokens
        t0 = time.perf_counter()
        for r in reqs:
            self.engine.submit(r)
        got: dict[Any, Any] = {}
        while len(got) < len(reqs):
            for f in self.engine.get_finished(timeout=0.5):
                got[f.key] = f
        return time.perf_counter() - t0, got, self.engine.state.prefill_tokens - before

    def close(self) -> None:
        self.engine.close(timeout=30)


def prefill_share(model: str, imgs: list[Any], shapes: tuple[int, ...],
                  max_batch: int) -> list[list[Any]]:
    """Seconds of a pass of 1-token requests (the prefill) against full passes, the
    images' features cached (as a worker's vision cache holds them), rows batched."""
    run = Run(model, 0, max_batch=max_batch)
    rows = []
    try:
        run.run(run.requests(imgs, CAPTION, 1, "warm"))  # the tower runs once per image
        one, _, _ = run.run(run.requests(imgs, CAPTION, 1, "p"))
        for n in shapes:
            full, got, _ = run.run(run.requests(imgs, CAPTION, n, f"f{n}"))
            toks = sum(f.completion_tokens for f in got.values()) / len(got)
            rows.append([n, round(toks, 1), round(one / len(imgs), 3),
                         round(full / len(imgs), 3), f"{one / full:.0%}"])
    finally:
        run.close()
    return rows


def passes(model: str, imgs: list[Any], budget: int, max_tokens: int,
           max_batch: int) -> dict[str, tuple[float, float]]:
    """(seconds, prompt tokens prefilled per item) of the first pass, the new prompt and
    the retry with twice the tokens."""
    run = Run(model, budget, max_batch)
    out: dict[str, tuple[float, float]] = {}
    try:
        for name, prompt, n in (("first", CAPTION, max_tokens), ("new prompt", NEW, max_tokens),
                                ("retry", CAPTION, 2 * max_tokens)):
            secs, _, prefilled = run.run(run.requests(imgs, prompt, n, name))
            out[name] = (secs, prefilled / len(imgs))
    finally:
        run.close()
    return out


def server_passes(model: str, imgs: list[Any], max_tokens: int,
                  max_batch: int, workdir: Path) -> dict[str, tuple[float, float]]:
    """The same passes through mlx-vlm's server with APC_ENABLED=1, all of a pass's
    requests in flight together (it batches them)."""
    import os

    from benchmarks import server_e

    env = {**os.environ, "APC_ENABLED": "1", "APC_DISK_ENABLED": "0"}
    urls = [server_e.data_url(img) for img in imgs]
    out: dict[str, tuple[float, float]] = {}
    with server_e.Server(model, max_num_seqs=max_batch, max_tokens=2 * max_tokens,
                         log_path=workdir / "server.log", env=env) as srv:
        srv.wait_ready()
        for name, prompt, n in (("first", CAPTION, max_tokens), ("new prompt", NEW, max_tokens),
                                ("retry", CAPTION, 2 * max_tokens)):
            bodies = [server_e.request_body(model, u, prompt, n) for u in urls]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(bodies)) as pool:
                list(pool.map(lambda b: server_e.chat(srv.port, b), bodies))
            out[name] = (time.perf_counter() - t0, float("nan"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bench25",
                        choices=("bench", "bench25", "tiny", "tiny25"))
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--budget-mb", type=int, default=512)
    parser.add_argument("--pixels", type=int, default=448,
                        help="the processor's pixel cap, per side (0: the model's own)")
    parser.add_argument("--share-items", type=int, default=16,
                        help="images for the prefill-share measurement (0: skip it)")
    parser.add_argument("--server", action="store_true",
                        help="also mlx-vlm's server with APC_ENABLED=1 (system E)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    blas.select()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vlmq-prefix-"))
    model = model_path(args.model, Path.home() / ".cache" / "vlmq" / "models")
    if args.pixels:
        model = at_pixels(model, args.pixels, workdir)
    imgs = images(args.items, args.side)
    print(f"model {args.model} ({model}), {args.items} images at {args.side} px, "
          f"{args.max_tokens} new tokens, max batch {args.max_batch}")
    if args.share_items:
        rows = prefill_share(model, imgs[:args.share_items], (32, 256), args.max_batch)
        print(f"\nprefill share, {args.share_items} rows batched\n" + table(
            ["new tokens", "tokens out", "prefill s/item", "item s", "prefill share"], rows))
    systems = {"(1) vision cache only": passes(model, imgs, 0, args.max_tokens, args.max_batch),
               "(2) + prefix reuse": passes(model, imgs, args.budget_mb << 20,
                                            args.max_tokens, args.max_batch)}
    if args.server:
        systems["(3) mlx-vlm server, APC_ENABLED=1"] = server_passes(
            model, imgs, args.max_tokens, args.max_batch, workdir)
    rows = [[name, *(f"{v[0]:.1f}" for v in figs.values()),
             *(f"{v[1]:.0f}" for v in figs.values())] for name, figs in systems.items()]
    print("\npasses: seconds, then prompt tokens prefilled per item\n" + table(
        ["system", "first s", "new prompt s", "retry s", "first tok", "new tok", "retry tok"],
        rows))
    one = systems["(1) vision cache only"]
    for name, figs in systems.items():
        print(f"{name}: new prompt / (1) {figs['new prompt'][0] / one['new prompt'][0]:.2f}, "
              f"retry / (1) {figs['retry'][0] / one['retry'][0]:.2f}")


if __name__ == "__main__":
    main()
