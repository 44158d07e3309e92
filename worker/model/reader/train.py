"""Train the reader: `python -m vlmq.worker.model.reader.train OUT_DIR`.

A plain MLX loop (nn.value_and_grad, Adam) with teacher forcing and cross-entropy on
the answer tokens only. Every input goes through the worker's own preparation
(mlx_adapter.prepare: the family's chat template, the processor's resize, the
default OCR prompt), so what the model learns is exactly what a worker shows it.
Seeded: the same seed and settings give the same run (on one machine; BLAS thread
counts may change the last bits). Cost measured on 2 CPU cores shared with other work
(load 5-14): 1.5 to 8 s per step of 16 pages, so the default 900 steps take 25 to 120
minutes. The shipped weights (worker/model/reader/weights) came from three stages:
  train OUT1 --grow 10 --lr 5e-4 --warmup 20 --steps 400 --minutes 26   (stopped at 300)
  train OUT2 --resume OUT1/last --grow 1 --lr 5e-4 --warmup 5 --steps 700 --minutes 22
  train OUT3 --resume OUT2/best --grow 1 --lr 2e-4 --final-lr 2e-5 --warmup 10
        --steps 900 --minutes 23 --eval-every 50 --data-seed 4
keeping OUT3/best (step 900): held-out CER 0.7% on 32 pages there; through a real worker
(benchmarks/reader.py) 2.0% on 32 pages, 1.8% on 128, and 1.4% on the demo's sample.
Stage 1 reads nothing (held-out CER 0.87-0.90: the language prior); stage 2's CER went
0.90, 0.67, 0.27, 0.17, 0.10, 0.073, 0.086 at steps 100-700 (OUT2/best: step 600, 6.7%
through the worker). Stage 3 (12.7 minutes, 0.8 s/step on a quiet machine) went 0.18,
0.10, 0.060, 0.045, 0.048, 0.032, 0.036, 0.023, 0.013, 0.018, 0.013, 0.013, 0.0096, 0.010,
0.007, 0.007, 0.007, 0.007 at steps 50-900 (the early rise from 0.073: Adam starts afresh,
its state is not saved). Give a resumed stage its own --data-seed, or it re-draws the
first stage's pages (a stage at lr 3e-4 that did so had got worse at its step 100: 0.126).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from vlmq.worker.model import blas
from vlmq.worker.model.families.qwen2_vl import FAMILY
from vlmq.worker.model.reader import build, data

SEED = 0
HELD_OUT_SEED = 10_000_019  # pages of this seed are never drawn in training


def ocr_prompt() -> str:
    prompt = FAMILY.defaults["ocr"].prompt
    assert prompt is not None
    return prompt


def batch(processor: Any, config: Any, pages: list[data.Page]) -> dict[str, Any]:
    """Inputs, targets and the answer mask for one batch, through the worker's preparation."""
    import mlx.core as mx

    from vlmq.worker.model import mlx_adapter

    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    rows, starts = [], []
    pixels: list[np.ndarray] = []
    grids: list[np.ndarray] = []
    for p in pages:
        prep = mlx_adapter.prepare(processor, config, p.image, ocr_prompt())
        assert prep.input_ids is not None and prep.pixel_values is not None
        assert prep.image_grid_thw is not None
        answer = processor.tokenizer(p.text, add_special_tokens=False)["input_ids"]
        rows.append([*prep.input_ids.tolist(), *answer, end])
        starts.append(len(prep.input_ids))
        pixels.append(prep.pixel_values)
        grids.append(prep.image_grid_thw)
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, dtype=np.int32)
    mask = np.zeros((len(rows), width - 1), dtype=np.float32)
    for k, r in enumerate(rows):
        ids[k, :len(r)] = r
        mask[k, starts[k] - 1:len(r) - 1] = 1.0  # predict each answer token and the end
    image = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    prefix = int(np.argmax(ids[0] == image))
    assert (ids[:, :prefix] == ids[:1, :prefix]).all()
    return {"ids": mx.array(ids), "mask": mx.array(mask), "prefix": prefix,
            "pixels": mx.array(np.concatenate(pixels)), "grid": mx.array(np.concatenate(grids))}


