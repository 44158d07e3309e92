"""`vlmq model check`: can this model be served batched, exactly, and how fast?

The first command to run on a new model. It runs synthetic images (2 sizes)
sequentially through mlx-vlm's own `stream_generate` (the reference a user would
trust), frees that copy, then runs them through the worker's engine, 2 together
and then `max_batch` together, and compares token ids. It also reports what the
family file says (vision cache, batching limits), the preset jobs will get, and
tokens/s at batch 1 and batched.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from vlmq.worker.engine.batcher import Engine, Finished, Request
from vlmq.worker.model import mlx_adapter
from vlmq.worker.model.defaults import preset_for, resolve
from vlmq.worker.model.families import FamilySpec

CHECK_PROMPT = "Describe this image."
# Two sizes, so rows of one batch have different prompt lengths (the hard case).
_SIZES = ((448, 320), (448, 448), (320, 448), (384, 384))


@dataclass
class CheckReport:
    model: str
    model_type: str
    family: FamilySpec
    preset: str
    parity: bool
    mismatches: list[str] = field(default_factory=list)
    tok_s: dict[int, float] = field(default_factory=dict)  # batch size -> tokens/s

    def as_json(self) -> dict[str, Any]:
        """The report as `vlmq model check --json` prints it: the same facts as lines(),
        each a field a script can test (tok_s by "sequential" and "batch_N")."""
        fam = self.family
        return {
            "model": self.model, "model_type": self.model_type, "parity": self.parity,
            "mismatches": list(self.mismatches),
            "prefill_one_at_a_time": fam.prefill_one,
            "vision_cache": {"cacheable": fam.cacheable, "why_not": fam.cache_off},
            "preset": self.preset,
            "tok_s": {("sequential" if b == 0 else f"batch_{b}"): round(v, 3)
                      for b, v in sorted(self.tok_s.items())},
        }

    def lines(self) -> list[str]:
        fam = self.family
        cache = "yes" if fam.cacheable else f"no ({fam.cache_off})"
        if fam.prefill_one:
            batching = f"yes, prefill one prompt at a time ({fam.prefill_one})"
        else:
            batching = "yes"
        out = [
            f"model:           {self.model}",
            f"family:          {self.model_type}",
            f"batching:        {batching}",
            f"batched parity:  {'PASS' if self.parity else 'FAIL'}",
            *(f"  {m}" for m in self.mismatches),
            f"vision cache:    {cache}",
            f"preset:          {self.preset}",
        ]
        for b, v in sorted(self.tok_s.items()):
            label = "sequential generate" if b == 0 else f"engine, batch {b}"
            out.append(f"tok/s {label + ':':<22}{v:.1f}")
        return out


def sample_images(n: int) -> list[Image.Image]:
    """Distinct page-like images with text on them, in two sizes."""
    images = []
    for i in range(n):
        w, h = _SIZES[i % len(_SIZES)]
        rng = np.random.default_rng(1000 + i)
        img = Image.fromarray(rng.integers(200, 256, (h, w, 3), dtype=np.uint8))
        draw = ImageDraw.Draw(img)
        for line in range(6):
            draw.text((20, 20 + 40 * line), f"Line {line + 1} of sample {i + 1}: {i * 37 + line}",
                      fill=(0, 0, 0))
        draw.rectangle([w // 2, h // 2, w // 2 + 40 + 10 * i, h // 2 + 30], fill=(30, 60, 200))
        images.append(img)
    return images


def _strip_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def reference_tokens(model_path: str, images: list[Image.Image],
                     max_tokens: int) -> tuple[list[list[int]], float, str]:
    """Sequential mlx_vlm.stream_generate per image: token ids, tokens/s, model type."""
    import importlib

    import mlx.core as mx

    vlm: Any = importlib.import_module("mlx_vlm")  # untyped entry points
    model, processor = vlm.load(model_path)
    eos = mlx_adapter.eos_token_ids(processor)
    model_type = str(model.config.model_type)
    out, n_tokens, elapsed = [], 0, 0.0
    for image in images:
        text = mlx_adapter.format_prompt(processor, model.config, CHECK_PROMPT, num_images=1)
        t0 = time.perf_counter()
        *_, last = vlm.stream_generate(model, processor, text, image=[image],
                                       max_tokens=max_tokens, temperature=0.0)
        elapsed += time.perf_counter() - t0
        tokens = list(last.token_ids)
        n_tokens += len(tokens)
        out.append(_strip_eos(tokens, eos))
    del model, processor
    gc.collect()
    mx.clear_cache()
    return out, n_tokens / max(elapsed, 1e-9), model_type


def _run(engine: Engine, images: list[Image.Image], max_tokens: int,
         together: bool) -> tuple[list[Finished], float]:
    """Items through the engine, all at once or one after another; results, tokens/s."""
    def submit(i: int, image: Image.Image) -> None:
        prep = mlx_adapter.prepare(engine.processor, engine.model_config, image, CHECK_PROMPT)
        engine.submit(Request(key=i, prepared=prep, cached_features=None,
                              max_tokens=max_tokens, temperature=0.0, stop=()))

    def collect(n: int) -> list[Finished]:
        got: list[Finished] = []
        while len(got) < n:
            got += engine.get_finished(1.0)
        return got

    t0 = time.perf_counter()
    done: list[Finished] = []
    if together:
        for i, image in enumerate(images):
            submit(i, image)
        done = collect(len(images))
    else:
        for i, image in enumerate(images):
            submit(i, image)
            done += collect(1)
    elapsed = time.perf_counter() - t0
    errors = [f.error for f in done if f.error]
    if errors:
        raise RuntimeError(f"engine failed an item: {errors[0]}")
    done.sort(key=lambda f: int(f.key))  # type: ignore[call-overload]
    return done, sum(f.completion_tokens for f in done) / max(elapsed, 1e-9)


def check_model(model_path: str, *, max_tokens: int = 32, max_batch: int = 4) -> CheckReport:
    """Load, compare batched with sequential output on 2 images, measure speed."""
    images = sample_images(max(2, max_batch))
    folder = mlx_adapter.model_folder(model_path)  # refuses unverified families before any load
    expected, seq_tok_s, model_type = reference_tokens(str(folder), images, max_tokens)
    engine = Engine(model_path, max_batch=max_batch)
    try:
        info = engine.wait_ready()
        eos = mlx_adapter.eos_token_ids(engine.processor)
        pair, _ = _run(engine, images[:2], max_tokens, together=True)
        _, tok_b1 = _run(engine, images[:2], max_tokens, together=False)
        full, tok_bn = _run(engine, images, max_tokens, together=True)
    finally:
        engine.close(timeout=60)
    mismatches = []
    for size, run in ((2, pair), (len(images), full)):
        for i, fin in enumerate(run):
            want, got = expected[i], _strip_eos(list(fin.tokens), eos)
            if got != want:
                at = next((k for k, (a, b) in enumerate(zip(want, got, strict=False))
                           if a != b), min(len(want), len(got)))
                mismatches.append(f"image {i + 1} in a batch of {size}: differs from "
                                  f"sequential generate at token {at}")
    preset = preset_for(model_type, model_path)
    row = resolve(model_type, "ocr", None, None, None, None, model_id=model_path)
    preset_text = (f"{preset.name} ({preset.source})" if preset is not None
                   else f"model type {model_type} defaults")
    preset_text += f"; OCR prompt {row.prompt!r}, max_tokens {row.max_tokens}"
    return CheckReport(model=model_path, model_type=info.model_type,
                       family=mlx_adapter.family_of(info.model_type), preset=preset_text,
                       parity=not mismatches, mismatches=mismatches,
                       tok_s={0: seq_tok_s, 1: tok_b1, max_batch: tok_bn})

