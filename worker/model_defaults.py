"""Per-model-type generation defaults, as one data table.

OCR checkpoints are trained on one exact instruction and drift (or ramble past
the page) with anything else, so the prompt, stop strings and budget a job
gets when it names none depend on the model family. Keeping them in data,
not code, lets a new family be added by adding a row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vlmq.shared import constants as C

TASKS: tuple[str, ...] = C.TASKS

# Chat-control markers that some OCR models emit as plain text instead of EOS.
EXTRA_STOP: tuple[str, ...] = (
    "<|user|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|endofassistant|>",
)

CAPTION_PROMPT = "Describe this image in one or two sentences."
MARKDOWN_OCR_PROMPT = (
    "Convert this page to clean Markdown while preserving reading order. "
    "Render tables as Markdown tables and equations as LaTeX. "
    "Output only the page content."
)


@dataclass(frozen=True)
class TaskDefaults:
    """What a task gets when the job leaves a field unset (prompt None: job must give one)."""

    prompt: str | None
    max_tokens: int
    temperature: float = 0.0
    stop: tuple[str, ...] = EXTRA_STOP


@dataclass(frozen=True)
class Resolved:
    """The settings one item actually runs with."""

    prompt: str
    max_tokens: int
    temperature: float
    stop: tuple[str, ...]


def _row(ocr_prompt: str, ocr_max_tokens: int = 4096, *, caption: str = CAPTION_PROMPT,
         stop: tuple[str, ...] = ()) -> dict[str, TaskDefaults]:
    stops = tuple(dict.fromkeys((*EXTRA_STOP, *stop)))
    return {
        "ocr": TaskDefaults(prompt=ocr_prompt, max_tokens=ocr_max_tokens, stop=stops),
        "caption": TaskDefaults(prompt=caption, max_tokens=256, stop=stops),
        "generate": TaskDefaults(prompt=None, max_tokens=1024, stop=stops),
    }


# Keyed by config.json's model_type. olmOCR and Nanonets-OCR are qwen2_5_vl.
DEFAULTS: Mapping[str, Mapping[str, TaskDefaults]] = {
    "glm_ocr": _row("Text Recognition:"),
    "dots_ocr": _row("Convert this page to clean Markdown while preserving reading order."),
    "deepseekocr": _row("Convert the document to markdown."),
    "qwen2_vl": _row(MARKDOWN_OCR_PROMPT),
    "qwen2_5_vl": _row(MARKDOWN_OCR_PROMPT),
    "qwen3_vl": _row(MARKDOWN_OCR_PROMPT),
    "paddleocr_vl": _row("OCR:"),
    "idefics3": _row("Convert this page to docling.", stop=("<end_of_utterance>",)),
    "gemma3": _row(MARKDOWN_OCR_PROMPT, stop=("<end_of_turn>",)),
    "mistral3": _row(MARKDOWN_OCR_PROMPT),
}
FALLBACK: Mapping[str, TaskDefaults] = _row(MARKDOWN_OCR_PROMPT)

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


@dataclass(frozen=True)
class Preset:
    """Defaults for one real checkpoint, found by its model id (hub id or folder path).

    `names`: lowercase pieces of the id that identify it; the model type must match
    too, so a fine-tune of another family never picks it up by name alone.
    """

    name: str
    model_type: str
    names: tuple[str, ...]
    rows: Mapping[str, TaskDefaults]
    source: str  # where the prompt and settings come from


# Greedy everywhere (temperature 0): batched output equals sequential output and a
# re-run gives the same text; the repetition guard handles greedy loops.
PRESETS: tuple[Preset, ...] = (
    Preset("olmOCR-2", "qwen2_5_vl", ("olmocr-2", "olmocr2"),
           _row(OLMOCR2_PROMPT, 8000),
           "https://huggingface.co/allenai/olmOCR-2-7B-1025; olmocr/prompts/prompts.py"),
    Preset("Nanonets-OCR2", "qwen2_5_vl", ("nanonets-ocr2", "nanonets-ocr-2"),
           _row(NANONETS_PROMPT, 15000),
           "https://huggingface.co/nanonets/Nanonets-OCR2-3B (max_new_tokens=15000)"),
    Preset("granite-docling", "idefics3", ("granite-docling",),
           _row("Convert this page to docling.", 8192, stop=("<end_of_utterance>",)),
           "https://huggingface.co/ibm-granite/granite-docling-258M (DocTags output)"),
    Preset("SmolDocling", "idefics3", ("smoldocling",),
           _row("Convert this page to docling.", 8192, stop=("<end_of_utterance>",)),
           "https://huggingface.co/docling-project/SmolDocling-256M-preview"),
    # The card sends the page image with no text; the template then holds only the image.
    Preset("LightOnOCR-2", "mistral3", ("lightonocr",),
           _row("", 4096),
           "https://huggingface.co/lightonai/LightOnOCR-2-1B (image-only prompt)"),
    Preset("PaddleOCR-VL", "paddleocr_vl", ("paddleocr-vl", "paddleocr_vl"),
           _row("OCR:", 4096),
           "https://huggingface.co/PaddlePaddle/PaddleOCR-VL (task prompts OCR:, "
           "Table Recognition:, Formula Recognition:, Chart Recognition:)"),
    Preset("GLM-OCR", "glm_ocr", ("glm-ocr", "glm_ocr"),
           _row("Text Recognition:", 8192),
           "https://huggingface.co/zai-org/GLM-OCR (max_new_tokens=8192)"),
    Preset("dots.ocr", "dots_ocr", ("dots.ocr", "dots-ocr", "dots_ocr"),
           _row("Extract the text content from this image.", 8192),
           "https://github.com/rednote-hilab/dots.ocr dots_ocr/utils/prompts.py (prompt_ocr)"),
    Preset("DeepSeek-OCR", "deepseekocr", ("deepseek-ocr",),
           _row("<|grounding|>Convert the document to markdown.", 8192),
           "https://huggingface.co/deepseek-ai/DeepSeek-OCR (mlx-vlm adds the <image> line)"),
    Preset("Qwen2.5-VL", "qwen2_5_vl", ("qwen2.5-vl", "qwen2_5-vl"),
           _row(MARKDOWN_OCR_PROMPT, caption="Describe this image."),
           "https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct (\"Describe this image.\")"),
    Preset("Qwen3-VL", "qwen3_vl", ("qwen3-vl",),
           _row(MARKDOWN_OCR_PROMPT, caption="Describe this image."),
           "https://huggingface.co/Qwen/Qwen3-VL-8B-Instruct (\"Describe this image.\")"),
    Preset("Gemma 3", "gemma3", ("gemma-3",),
           _row(MARKDOWN_OCR_PROMPT, caption="Describe this image in detail.",
                stop=("<end_of_turn>",)),
           "https://huggingface.co/google/gemma-3-4b-it (\"Describe this image in detail.\")"),
)


def preset_for(model_type: str, model_id: str | None) -> Preset | None:
    """The checkpoint preset whose name pieces appear in `model_id`, for this model type."""
    if not model_id:
        return None
    mid = model_id.lower()
    for preset in PRESETS:
        if preset.model_type == model_type.lower() and any(n in mid for n in preset.names):
            return preset
    return None


def defaults_for(model_type: str, task: str, model_id: str | None = None) -> TaskDefaults:
    """The checkpoint preset's row, else the model type's, else the fallback row."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    preset = preset_for(model_type, model_id)
    if preset is not None:
        return preset.rows[task]
    return DEFAULTS.get(model_type.lower(), FALLBACK)[task]


def resolve(
    model_type: str,
    task: str,
    prompt: str | None,
    max_tokens: int | None,
    temperature: float | None,
    stop: Sequence[str] | None,
    model_id: str | None = None,
) -> Resolved:
    """Merge a job's own settings over the table row.

    Prompt, max_tokens and temperature: the job's value wins when given. Stop
    strings are the union (model's first, de-duplicated): the model's markers
    end its turn whatever the job asks, so a job can add stops but not remove them.
    """
    row = defaults_for(model_type, task, model_id)
    chosen = prompt if prompt else row.prompt
    if chosen is None:  # "" is a real preset: an image-only prompt (LightOnOCR)
        raise ValueError(f"task {task!r} needs a prompt; model type {model_type!r} has none")
    return Resolved(
        prompt=chosen,
        max_tokens=row.max_tokens if max_tokens is None else max_tokens,
        temperature=row.temperature if temperature is None else temperature,
        stop=tuple(dict.fromkeys((*row.stop, *(stop or ())))),
    )
