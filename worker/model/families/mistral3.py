"""Mistral 3 / Pixtral (LightOnOCR-2): [INST] turns, MLX processor."""

from __future__ import annotations

from vlmq.worker.model.families._base import (
    NO_GRID,
    Family,
    FamilySpec,
    Preset,
    TinyBuild,
    task_rows,
)
from vlmq.worker.model.families._tiny import CLIP_MEAN, CLIP_STD, TEXT, chat_template

FAMILY = Family(
    model_type="mistral3",
    spec=FamilySpec(grid_prep=False, cache_off=NO_GRID),
    defaults=task_rows(),
    presets=(
        # The card sends the page image with no text; the template then holds only the image.
        Preset("LightOnOCR-2", ("lightonocr",), task_rows("", 4096),
               "https://huggingface.co/lightonai/LightOnOCR-2-1B (image-only prompt)"),
    ),
    # The processor expands [IMG] into rows of image tokens ended by [IMG_BREAK] / [IMG_END].
    tiny=TinyBuild(
        specials=("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]",
                  "[IMG_END]"),
        chat_template=chat_template(
            bos="<s>", user="[INST]", user_end="[/INST]", assistant="",
            assistant_end="</s>", image="[IMG]"),
        eos="</s>", pad="<pad>", bos="<s>",
        tokenizer_class="PreTrainedTokenizerFast",
        config={
            "architectures": ["Mistral3ForConditionalGeneration"],
            "model_type": "mistral3",
            "text_config": {"model_type": "mistral", **TEXT, "vocab_size": "@vocab"},
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
            "do_resize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
            "rescale_factor": 1 / 255, "resample": 3,
            "patch_size": {"height": 14, "width": 14}, "size": {"longest_edge": 112},
        },
        extra_files={"processor_config.json": {
            "processor_class": "Mistral3Processor", "patch_size": 14,
            "spatial_merge_size": 2, "image_token": "[IMG]",
            "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}},
    ),
)
