"""The types a family file fills in, and the pieces most families share.

A family file is data: the adapter's spec, the job defaults, the checkpoint presets
and the tiny build recipe for one mlx-vlm model type. The types live here so that a
family file imports them and holds nothing but its own values. Nothing here imports
MLX or numpy: the CLI lists the families on a producer-only install.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------- adapter


@dataclass(frozen=True)
class FamilySpec:
    """How vlmq drives one mlx-vlm model family: the only place families differ.

    grid_prep: the processor's image processor is numpy and gives pixel_values plus
        image_grid_thw, so items are prepared on CPU threads (ids expanded from the
        grid) and the tower runs once per image, apart from the prompt.
    rope_index: the family's `get_input_embeddings` keeps its M-RoPE positions on the
        language model instead of returning them, and a batch of one row decodes
        with whatever was kept last. So each row's position_ids and rope_deltas are
        computed with `language_model.get_rope_index` and passed in, and the kept
        ones are cleared by a text-only `get_input_embeddings` call (that branch
        resets them), so no row ever decodes with another row's positions.
    cache_off: why cached tower output would change the text (None: cacheable, given
        grid_prep).
    prefill_one: why prompts must be prefilled one at a time (decoding still batches).
    tower: the model attribute that holds the vision tower.
    """

    grid_prep: bool
    rope_index: bool = False
    cache_off: str | None = None
    prefill_one: str | None = None
    tower: str = "vision_tower"

    @property
    def cacheable(self) -> bool:
        return self.grid_prep and self.cache_off is None


NO_GRID = ("vlmq caches tower output only for grid-based (Qwen-style) image processors, "
           "and this family's processor is not one")

# ---------------------------------------------------------------- job defaults

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


def task_rows(ocr_prompt: str = MARKDOWN_OCR_PROMPT, ocr_max_tokens: int = 4096, *,
              caption: str = CAPTION_PROMPT,
              stop: tuple[str, ...] = ()) -> dict[str, TaskDefaults]:
    """One row per task (ocr, caption, generate, extract); general models' OCR prompt by default.

    Greedy everywhere (temperature 0): batched output equals sequential output and a
    re-run gives the same text; the repetition guard handles greedy loops.
    """
    stops = tuple(dict.fromkeys((*EXTRA_STOP, *stop)))
    return {
        "ocr": TaskDefaults(prompt=ocr_prompt, max_tokens=ocr_max_tokens, stop=stops),
        "caption": TaskDefaults(prompt=caption, max_tokens=256, stop=stops),
        "generate": TaskDefaults(prompt=None, max_tokens=1024, stop=stops),
        # Its prompt is made from the job's schema (shared/extract_schema.default_prompt).
        "extract": TaskDefaults(prompt=None, max_tokens=1024, stop=stops),
    }


@dataclass(frozen=True)
class Preset:
    """Defaults for one real checkpoint of the family, found by its model id.

    `names`: lowercase pieces of the id (hub id or folder path) that identify it. A
    preset belongs to its family's file, so a fine-tune of another family never picks
    it up by name alone.
    """

    name: str
    names: tuple[str, ...]
    rows: Mapping[str, TaskDefaults]
    source: str  # where the prompt and settings come from


def card_preset(name: str, names: tuple[str, ...], card: str, caption: str,
                stop: tuple[str, ...] = ()) -> Preset:
    """A general (instruct) checkpoint: its model card's own caption prompt, the rest default."""
    return Preset(name, names, task_rows(caption=caption, stop=stop), f'{card} ("{caption}")')


# ---------------------------------------------------------------- tiny build


@dataclass(frozen=True)
class TinyBuild:
    """What the offline builder (vlmq.worker.model.tiny) writes for one family.

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
    # Vision-config overrides for the builder's larger size presets ("bench"); a size
    # is offered only for the families that list it.
    sizes: dict[str, dict[str, Any]] = field(default_factory=dict)


# ---------------------------------------------------------------- the family


@dataclass(frozen=True)
class Family:
    """One mlx-vlm model type, as vlmq serves it: one module of this package each.

    `model_type` is config.json's and the module's name. Every family is verified
    (batched output equal to sequential generate) through its tiny build, which is
    why a family cannot be added without one.
    """

    model_type: str
    spec: FamilySpec
    defaults: Mapping[str, TaskDefaults]
    tiny: TinyBuild
    presets: tuple[Preset, ...] = ()

    @property
    def cacheable(self) -> bool:
        return self.spec.cacheable
