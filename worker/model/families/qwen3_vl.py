"""Qwen3-VL: deepstack features, so neither cached nor prefilled together."""

from __future__ import annotations

from vlmq.worker.model.families._base import Family, FamilySpec, card_preset, task_rows
from vlmq.worker.model.families._tiny import TEXT, qwen_build

FAMILY = Family(
    model_type="qwen3_vl",
    spec=FamilySpec(
        grid_prep=True,
        cache_off="mlx-vlm's qwen3_vl get_input_embeddings drops the deepstack features "
                  "when given cached_image_features",
        prefill_one="BatchGenerator pads deepstack_visual_embeds as if they were "
                    "sequence-aligned, so prompts of different lengths prefilled together "
                    "get the wrong deepstack features",
    ),
    defaults=task_rows(),
    presets=(
        card_preset("Qwen3-VL", ("qwen3-vl",), "https://huggingface.co/Qwen/Qwen3-VL-8B-Instruct",
                    "Describe this image."),
    ),
    # Real Qwen3-VL has deepstack layers; the tiny one keeps one so their effect is tested.
    tiny=qwen_build(
        "qwen3_vl", "Qwen3VLForConditionalGeneration",
        {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "out_hidden_size": 128,
         "num_heads": 4, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
         "num_position_embeddings": 64, "deepstack_visual_indexes": [0], "in_channels": 3},
        "Qwen3VLProcessor", 16,
        extra={"text_config": {"model_type": "qwen3_vl", **TEXT, "vocab_size": "@vocab",
                               "rope_scaling": {"rope_type": "default",
                                                "mrope_section": [4, 6, 6],
                                                "mrope_interleaved": True}}},
    ),
)
