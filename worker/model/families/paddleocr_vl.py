"""PaddleOCR-VL (PaddlePaddle/PaddleOCR-VL): ERNIE markers, tower at `visual`."""

from __future__ import annotations

from vlmq.worker.model.families._base import Family, FamilySpec, Preset, TinyBuild, task_rows
from vlmq.worker.model.families._tiny import TEXT, chat_template, qwen_pre

FAMILY = Family(
    model_type="paddleocr_vl",
    spec=FamilySpec(grid_prep=True, rope_index=True, tower="visual"),
    defaults=task_rows("OCR:"),
    presets=(
        Preset("PaddleOCR-VL", ("paddleocr-vl", "paddleocr_vl"), task_rows("OCR:", 4096),
               "https://huggingface.co/PaddlePaddle/PaddleOCR-VL (task prompts OCR:, "
               "Table Recognition:, Formula Recognition:, Chart Recognition:)"),
    ),
    # "User: ... Assistant: " turns.
    tiny=TinyBuild(
        specials=("</s>", "<|begin_of_sentence|>", "<|end_of_sentence|>",
                  "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_START|>", "<|IMAGE_END|>",
                  "<|video_pad|>"),
        chat_template=chat_template(
            bos="<|begin_of_sentence|>", user="User: ", user_end="\n",
            assistant="Assistant: ", assistant_end="<|end_of_sentence|>",
            image="<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"),
        eos="</s>", pad="</s>", bos="<|begin_of_sentence|>",
        tokenizer_class="LlamaTokenizer",
        config={
            "architectures": ["PaddleOCRVLForConditionalGeneration"],
            "model_type": "paddleocr_vl",
            **TEXT,
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
        preprocessor={**qwen_pre("PaddleOCRVLProcessor", 14, temporal=1),
                      "image_processor_type": "PaddleOCRVLImageProcessor"},
    ),
)
