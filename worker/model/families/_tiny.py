"""Tiny-build pieces several family files share: text sizes, Qwen's tokens and template.

Measured recipe (see the notes on MLX facts): text hidden 128, 2 layers, M-RoPE sections
summing to head_dim / 2; images of 4..64 merged tokens keep the vision tower cheap on CPU.
"""

from __future__ import annotations

from typing import Any

from vlmq.worker.model.families._base import TinyBuild

# Text sizes shared by every family.
TEXT: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    # Small on purpose: lets tests hit the context limit cheaply.
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
MROPE: dict[str, Any] = {"type": "mrope", "mrope_section": [4, 6, 6]}  # sums to head_dim / 2

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Qwen's special tokens, appended after the learned vocab in Qwen's order.
QWEN_SPECIALS: tuple[str, ...] = (
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

# The Qwen2-VL chat template, as the real checkpoints ship it.
QWEN_CHAT_TEMPLATE = (
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


def chat_template(*, bos: str = "", system: str = "", user: str, user_end: str,
                  assistant: str, assistant_end: str, image: str) -> str:
    """A chat template in the shape of the family's own: role markers around each turn,
    the family's image placeholder where the message has an image."""
    first = ("{% if loop.first and message['role'] != 'system' %}" + system + "{% endif %}"
             if system else "")
    return (
        bos + "{% for message in messages %}" + first
        + "{% if message['role'] == 'assistant' %}" + assistant + "{% else %}" + user
        + "{% endif %}"
        + "{% if message['content'] is string %}{{ message['content'] }}"
        + "{% else %}{% for content in message['content'] %}"
        + "{% if content['type'] == 'image' %}" + image
        + "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
        + "{% endfor %}{% endif %}"
        + "{% if message['role'] == 'assistant' %}" + assistant_end + "{% else %}" + user_end
        + "{% endif %}{% endfor %}"
        + "{% if add_generation_prompt %}" + assistant + "{% endif %}"
    )


def qwen_pre(proc: str, patch: int, temporal: int = 2) -> dict[str, Any]:
    """A Qwen2-VL style preprocessor_config.json: 4..64 merged tokens per image."""
    merged = patch * 2
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": proc,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "rescale_factor": 1 / 255,
        "patch_size": patch,
        "temporal_patch_size": temporal,
        "merge_size": 2,
        "min_pixels": merged ** 2 * 4,
        "max_pixels": merged ** 2 * 64,
        "size": {"shortest_edge": merged ** 2 * 4, "longest_edge": merged ** 2 * 64},
    }


def qwen_build(arch: str, hf_arch: str, vision: dict[str, Any], processor: str, patch: int,
               *, extra: dict[str, Any] | None = None,
               sizes: dict[str, dict[str, Any]] | None = None) -> TinyBuild:
    """A Qwen-VL family's build: Qwen tokens and template, M-RoPE text, its own tower."""
    config = {
        "architectures": [hf_arch],
        "model_type": arch,
        **TEXT,
        "rope_scaling": MROPE,
        "vocab_size": "@vocab",
        "vision_config": {"model_type": arch, **vision},
        "image_token_id": "@<|image_pad|>",
        "video_token_id": "@<|video_pad|>",
        "vision_start_token_id": "@<|vision_start|>",
        "vision_end_token_id": "@<|vision_end|>",
        "vision_token_id": "@<|vision_pad|>",
        "bos_token_id": "@<|endoftext|>",
        "eos_token_id": ["@<|im_end|>", "@<|endoftext|>"],
        "torch_dtype": "float32",
        **(extra or {}),
    }
    return TinyBuild(specials=QWEN_SPECIALS, chat_template=QWEN_CHAT_TEMPLATE,
                     eos="<|im_end|>", pad="<|endoftext|>", config=config,
                     preprocessor=qwen_pre(processor, patch), sizes=sizes or {})
