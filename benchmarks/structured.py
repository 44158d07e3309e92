"""What does constraining a batch to a JSON Schema cost? The same batch with and without.

1. A batch of 8 extract rows (one schema: a receipt with nested lines, an enum, bounded
   numbers and strings) runs through the engine in-process, each row masked per step by
   its own llguidance matcher (worker/engine/constraints.py).
2. The same 8 rows run unconstrained, each with max_tokens set to the number of tokens its
   constrained run produced, so both runs decode exactly the same number of tokens per row:
   tokens/s compare like with like.

Runs alternate (constrained, unconstrained) `--repeat` times; medians are printed with the
ratio, and the mask's own cost: seconds per row per step inside the engine (from each
row's timings["mask_s"]), and the portable mask alone at a real model's vocabulary size
(151,936, Qwen2-VL's), since the tiny models' vocabulary is small.

    .venv/bin/python benchmarks/structured.py --model bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import common as C
import numpy as np
from PIL import Image

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["vendor", "date", "total", "currency", "lines"],
    "properties": {
        "vendor": {"type": "string", "maxLength": 24},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "total": {"type": "number", "minimum": 0, "maximum": 1000000, "multipleOf": 0.01},
        "currency": {"enum": ["EUR", "USD", "GBP", "CHF"]},
        "lines": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "qty"],
            "properties": {"name": {"type": "string", "maxLength": 16},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 999}}}}}}
REAL_VOCAB = 151_936


def run_batch(engine: Any, reqs: list[Any]) -> tuple[float, dict[Any, Any]]:
    t0 = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    got: dict[Any, Any] = {}
    while len(got) < len(reqs):
        for f in engine.get_finished(timeout=0.5):
            got[f.key] = f
    return time.perf_counter() - t0, got


def portable_mask_s(vocab: int, reps: int = 200) -> float:
    """Seconds per call of the portable mask on one row of `vocab` logits, evaluated."""
    import mlx.core as mx

    from vlmq.worker.engine.constraints import apply_portable

    logits = mx.random.normal((1, vocab))
    bitmask = np.random.default_rng(0).integers(-2**31, 2**31 - 1, (1, (vocab + 31) // 32),
                                                dtype=np.int32)
    mx.eval(apply_portable(logits, bitmask))
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(apply_portable(logits, bitmask))
    return (time.perf_counter() - t0) / reps


def synthetic_fill_us(vocab_size: int = REAL_VOCAB) -> tuple[float, float, int]:
    """llguidance's mask computation per step on a byte-level vocabulary of a real model's
    size (random tokens; the tiny models' is 614): (median, max) microseconds over the
    steps of writing one receipt, and the step count."""
    import random

    import llguidance
    import llguidance.hf
    import llguidance.numpy
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    while len(vocab) < vocab_size - 1:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789\u0120")
                       for _ in range(rng.randint(2, 9)))
        vocab.setdefault(word, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    lt = llguidance.hf.from_tokenizer(hf)
    grammar = llguidance.JsonCompiler(separators=(", ", ": "),
                                      whitespace_pattern="").compile(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(lt, grammar)
    bitmask = np.full((1, (lt.vocab_size + 31) // 32), -1, dtype=np.int32)
    text = ('{"vendor": "corner shop", "date": "2024-01-31", "total": 12.5, "currency": '
            '"EUR", "lines": [{"name": "tea", "qty": 2}, {"name": "milk", "qty": 1}]}')
    steps = []
    for token in hf.encode(text, add_special_tokens=False):
        t0 = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        steps.append(time.perf_counter() - t0)
        if not matcher.consume_token(token):
            raise RuntimeError(f"the sample value broke the grammar: {matcher.get_error()}")
    return statistics.median(steps) * 1e6, max(steps) * 1e6, len(steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench", help="tiny, bench, or a model folder/hub id")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--side", type=int, default=224)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    from vlmq.worker.model import blas

    blas.select()
    from mlx_vlm import load

    from vlmq.worker.engine.batcher import Engine, Request
    from vlmq.worker.engine.constraints import Structured
    from vlmq.worker.model import mlx_adapter

    model_path = C.resolve_model(args.model)
    print(f"machine: {C.machine()}\nmodel: {model_path}; {args.rows} rows at {args.side} px")
    model, processor = load(model_path)
    structured = Structured(processor.tokenizer, mlx_adapter.eos_token_ids(processor))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (args.side, args.side, 3), dtype=np.uint8))
              for _ in range(args.rows)]
    preps = [mlx_adapter.prepare(processor, model.config, im, "Extract the receipt as JSON.")
             for im in images]
    engine = Engine(model_path, max_batch=args.rows)
    engine.wait_ready(timeout=300)

    def constrained() -> list[Any]:
        return [Request(key=i, prepared=pr, cached_features=None, max_tokens=args.max_tokens,
                        temperature=0.0, stop=(), constraint=structured.row(SCHEMA))
                for i, pr in enumerate(preps)]

    run_batch(engine, constrained())  # warm: compile, first-call costs
    on_rates, off_rates, mask_steps = [], [], []
    lengths: list[int] = []
    failed = 0
    for _ in range(args.repeat):
        wall, got = run_batch(engine, constrained())
        lengths = [got[i].completion_tokens for i in range(args.rows)]
        failed += sum(1 for f in got.values() if f.error)
        on_rates.append(sum(lengths) / wall)
        mask_steps += [got[i].timings["mask_s"] / max(1, lengths[i]) for i in range(args.rows)]
        plain = [Request(key=i, prepared=pr, cached_features=None, max_tokens=lengths[i],
                         temperature=0.0, stop=(), constraint=None)
                 for i, pr in enumerate(preps)]
        wall, got = run_batch(engine, plain)
        off_rates.append(sum(f.completion_tokens for f in got.values()) / wall)
    engine.close(timeout=30)
    on, off = statistics.median(on_rates), statistics.median(off_rates)
    per_step = statistics.median(mask_steps)
    real = portable_mask_s(REAL_VOCAB)
    fill_med, fill_max, fill_steps = synthetic_fill_us()
    print(C.table(["batch", "tok/s (median)", "tokens per row"],
                  [["constrained", on, lengths], ["unconstrained", off, lengths]]))
    print(f"constrained/unconstrained tok/s: {on / off:.3f} (target >= 0.85); "
          f"{failed} constrained row(s) failed")
    print(f"mask per row per step in the engine: {per_step * 1e6:.0f} us (vocabulary "
          f"{structured.tokenizer.vocab_size}); portable mask alone at {REAL_VOCAB} ids: "
          f"{real * 1e6:.0f} us")
    print(f"llguidance mask per step at {REAL_VOCAB} ids (synthetic byte-level vocabulary, "
          f"{fill_steps} steps of one receipt): median {fill_med:.0f} us, max {fill_max:.0f} us")
    C.emit_json({"rows": args.rows, "tok_s_constrained": round(on, 1),
                 "tok_s_unconstrained": round(off, 1), "ratio": round(on / off, 3),
                 "mask_us_per_row_step": round(per_step * 1e6, 1),
                 "portable_mask_us_at_151936": round(real * 1e6, 1),
                 "llguidance_fill_us_at_151936": {"median": round(fill_med, 1),
                                                  "max": round(fill_max, 1)},
                 "tokens_per_row": lengths, "failed": failed}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
