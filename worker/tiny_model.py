"""Build a tiny random-weight Qwen2-VL / Qwen2.5-VL checkpoint offline.

Tests need a *real* mlx-vlm model (real architecture, real processor, real
`mlx_vlm.load`) but no hub access and no large weights. This writes one in the
exact on-disk format mlx-vlm reads: MLX safetensors, config.json, a byte-level
BPE tokenizer trained on built-in text, the Qwen2-VL chat template and a numpy
preprocessor config. Same arch + seed gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
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

# Text sizes shared by every family (the measured qwen recipe, facts-mlx.md).
_TEXT: dict[str, Any] = {
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
_MROPE = {"type": "mrope", "mrope_section": [4, 6, 6]}  # sums to head_dim / 2

# 28 px per merged token: 4..64 image tokens keeps the vision tower cheap on CPU.
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 64
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _chat_template(*, bos: str = "", system: str = "", user: str, user_end: str,
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


@dataclass(frozen=True)
class Family:
    """What one mlx-vlm family needs on disk; everything else is shared.

    In `config` and `tokenizer_extra`, a string "@<token>" becomes that token's id
    and "@vocab" the vocabulary size once the tokenizer is trained.
    """

    specials: tuple[str, ...]  # appended after the learned vocab, in this order
    chat_template: str
    eos: str  # the tokenizer's eos_token (also the config's first eos id)
    pad: str
    config: dict[str, Any]
    preprocessor: dict[str, Any]
    tokenizer_class: str = "Qwen2Tokenizer"
    bos: str | None = None
    tokenizer_extra: dict[str, Any] = field(default_factory=dict)
    # Where the specials start, for processors that hard-code a token id (else: right
    # after the learned vocab). The embedding then spans the gap.
    specials_at: int | None = None
    extra_files: dict[str, Any] = field(default_factory=dict)  # more JSON files, by name
    weight_scale: float = 3.0  # default init ignores the image; scaled weights do not
    embed_scale: float | None = None  # token embedding's own scale (None: weight_scale)


def _qwen_pre(proc: str, patch: int, temporal: int = 2) -> dict[str, Any]:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": proc,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "rescale_factor": 1 / 255,
        "patch_size": patch,
        "temporal_patch_size": temporal,
        "merge_size": 2,
        "min_pixels": (patch * 2) ** 2 * 4,
        "max_pixels": (patch * 2) ** 2 * 64,
        "size": {"shortest_edge": (patch * 2) ** 2 * 4, "longest_edge": (patch * 2) ** 2 * 64},
    }


def _qwen_config(arch: str, hf_arch: str, vision: dict[str, Any],
                 rope: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": [hf_arch],
        "model_type": arch,
        **_TEXT,
        "rope_scaling": rope,
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
    }


_QWEN2_VISION: dict[str, Any] = {
    "depth": 2, "embed_dim": 64, "hidden_size": 128, "num_heads": 4, "mlp_ratio": 2,
    "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "in_chans": 3, "in_channels": 3,
}
_QWEN25_VISION: dict[str, Any] = {
    "depth": 2, "hidden_size": 64, "intermediate_size": 128, "out_hidden_size": 128,
    "num_heads": 4, "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [1],
    "in_chans": 3, "in_channels": 3,
}
# Real Qwen3-VL has deepstack layers; the tiny one keeps one so their effect is tested.
_QWEN3_VISION: dict[str, Any] = {
    "depth": 2, "hidden_size": 64, "intermediate_size": 128, "out_hidden_size": 128,
    "num_heads": 4, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "num_position_embeddings": 64, "deepstack_visual_indexes": [0], "in_channels": 3,
}

FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(
        specials=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos="<|im_end|>",
        pad="<|endoftext|>",
        config=_qwen_config("qwen2_vl", "Qwen2VLForConditionalGeneration", _QWEN2_VISION,
                            _MROPE),
        preprocessor=_qwen_pre("Qwen2VLProcessor", 14),
    ),
    "qwen2_5_vl": Family(
        specials=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos="<|im_end|>",
        pad="<|endoftext|>",
        config=_qwen_config("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
                            _QWEN25_VISION, _MROPE),
        preprocessor=_qwen_pre("Qwen2_5_VLProcessor", 14),
    ),
    "qwen3_vl": Family(
        specials=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos="<|im_end|>",
        pad="<|endoftext|>",
        config={
            **_qwen_config("qwen3_vl", "Qwen3VLForConditionalGeneration", _QWEN3_VISION,
                           _MROPE),
            "text_config": {"model_type": "qwen3_vl", **_TEXT, "vocab_size": "@vocab",
                            "rope_scaling": {"rope_type": "default",
                                             "mrope_section": [4, 6, 6],
                                             "mrope_interleaved": True}},
        },
        preprocessor=_qwen_pre("Qwen3VLProcessor", 16),
    ),
    # GLM-OCR (zai-org/GLM-OCR): GLM-4 chat markers, <|image|> between begin/end markers.
    "glm_ocr": Family(
        specials=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<|begin_of_image|>",
                  "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
                  "<|video|>"),
        chat_template=_chat_template(
            bos="[gMASK]<sop>", user="<|user|>\n", user_end="", assistant="<|assistant|>\n",
            assistant_end="", image="<|begin_of_image|><|image|><|end_of_image|>"),
        eos="<|endoftext|>", pad="<|endoftext|>",
        tokenizer_extra={"image_token": "<|image|>", "video_token": "<|video|>"},
        config={
            "architectures": ["GlmOcrForConditionalGeneration"],
            "model_type": "glm_ocr",
            "vocab_size": "@vocab",
            "hidden_size": 128,
            "text_config": {
                "model_type": "glm_ocr_text",
                **{k: v for k, v in _TEXT.items() if k != "rope_theta"},
                "vocab_size": "@vocab",
                "eos_token_id": ["@<|endoftext|>", "@<|user|>"],
                "pad_token_id": "@<|endoftext|>",
                "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                    "partial_rotary_factor": 0.5, "rope_theta": 10000},
                "num_nextn_predict_layers": 0, "dtype": "float32",
            },
            "vision_config": {
                "model_type": "glm_ocr_vision", "depth": 2, "hidden_size": 64,
                "intermediate_size": 128, "num_heads": 4, "patch_size": 14,
                "image_size": 112, "out_hidden_size": 128, "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
            "image_token_id": "@<|image|>",
            "video_token_id": "@<|video|>",
            "image_start_token_id": "@<|begin_of_image|>",
            "image_end_token_id": "@<|end_of_image|>",
            "video_start_token_id": "@<|begin_of_video|>",
            "video_end_token_id": "@<|end_of_video|>",
            "pad_token_id": "@<|endoftext|>",
            "eos_token_id": ["@<|endoftext|>", "@<|user|>"],
        },
        preprocessor={**_qwen_pre("GlmOcrProcessor", 14),
                      "image_processor_type": "Glm46VImageProcessor"},
    ),
    # PaddleOCR-VL (PaddlePaddle/PaddleOCR-VL): ERNIE markers, "User: ... Assistant: ".
    "paddleocr_vl": Family(
        specials=("</s>", "<|begin_of_sentence|>", "<|end_of_sentence|>",
                  "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_START|>", "<|IMAGE_END|>",
                  "<|video_pad|>"),
        chat_template=_chat_template(
            bos="<|begin_of_sentence|>", user="User: ", user_end="\n",
            assistant="Assistant: ", assistant_end="<|end_of_sentence|>",
            image="<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"),
        eos="</s>", pad="</s>", bos="<|begin_of_sentence|>",
        tokenizer_class="LlamaTokenizer",
        config={
            "architectures": ["PaddleOCRVLForConditionalGeneration"],
            "model_type": "paddleocr_vl",
            **_TEXT,
            # mlx-vlm's projector hard-codes a 1024-wide output (paddleocr_vl/vision.py).
            "hidden_size": 1024,
            "vocab_size": "@vocab",
            "use_bias": False,
            "hidden_act": "silu",
            "rope_scaling": {"rope_type": "default", "type": "default",
                             "mrope_section": [4, 6, 6]},
            "vision_config": {
                "model_type": "paddleocr_vl", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 112,
                "patch_size": 14, "spatial_merge_size": 2,
            },
            "image_token_id": "@<|IMAGE_PLACEHOLDER|>",
            "video_token_id": "@<|video_pad|>",
            "vision_start_token_id": "@<|IMAGE_START|>",
            "vision_end_token_id": "@<|IMAGE_END|>",
            "pad_token_id": "@</s>",
            "bos_token_id": "@<|begin_of_sentence|>",
            "eos_token_id": "@</s>",
        },
        preprocessor={**_qwen_pre("PaddleOCRVLProcessor", 14, temporal=1),
                      "image_processor_type": "PaddleOCRVLImageProcessor"},
    ),
    # dots.ocr (rednote-hilab/dots.ocr): Qwen2 LM, <|user|>/<|assistant|> turns, <|imgpad|>.
    "dots_ocr": Family(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|img|>", "<|endofimg|>",
                  "<|imgpad|>", "<|user|>", "<|endofuser|>", "<|assistant|>",
                  "<|endofassistant|>", "<|video_pad|>"),
        chat_template=_chat_template(
            user="<|user|>", user_end="<|endofuser|>", assistant="<|assistant|>",
            assistant_end="<|endofassistant|>", image="<|img|><|imgpad|><|endofimg|>"),
        eos="<|endofassistant|>", pad="<|endoftext|>",
        tokenizer_extra={"image_token": "<|imgpad|>", "video_token": "<|video_pad|>"},
        # mlx-vlm's DotsVLProcessor hard-codes image_token_id 151665
        # (dots_ocr/processing_dots_ocr.py), dots.ocr's real id for <|imgpad|>.
        specials_at=151665 - 5,
        config={
            "architectures": ["DotsOCRForCausalLM"],
            "model_type": "dots_ocr",
            **_TEXT,
            "tie_word_embeddings": True,  # halves the 151k-row embedding
            "vocab_size": "@vocab",
            "attention_bias": True,
            "vision_config": {
                "model_type": "dots_vit", "embed_dim": 64, "hidden_size": 128,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 1,
            },
            "image_token_id": "@<|imgpad|>",
            "video_token_id": "@<|video_pad|>",
            "eos_token_id": ["@<|endofassistant|>", "@<|endoftext|>"],
        },
        preprocessor={**_qwen_pre("DotsVLProcessor", 14, temporal=1)},
    ),
    # Gemma 3 (google/gemma-3-4b-it): <start_of_turn> turns, <start_of_image> expanded by
    # the processor to image_seq_length soft tokens; SigLIP tower (64 soft tokens here).
    "gemma3": Family(
        specials=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        chat_template=_chat_template(
            bos="<bos>", user="<start_of_turn>user\n", user_end="<end_of_turn>\n",
            assistant="<start_of_turn>model\n", assistant_end="<end_of_turn>\n",
            image="<start_of_image>"),
        eos="<eos>", pad="<pad>", bos="<bos>",
        tokenizer_class="PreTrainedTokenizerFast",
        tokenizer_extra={"extra_special_tokens": {
            "image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>"}},
        config={
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {
                "model_type": "gemma3_text", **_TEXT, "vocab_size": "@vocab",
                "query_pre_attn_scalar": 32, "sliding_window": 64,
                "sliding_window_pattern": 2, "mm_tokens_per_image": 64,
            },
            "vision_config": {
                "model_type": "siglip_vision_model", "num_hidden_layers": 2,
                "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "patch_size": 14, "image_size": 112,
            },
            "vocab_size": "@vocab",
            "mm_tokens_per_image": 64,
            "image_token_index": "@<image_soft_token>",
            "boi_token_index": "@<start_of_image>",
            "eoi_token_index": "@<end_of_image>",
            "pad_token_id": "@<pad>",
            "eos_token_id": ["@<eos>", "@<end_of_turn>"],
        },
        preprocessor={
            "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
            "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
            "do_resize": True, "do_pan_and_scan": False, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255, "resample": 2,
            "size": {"height": 112, "width": 112},
        },
        # Tied embeddings: with them scaled too, every row echoes its last token.
        weight_scale=6.0, embed_scale=1.0,
        extra_files={"processor_config.json": {"image_seq_length": 64,
                                               "processor_class": "Gemma3Processor"}},
    ),
    # Idefics3 (SmolDocling, granite-docling): "User:<image>...<end_of_utterance>" turns;
    # the processor expands <image> to image_seq_len tokens between fake-token markers.
    "idefics3": Family(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>",
                  "<image>", "<end_of_utterance>", "<global-img>"),
        chat_template=_chat_template(
            bos="<|im_start|>", user="User:", user_end="<end_of_utterance>\n",
            assistant="Assistant:", assistant_end="<end_of_utterance>\n", image="<image>"),
        eos="<end_of_utterance>", pad="<|endoftext|>",
        tokenizer_class="PreTrainedTokenizerFast",
        config={
            "architectures": ["Idefics3ForConditionalGeneration"],
            "model_type": "idefics3",
            "text_config": {
                "model_type": "llama", **_TEXT, "vocab_size": "@vocab", "rms_norm_eps": 1e-5,
            },
            "vision_config": {
                "model_type": "idefics3_vision", "hidden_size": 64, "num_attention_heads": 4,
                "patch_size": 14, "num_hidden_layers": 2, "intermediate_size": 128,
                "image_size": 112,
            },
            "vocab_size": "@vocab",
            "scale_factor": 2,
            "image_token_id": "@<image>",
            "eos_token_id": ["@<end_of_utterance>", "@<|endoftext|>"],
        },
        preprocessor={
            "image_processor_type": "Idefics3ImageProcessor",
            "processor_class": "Idefics3Processor",
            "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
            "do_resize": True, "do_pad": True, "do_image_splitting": False,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "rescale_factor": 1 / 255, "resample": 1,
            "size": {"longest_edge": 112}, "max_image_size": {"longest_edge": 112},
        },
        # (112 / 14)^2 patches, pixel-shuffled by scale_factor^2.
        extra_files={"processor_config.json": {"image_seq_len": 16,
                                               "processor_class": "Idefics3Processor"}},
    ),
    # Mistral 3 / Pixtral (LightOnOCR): [INST] turns; the processor expands [IMG] into
    # rows of image tokens ended by [IMG_BREAK] / [IMG_END].
    "mistral3": Family(
        specials=("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]",
                  "[IMG_END]"),
        chat_template=_chat_template(
            bos="<s>", user="[INST]", user_end="[/INST]", assistant="",
            assistant_end="</s>", image="[IMG]"),
        eos="</s>", pad="<pad>", bos="<s>",
        tokenizer_class="PreTrainedTokenizerFast",
        config={
            "architectures": ["Mistral3ForConditionalGeneration"],
            "model_type": "mistral3",
            "text_config": {"model_type": "mistral", **_TEXT, "vocab_size": "@vocab"},
            "vision_config": {
                "model_type": "pixtral", "num_hidden_layers": 2, "hidden_size": 64,
                "head_dim": 16, "intermediate_size": 128, "num_attention_heads": 4,
                "image_size": 112, "patch_size": 14,
            },
            "vocab_size": "@vocab",
            "spatial_merge_size": 2,
            "image_token_index": "@[IMG]",
            "multimodal_projector_bias": False,
            "eos_token_id": ["@</s>"],
        },
        preprocessor={
            "image_processor_type": "PixtralImageProcessor",
            "processor_class": "Mistral3Processor",
            "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
            "do_resize": True, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD,
            "rescale_factor": 1 / 255, "resample": 3,
            "patch_size": {"height": 14, "width": 14}, "size": {"longest_edge": 112},
        },
        extra_files={"processor_config.json": {
            "processor_class": "Mistral3Processor", "patch_size": 14,
            "spatial_merge_size": 2, "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}},
    ),
}
ARCHS: tuple[str, ...] = tuple(FAMILIES)

# Size presets: "bench" is the ~20 M-parameter model of benchmarks/run.py, big enough
# that matmuls (and so the BLAS and batching) dominate, as in real models.
# (text overrides, vision overrides per arch, weight scale; None: the family's own)
SIZES: dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]], float | None]] = {
    "tiny": ({}, {}, None),
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
    family = FAMILIES.get(arch)
    if family is None:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {ARCHS}")
    if size not in SIZES or (size != "tiny" and arch not in SIZES[size][1]):
        raise ValueError(f"no {size!r} size for arch {arch!r}")
    out_dir = Path(out_dir)
    # The recipe's digest: editing a family's row rebuilds its folder.
    recipe = hashlib.sha256(json.dumps(asdict(family), sort_keys=True).encode()).hexdigest()
    stamp = {"arch": arch, "seed": seed, "version": 2, "recipe": recipe[:16]}
    if size != "tiny":
        stamp["size"] = size
    stamp_path = out_dir / _STAMP
    if stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp_path.unlink(missing_ok=True)

    ids = _write_tokenizer(out_dir, family)
    text, vision, size_scale = SIZES[size]
    config = {**_fill(family.config, ids), **text}
    if arch in vision:
        config["vision_config"] = {**config["vision_config"], **vision[arch]}
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "preprocessor_config.json", family.preprocessor)
    for name, data in family.extra_files.items():
        _write_json(out_dir / name, data)
    _write_weights(out_dir / "model.safetensors", config, seed,
                   family.weight_scale if size_scale is None else size_scale,
                   family.embed_scale)
    _write_json(stamp_path, stamp)
    return out_dir


def _fill(value: Any, ids: dict[str, int]) -> Any:
    """Replace "@<token>" / "@vocab" placeholders with the trained tokenizer's ids."""
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, ids) for v in value]
    if isinstance(value, str) and value.startswith("@"):
        return ids["__len__"] if value == "@vocab" else ids[value[1:]]
    return value


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _move_specials(tok: Any, first_id: int) -> Any:
    """The same tokenizer with its added tokens renumbered from `first_id`.

    The gap is filled with unused tokens (no merge makes them), since mlx-vlm's
    streaming detokenizer needs dense ids.
    """
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    learned = max(vocab.values()) + 1
    vocab.update({f"<unused{i}>": i for i in range(learned, first_id)})
    for k, entry in enumerate(data["added_tokens"]):
        entry["id"] = first_id + k
        data["model"]["vocab"][entry["content"]] = first_id + k  # else ids are reassigned
    return Tokenizer.from_str(json.dumps(data))


