"""Build a tiny random-weight Qwen2-VL / Qwen2.5-VL checkpoint offline.

Tests need a *real* mlx-vlm model (real architecture, real processor, real
`mlx_vlm.load`) but no hub access and no large weights. This writes one in the
exact on-disk format mlx-vlm reads: MLX safetensors, config.json, a byte-level
BPE tokenizer trained on built-in text, the Qwen2-VL chat template and a numpy
preprocessor config. Same arch + seed gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmq.worker import blas

# The Qwen2 pre-tokenizer regex; transformers' Qwen2Tokenizer rebuilds the
# pipeline from it, so ours must be identical or encodings drift.
_QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Appended after the learned vocab, in Qwen's order.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Training text for the BPE merges: enough variety for a few hundred merges.
_CORPUS: tuple[str, ...] = (
    "Convert this page to clean Markdown while preserving reading order.",
    "Describe this image in one or two sentences.",
    "Text Recognition: the quick brown fox jumps over the lazy dog.",
    "Invoice number 12345, dated 2024-03-17. Total due: $1,234.56 (net 30 days).",
    "# Heading\n\n| Column A | Column B |\n|---|---|\n| 1 | 2 |\n\n- item one\n- item two\n",
    "A photograph of a red bicycle leaning against a white wall in the afternoon sun.",
    "The document contains tables, figures, footnotes and equations such as E = mc^2.",
    "Chapter 3. Results and discussion. We observe that the model reads every line.",
    "Please transcribe the handwritten note: 'Meet me at 10:30 near the old library.'",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    "You are a helpful assistant. The user asks a question and the assistant answers.",
    "Page 7 of 12 -- Appendix B: configuration options, defaults and environment.",
)

# Sizes from the measured recipe (shared/notes/facts-mlx.md).
_TEXT: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
    # Small on purpose: lets tests hit the context limit cheaply.
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
_VISION: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "depth": 2,
        "embed_dim": 64,
        "hidden_size": 128,
        "num_heads": 4,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_chans": 3,
        "in_channels": 3,
    },
    "qwen2_5_vl": {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "out_hidden_size": 128,
        "num_heads": 4,
        "patch_size": 14,
        "spatial_patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "in_chans": 3,
        "in_channels": 3,
    },
}
ARCHS: tuple[str, ...] = tuple(_VISION)

# 28 px per merged token: 4..64 image tokens keeps the vision tower cheap on CPU.
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64

_WEIGHT_SCALE = 3.0  # default init ignores the image; scaled weights do not

# Size presets: "bench" is the ~20 M-parameter model of benchmarks/run.py, big enough
# that matmuls (and so the BLAS and batching) dominate, as in real models.
# (text overrides, vision overrides per arch, weight scale)
SIZES: dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]], float]] = {
    "tiny": ({}, {}, _WEIGHT_SCALE),
    "bench": (
        {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6,
         "num_attention_heads": 8, "num_key_value_heads": 2,
         "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}},
        {"qwen2_vl": {"depth": 4, "embed_dim": 256, "hidden_size": 512, "num_heads": 4,
                      "mlp_ratio": 4},
         "qwen2_5_vl": {"depth": 4, "hidden_size": 256, "intermediate_size": 1024,
                        "out_hidden_size": 512, "num_heads": 4}},
        1.5,
    ),
}
_STAMP = "vlmq-tiny.json"  # written last: marks a complete build


def build_tiny_model(out_dir: Path, arch: str = "qwen2_vl", seed: int = 0,
                     size: str = "tiny") -> Path:
    """Write (or reuse) a tiny checkpoint in `out_dir` and return that folder."""
    if arch not in _VISION:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {ARCHS}")
    if size not in SIZES or (size != "tiny" and arch not in SIZES[size][1]):
        raise ValueError(f"no {size!r} size for arch {arch!r}")
    out_dir = Path(out_dir)
    stamp: dict[str, Any] = {"arch": arch, "seed": seed, "version": 1}
    if size != "tiny":
        stamp["size"] = size
    stamp_path = out_dir / _STAMP
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp_path.unlink(missing_ok=True)

    ids = _write_tokenizer(out_dir)
    text, vision, scale = SIZES[size]
    config = _model_config(arch, ids)
    config.update(text)
    config["vision_config"].update(vision.get(arch, {}))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "preprocessor_config.json", _preprocessor_config(arch))
    _write_weights(out_dir / "model.safetensors", config, seed, scale)
    _write_json(stamp_path, stamp)
    return out_dir


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_tokenizer(out_dir: Path) -> dict[str, int]:
    """Train the BPE, append Qwen specials, write all tokenizer files; return special ids."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(out_dir / "tokenizer.json"))

    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = tok.token_to_id(t)
        if token_id is None:
            raise RuntimeError(f"special token {t} missing after training")
        ids[t] = token_id
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "added_tokens_decoder": added,
            "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "errors": "replace",
            "clean_up_tokenization_spaces": False,
            "model_max_length": _TEXT["max_position_embeddings"],
            "split_special_tokens": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(out_dir / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    ids["__len__"] = tok.get_vocab_size(with_added_tokens=True)
    return ids


def _model_config(arch: str, ids: dict[str, int]) -> dict[str, Any]:
    arch_name = "Qwen2VLForConditionalGeneration"
    if arch == "qwen2_5_vl":
        arch_name = "Qwen2_5_VLForConditionalGeneration"
    return {
        "architectures": [arch_name],
        "model_type": arch,
        **_TEXT,
        "vocab_size": ids["__len__"],
        "vision_config": {"model_type": arch, **_VISION[arch]},
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "torch_dtype": "float32",
    }


def _preprocessor_config(arch: str) -> dict[str, Any]:
    proc = "Qwen2VLImageProcessor"
    return {
        "image_processor_type": proc,
        "processor_class": "Qwen2_5_VLProcessor" if arch == "qwen2_5_vl" else "Qwen2VLProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 1 / 255,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }


def _write_weights(path: Path, config: dict[str, Any], seed: int, scale: float) -> None:
    """Instantiate mlx-vlm's own class with seeded random init and save it MLX-style."""
    blas.select()  # before MLX loads
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    cfg = json.loads(json.dumps(config))  # from_dict adds text_config to the dict it gets
    module, _ = get_model_and_args(config=cfg)
    model_config = module.ModelConfig.from_dict(cfg)
    model_config = update_module_configs(  # type: ignore[no-untyped-call]
        model_config, module, cfg, ["text", "vision"]
    )
    mx.random.seed(seed)
    model = module.Model(model_config)
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights = {k: (v * scale if v.ndim >= 2 else v) for k, v in flat}
    mx.eval(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