def loss_fn(model: Any, b: dict[str, Any]) -> Any:
    import mlx.core as mx
    import mlx.nn as nn

    emb = model.get_input_embeddings(b["ids"], b["pixels"], image_grid_thw=b["grid"])
    out = model.language_model(b["ids"], inputs_embeds=emb.inputs_embeds,
                               position_ids=emb.position_ids)
    logits = out.logits[:, :-1, :]
    ce = nn.losses.cross_entropy(logits, b["ids"][:, 1:], reduction="none")
    return mx.sum(ce * b["mask"]) / mx.sum(b["mask"])


class _Shared:
    """A KV cache for the prompt's common prefix: its keys and values are computed once
    (batch 1) and shared by every row. The prefix (system turn, instruction, up to the
    image) is the same tokens for every page and attention is causal, so this is the
    full forward's arithmetic at about half its cost."""

    def __init__(self) -> None:
        self.keys: Any = None
        self.values: Any = None
        self.offset = 0

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        if self.keys is None:
            self.keys, self.values, self.offset = keys, values, keys.shape[2]
            return keys, values
        n = keys.shape[0]
        k = mx.broadcast_to(self.keys, (n, *self.keys.shape[1:]))
        v = mx.broadcast_to(self.values, (n, *self.values.shape[1:]))
        return mx.concatenate([k, keys], axis=2), mx.concatenate([v, values], axis=2)


def fast_loss_fn(model: Any, b: dict[str, Any]) -> Any:
    """`loss_fn` with the common prefix run once (see _Shared)."""
    import mlx.core as mx
    import mlx.nn as nn

    emb = model.get_input_embeddings(b["ids"], b["pixels"], image_grid_thw=b["grid"])
    lm = model.language_model
    core = lm.model
    p = b["prefix"]
    h, pos = emb.inputs_embeds, emb.position_ids
    caches = [_Shared() for _ in core.layers]
    rope = core.layers[0].self_attn.rotary_emb
    head = h[:1, :p]
    head_pe = rope(head, pos[:, :1, :p])
    for layer, c in zip(core.layers, caches, strict=True):
        head = layer(head, "causal", c, None, head_pe)
    tail = h[:, p:]
    n = tail.shape[1]
    mask = mx.arange(p + n)[None, :] <= (p + mx.arange(n))[:, None]
    tail_pe = rope(tail, pos[:, :, p:])
    for layer, c in zip(core.layers, caches, strict=True):
        tail = layer(tail, mask, c, None, tail_pe)
    logits = lm.lm_head(core.norm(tail))[:, :-1, :]
    ce = nn.losses.cross_entropy(logits, b["ids"][:, p + 1:], reduction="none")
    m = b["mask"][:, p:]
    return mx.sum(ce * m) / mx.sum(m)


def aim(model: Any, processor: Any, strength: float = 4.0) -> int:
    """Start two heads of the first layer looking where the next character is.

    Character k sits in image column k (data.py), and M-RoPE puts the token that
    predicts it a fixed distance d (in the width section) after that column. Biases of
    q and k that are constant over tokens make a head's score depend on position alone:
    q's width pairs set to a*(cos d*f, -+sin d*f) against k's (a, 0) give sum a^2*cos(f*(D-d))
    over the width frequencies f, highest at distance D == d. From random init the model
    takes hours of CPU to find this alignment; given it, training only has to learn to
    read glyphs. Returns d."""
    import mlx.core as mx

    b = batch(processor, model.config, data.pages(0, 1))
    emb = model.get_input_embeddings(b["ids"], b["pixels"], image_grid_thw=b["grid"])
    width = emb.position_ids[2, 0]
    query = int(np.argmax(np.asarray(b["mask"][0]) > 0))  # the token predicting character 0
    d = int(width[query].item() - width[b["prefix"]].item())
    attn = model.language_model.model.layers[0].self_attn
    cfg = model.config.text_config
    half = attn.head_dim // 2
    t, h, _ = cfg.rope_scaling["mrope_section"]
    j = np.arange(t + h, half)  # the width section's rotary pairs
    f = 1.0 / (float(cfg.rope_theta) ** (2.0 * j / attn.head_dim))
    qb = np.array(attn.q_proj.bias)
    kb = np.array(attn.k_proj.bias)
    for head, sign in ((0, -1.0), (1, 1.0)):  # the query heads of key head 0; one of the
        base = head * attn.head_dim            # two rotation senses looks back, not ahead
        qb[base + j] = strength * np.cos(d * f)
        qb[base + half + j] = sign * strength * np.sin(d * f)
    kb[j] = strength
    kb[half + j] = 0.0
    attn.q_proj.bias = mx.array(qb)
    attn.k_proj.bias = mx.array(kb)
    return d


