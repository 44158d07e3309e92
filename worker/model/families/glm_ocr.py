"""GLM-OCR (zai-org/GLM-OCR): GLM-4 chat markers, positions computed per row."""

from __future__ import annotations

from vlmq.worker.model.families._base import Family, FamilySpec, Preset, TinyBuild, task_rows
from vlmq.worker.model.families._tiny import TEXT, chat_template, qwen_pre

FAMILY = Family(
    model_type="glm_ocr",
    spec=FamilySpec(grid_prep=True, rope_index=True),
    defaults=task_rows("Text Recognition:"),
    presets=(
        Preset("GLM-OCR", ("glm-ocr", "glm_ocr"), task_rows("Text Recognition:", 8192),
               "https://huggingface.co/zai-org/GLM-OCR (max_new_tokens=8192)"),
    ),
    # <|image|> between begin/end markers.
    tiny=TinyBuild(
        specials=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<|begin_of_image|>",
                  "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
                  "<|video|>"),
        chat_template=chat_template(
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
                **{k: v for k, v in TEXT.items() if k != "rope_theta"},
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
        preprocessor={**qwen_pre("GlmOcrProcessor", 14),
                      "image_processor_type": "Glm46VImageProcessor"},
    ),
)