def _write_tokenizer(out_dir: Path, family: Family) -> dict[str, int]:
    """Train the BPE, append the family's specials, write all tokenizer files; return ids."""
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
    tok.add_special_tokens(list(family.specials))
    if family.specials_at is not None:
        tok = _move_specials(tok, family.specials_at)
    tok.save(str(out_dir / "tokenizer.json"))

    ids: dict[str, int] = {}
    for t in family.specials:
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
    named = {family.eos, family.pad, family.bos}
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": family.tokenizer_class,
            "added_tokens_decoder": added,
            "additional_special_tokens": [t for t in family.specials if t not in named],
            "bos_token": family.bos,
            "eos_token": family.eos,
            "pad_token": family.pad,
            "unk_token": None,
            "errors": "replace",
            "clean_up_tokenization_spaces": False,
            "model_max_length": _TEXT["max_position_embeddings"],
            "split_special_tokens": False,
            "chat_template": family.chat_template,
            **family.tokenizer_extra,
        },
    )
    _write_json(out_dir / "chat_template.json", {"chat_template": family.chat_template})
    ids["__len__"] = tok.get_vocab_size(with_added_tokens=True)
    return ids


def _write_weights(path: Path, config: dict[str, Any], seed: int, scale: float,
                   embed_scale: float | None) -> None:
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
    embed = scale if embed_scale is None else embed_scale
    weights = {k: (v * (embed if "embed_tokens" in k else scale) if v.ndim >= 2 else v)
               for k, v in flat}
    mx.eval(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
