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


def _row(ocr_prompt: str, ocr_max_tokens: int = 4096) -> dict[str, TaskDefaults]:
    return {
        "ocr": TaskDefaults(prompt=ocr_prompt, max_tokens=ocr_max_tokens),
        "caption": TaskDefaults(prompt=CAPTION_PROMPT, max_tokens=256),
        "generate": TaskDefaults(prompt=None, max_tokens=1024),
    }


# Keyed by config.json's model_type. olmOCR and Nanonets-OCR are qwen2_5_vl.
DEFAULTS: Mapping[str, Mapping[str, TaskDefaults]] = {
    "glm_ocr": _row("Text Recognition:"),
    "dots_ocr": _row("Convert this page to clean Markdown while preserving reading order."),
    "deepseekocr": _row("Convert the document to markdown."),
    "qwen2_vl": _row(MARKDOWN_OCR_PROMPT),
    "qwen2_5_vl": _row(MARKDOWN_OCR_PROMPT),
    "qwen3_vl": _row(MARKDOWN_OCR_PROMPT),
}
FALLBACK: Mapping[str, TaskDefaults] = _row(MARKDOWN_OCR_PROMPT)


def defaults_for(model_type: str, task: str) -> TaskDefaults:
    """The table row for this model type and task (fallback row for unknown types)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return DEFAULTS.get(model_type.lower(), FALLBACK)[task]


def resolve(
    model_type: str,
    task: str,
    prompt: str | None,
    max_tokens: int | None,
    temperature: float | None,
    stop: Sequence[str] | None,
) -> Resolved:
    """Merge a job's own settings over the table row.

    Prompt, max_tokens and temperature: the job's value wins when given. Stop
    strings are the union (model's first, de-duplicated): the model's markers
    end its turn whatever the job asks, so a job can add stops but not remove them.
    """
    row = defaults_for(model_type, task)
    chosen = prompt if prompt else row.prompt
    if not chosen:
        raise ValueError(f"task {task!r} needs a prompt; model type {model_type!r} has none")
    return Resolved(
        prompt=chosen,
        max_tokens=row.max_tokens if max_tokens is None else max_tokens,
        temperature=row.temperature if temperature is None else temperature,
        stop=tuple(dict.fromkeys((*row.stop, *(stop or ())))),
    )
