"""Qwen2-VL (Qwen/Qwen2-VL-*): the reference family; numpy grid processor, cacheable."""

from __future__ import annotations

from vlmq.worker.model.families._base import Family, FamilySpec, task_rows
from vlmq.worker.model.families._tiny import qwen_build

FAMILY = Family(
    model_type="qwen2_vl",
    spec=FamilySpec(grid_prep=True),
    defaults=task_rows(),
    tiny=qwen_build(
        "qwen2_vl", "Qwen2VLForConditionalGeneration",
        {"depth": 2, "embed_dim": 64, "hidden_size": 128, "num_heads": 4, "mlp_ratio": 2,
         "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
         "temporal_patch_size": 2, "in_chans": 3, "in_channels": 3},
        "Qwen2VLProcessor", 14,
        sizes={"bench": {"depth": 4, "embed_dim": 256, "hidden_size": 512, "num_heads": 4,
                         "mlp_ratio": 4}},
    ),
)
