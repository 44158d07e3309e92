"""The reader's checkpoint layout: a qwen2_vl config, a byte-level tokenizer, random init.

The files are those of any tiny qwen2_vl (worker/model/tiny.py, the family's own
TinyBuild), with three changes the task needs: a character-level tokenizer (no BPE
merges: one token per ASCII character, so the model spells what it sees), larger
text and vision sizes, and a processor ceiling of 256 cells so that a page the worker
failed to shrink reaches the model too large rather than silently resized.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from vlmq.worker.model import blas, tiny
from vlmq.worker.model.families import qwen2_vl

TEXT: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    # Qwen's theta (1e6) leaves the width section of M-RoPE only frequencies that cannot
    # tell one image column from the next (1e-4 rad per column): the model would have to
    # find character k by counting. At theta 10 with most frequencies given to the width,
    # text token k and image column k sit at a fixed, resolvable rotation apart.
    "rope_theta": 10.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 8, 20]},  # sums to head_dim / 2
}
VISION: dict[str, Any] = {"depth": 2, "embed_dim": 128, "hidden_size": 256, "num_heads": 4,
                          "mlp_ratio": 2}
CELL = 28  # patch 14 x merge 2
PIXELS = {"min_pixels": CELL * CELL * 4, "max_pixels": CELL * CELL * 256}


def write_checkpoint(out_dir: Path, seed: int) -> Path:
    """Write an untrained reader (random weights) in the mlx-vlm format; return the folder."""
    base = qwen2_vl.FAMILY.tiny
    pre = {**base.preprocessor, **PIXELS,
           "size": {"shortest_edge": PIXELS["min_pixels"],
                    "longest_edge": PIXELS["max_pixels"]}}
    config = {**base.config, **TEXT, "torch_dtype": "float32"}
    config["vision_config"] = {**config["vision_config"], **VISION}
    build = replace(base, config=config, preprocessor=pre)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = tiny.write_tokenizer(out_dir, build, vocab_size=256)
    filled = tiny.fill(build.config, ids)
    tiny.write_json(out_dir / "config.json", filled)
    tiny.write_json(out_dir / "preprocessor_config.json", pre)
    _init_weights(out_dir / "model.safetensors", filled, seed)
    return out_dir


def _init_weights(path: Path, config: dict[str, Any], seed: int) -> None:
    """mlx-vlm's own class with its default init, seeded (training starts here)."""
    blas.select()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    cfg = json.loads(json.dumps(config))
    module, _ = get_model_and_args(config=cfg)
    model_config = update_module_configs(  # type: ignore[no-untyped-call]
        module.ModelConfig.from_dict(cfg), module, cfg, ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights = dict(flat)
    mx.eval(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
