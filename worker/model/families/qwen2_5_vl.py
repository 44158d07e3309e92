"""Qwen2.5-VL, and the OCR checkpoints built on it (olmOCR-2, Nanonets-OCR2)."""

from __future__ import annotations

from vlmq.worker.model.families._base import Family, FamilySpec, Preset, card_preset, task_rows
from vlmq.worker.model.families._tiny import qwen_build

# olmOCR's no-anchoring v4 YAML prompt (allenai/olmocr, olmocr/prompts/prompts.py,
# build_no_anchoring_v4_yaml_prompt; the prompt olmOCR-2 was trained on).
OLMOCR2_PROMPT = (
    "Attached is one page of a document that you must process. Just return the plain text "
    "representation of this document as if you were reading it naturally. Convert "
    "equations to LateX and tables to HTML.\n"
    "If there are any figures or charts, label them with the following markdown syntax "
    "![Alt text describing the contents of the figure](page_startx_starty_width_height.png)\n"
    "Return your output as markdown, with a front matter section on top specifying values "
    "for the primary_language, is_rotation_valid, rotation_correction, is_table, and "
    "is_diagram parameters."
)
# https://huggingface.co/nanonets/Nanonets-OCR2-3B (model card, "Usage").
NANONETS_PROMPT = (
    "Extract the text from the above document as if you were reading it naturally. Return "
    "the tables in html format. Return the equations in LaTeX representation. If there is "
    "an image in the document and image caption is not present, add a small description of "
    "the image inside the <img></img> tag; otherwise, add the image caption inside "
    "<img></img>. Watermarks should be wrapped in brackets. Ex: "
    "<watermark>OFFICIAL COPY</watermark>. Page numbers should be wrapped in brackets. Ex: "
    "<page_number>14</page_number> or <page_number>9/22</page_number>. Prefer using \u2610 "
    "and \u2611 for check boxes."
)

FAMILY = Family(
    model_type="qwen2_5_vl",
    spec=FamilySpec(grid_prep=True),
    defaults=task_rows(),
    # The fine-tunes first: their ids need not name Qwen2.5-VL.
    presets=(
        Preset("olmOCR-2", ("olmocr-2", "olmocr2"), task_rows(OLMOCR2_PROMPT, 8000),
               "https://huggingface.co/allenai/olmOCR-2-7B-1025; olmocr/prompts/prompts.py"),
        Preset("Nanonets-OCR2", ("nanonets-ocr2", "nanonets-ocr-2"),
               task_rows(NANONETS_PROMPT, 15000),
               "https://huggingface.co/nanonets/Nanonets-OCR2-3B (max_new_tokens=15000)"),
        card_preset("Qwen2.5-VL", ("qwen2.5-vl", "qwen2_5-vl"),
                    "https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct", "Describe this image."),
    ),
    tiny=qwen_build(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
        {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "out_hidden_size": 128,
         "num_heads": 4, "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
         "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [1],
         "in_chans": 3, "in_channels": 3},
        "Qwen2_5_VLProcessor", 14,
        sizes={"bench": {"depth": 4, "hidden_size": 256, "intermediate_size": 1024,
                         "out_hidden_size": 512, "num_heads": 4}},
    ),
)
