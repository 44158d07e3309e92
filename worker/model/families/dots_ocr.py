"""dots.ocr (rednote-hilab/dots.ocr): a Qwen2 LM with <|user|>/<|assistant|> turns."""

from __future__ import annotations

from vlmq.worker.model.families._base import Family, FamilySpec, Preset, TinyBuild, task_rows
from vlmq.worker.model.families._tiny import TEXT, chat_template, qwen_pre

FAMILY = Family(
    model_type="dots_ocr",
    spec=FamilySpec(grid_prep=True),
    defaults=task_rows("Convert this page to clean Markdown while preserving reading order."),
    presets=(
        Preset("dots.ocr", ("dots.ocr", "dots-ocr", "dots_ocr"),
               task_rows("Extract the text content from this image.", 8192),
               "https://github.com/rednote-hilab/dots.ocr dots_ocr/utils/prompts.py "
               "(prompt_ocr)"),
    ),
    # The image is <|img|><|imgpad|><|endofimg|>.
    tiny=TinyBuild(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|img|>", "<|endofimg|>",
                  "<|imgpad|>", "<|user|>", "<|endofuser|>", "<|assistant|>",
                  "<|endofassistant|>", "<|video_pad|>"),
        chat_template=chat_template(
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
            **TEXT,
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
        preprocessor={**qwen_pre("DotsVLProcessor", 14, temporal=1)},
    ),
)
