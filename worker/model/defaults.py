"""What a job runs with when it leaves a setting unset: the family's data, resolved.

OCR checkpoints are trained on one exact instruction and drift (or ramble past
the page) with anything else, so the prompt, stop strings and budget a job
gets when it names none depend on the model family, and on the checkpoint
when a preset knows it. The rows themselves live in each family's file
(vlmq.worker.model.families); this module only picks and merges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vlmq.shared import constants as C
from vlmq.worker.model import families
from vlmq.worker.model.families import EXTRA_STOP, Preset, TaskDefaults

__all__ = ["EXTRA_STOP", "TASKS", "Preset", "Resolved", "TaskDefaults", "defaults_for",
           "preset_for", "resolve"]

TASKS: tuple[str, ...] = C.TASKS


@dataclass(frozen=True)
class Resolved:
    """The settings one item actually runs with."""

    prompt: str
    max_tokens: int
    temperature: float
    stop: tuple[str, ...]


def preset_for(model_type: str, model_id: str | None) -> Preset | None:
    """The checkpoint preset of this model type whose name pieces appear in `model_id`."""
    family = families.find(model_type)
    if not model_id or family is None:
        return None
    mid = model_id.lower()
    return next((p for p in family.presets if any(n in mid for n in p.names)), None)


def defaults_for(model_type: str, task: str, model_id: str | None = None) -> TaskDefaults:
    """The checkpoint preset's row, else the model type's.

    A model type outside the families is a ValueError: the worker refuses such a
    model at start, so no job can reach here with one.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    family = families.get(model_type)
    preset = preset_for(model_type, model_id)
    return (family.defaults if preset is None else preset.rows)[task]


def resolve(
    model_type: str,
    task: str,
    prompt: str | None,
    max_tokens: int | None,
    temperature: float | None,
    stop: Sequence[str] | None,
    model_id: str | None = None,
) -> Resolved:
    """Merge a job's own settings over the family's row.

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