def read(model: Any, processor: Any, image: Any, max_tokens: int = 96) -> str:
    """Greedy text for one page (mlx-vlm's generate_step on the worker's preparation)."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    from vlmq.worker.model import mlx_adapter

    prep = mlx_adapter.prepare(processor, model.config, image, ocr_prompt())
    assert prep.input_ids is not None and prep.pixel_values is not None
    assert prep.image_grid_thw is not None
    stops = mlx_adapter.eos_token_ids(processor)
    out: list[int] = []
    for token, _ in generate_step(mx.array(prep.input_ids)[None], model,
                                  mx.array(prep.pixel_values), None, max_tokens=max_tokens,
                                  temperature=0.0,
                                  image_grid_thw=mx.array(prep.image_grid_thw)):
        t = int(token)
        if t in stops:
            break
        out.append(t)
    return str(processor.tokenizer.decode(out))


def held_out_cer(model: Any, processor: Any, n: int) -> float:
    pages = data.pages(HELD_OUT_SEED, n)
    return float(np.mean([data.cer(read(model, processor, p.image), p.text) for p in pages]))


def save(model: Any, src: Path, dst: Path) -> None:
    """The checkpoint folder: the untrained one's configs and tokenizer, trained weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dst / f.name)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--grow", type=int, default=25,
                    help="curriculum: lines grow by one character every this many steps")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-pages", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: no limit)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--data-seed", type=int, default=None,
                    help="seed of the page stream (default: --seed); a resumed stage wants a "
                         "fresh one, or it re-draws the pages the first stage saw")
    ap.add_argument("--final-lr", type=float, default=None,
                    help="where the cosine decay ends (default: lr / 20)")
    ap.add_argument("--resume", type=Path, default=None,
                    help="start from this checkpoint folder's weights (no aim)")
    ap.add_argument("--no-aim", dest="aim", action="store_false",
                    help="leave the first layer's heads at random init (see aim())")
    args = ap.parse_args(argv)
    blas.select()
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx.nn.utils import value_and_grad
    from mlx_vlm.utils import load

    init = args.out / "init"
    build.write_checkpoint(init, args.seed)
    model, processor = load(str(init))
    if args.resume is not None:  # a second stage: that run's weights, its curriculum done
        model.load_weights(str(args.resume / "model.safetensors"))
    elif args.aim:
        print(json.dumps({"aimed_offset": aim(model, processor)}), flush=True)
    model.train()
    sched = optim.join_schedules(
        [optim.linear_schedule(1e-5, args.lr, args.warmup),
         optim.cosine_decay(args.lr, max(1, args.steps - args.warmup),
                            args.lr * 0.05 if args.final_lr is None else args.final_lr)],
        [args.warmup])
    opt = optim.Adam(learning_rate=sched)
    step_fn = value_and_grad(model, fast_loss_fn)
    rng = random.Random(args.seed if args.data_seed is None else args.data_seed)
    log = (args.out / "curve.jsonl").open("a")
    t0 = time.monotonic()
    best = 2.0
    for step in range(1, args.steps + 1):
        longest = min(data.MAX_LINE, 1 + step // args.grow)
        b = batch(processor, model.config,
                  [data.page(rng, longest=longest) for _ in range(args.batch)])
        loss, grads = step_fn(model, b)
        grads, _ = optim.clip_grad_norm(grads, 1.0)  # type: ignore[no-untyped-call]
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        row: dict[str, Any] = {"step": step, "loss": round(float(loss), 4),
                               "s": round(time.monotonic() - t0, 1)}
        over = args.minutes > 0 and time.monotonic() - t0 > args.minutes * 60
        if step % args.eval_every == 0 or step == args.steps or over:
            model.eval()
            row["cer"] = round(held_out_cer(model, processor, args.eval_pages), 4)
            model.train()
            save(model, init, args.out / "last")
            if row["cer"] <= best:
                best = row["cer"]
                save(model, init, args.out / "best")
        if step % 10 == 0 or "cer" in row:
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)
        if over:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
