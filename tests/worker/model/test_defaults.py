"""The defaults table: job values win, model stop markers always apply."""

from __future__ import annotations

import pytest

from vlmq.worker.model import families
from vlmq.worker.model.defaults import (
    EXTRA_STOP,
    TASKS,
    defaults_for,
    preset_for,
    resolve,
)
from vlmq.worker.model.families._base import CAPTION_PROMPT


def test_ocr_prompts_per_family() -> None:
    assert resolve("glm_ocr", "ocr", None, None, None, None).prompt == "Text Recognition:"
    assert resolve("dots_ocr", "ocr", None, None, None, None).prompt == (
        "Convert this page to clean Markdown while preserving reading order."
    )
    assert "Markdown" in resolve("qwen2_5_vl", "ocr", None, None, None, None).prompt


@pytest.mark.parametrize("name", families.names())
def test_every_row_is_greedy_with_extra_stops(name: str) -> None:
    family = families.get(name)
    for row in [family.defaults, *(p.rows for p in family.presets)]:
        assert set(row) == set(TASKS)
        for d in row.values():
            assert d.temperature == 0.0
            assert d.stop[:len(EXTRA_STOP)] == EXTRA_STOP
            assert d.max_tokens > 0
    assert defaults_for(name, "caption") is family.defaults["caption"]


@pytest.mark.parametrize("name", families.names())
def test_every_preset_is_reachable_by_its_names(name: str) -> None:
    """Ids are matched lowercased, so a name piece with a capital could never match."""
    for preset in families.get(name).presets:
        assert preset.source.startswith("https://")
        for piece in preset.names:
            assert piece == piece.lower()
            assert preset_for(name, f"someone/{piece}-7B") is preset


@pytest.mark.parametrize(("model_id", "model_type", "name"), [
    ("allenai/olmOCR-2-7B-1025", "qwen2_5_vl", "olmOCR-2"),
    ("mlx-community/olmOCR-2-7B-1025-4bit", "qwen2_5_vl", "olmOCR-2"),
    ("nanonets/Nanonets-OCR2-3B", "qwen2_5_vl", "Nanonets-OCR2"),
    ("ibm-granite/granite-docling-258M", "idefics3", "granite-docling"),
    ("mlx-community/SmolDocling-256M-preview-mlx-bf16", "idefics3", "SmolDocling"),
    ("lightonai/LightOnOCR-2-1B", "mistral3", "LightOnOCR-2"),
    ("PaddlePaddle/PaddleOCR-VL", "paddleocr_vl", "PaddleOCR-VL"),
    ("zai-org/GLM-OCR", "glm_ocr", "GLM-OCR"),
    ("/models/dots.ocr-bf16", "dots_ocr", "dots.ocr"),
    ("mlx-community/Qwen2.5-VL-7B-Instruct-4bit", "qwen2_5_vl", "Qwen2.5-VL"),
    ("Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl", "Qwen3-VL"),
    ("mlx-community/gemma-3-4b-it-qat-4bit", "gemma3", "Gemma 3"),
])
def test_each_real_checkpoint_gets_its_preset(model_id: str, model_type: str,
                                              name: str) -> None:
    preset = preset_for(model_type, model_id)
    assert preset is not None and preset.name == name
    res = resolve(model_type, "ocr", None, None, None, None, model_id=model_id)
    assert res.prompt == preset.rows["ocr"].prompt


def test_presets_need_the_model_type_and_job_values_still_win() -> None:
    # A Qwen2-VL folder that happens to be named like olmOCR-2 keeps its type's row.
    assert preset_for("qwen2_vl", "/x/olmOCR-2-copy") is None
    olm = resolve("qwen2_5_vl", "ocr", None, None, None, None, model_id="olmOCR-2-7B")
    assert "front matter" in olm.prompt and olm.max_tokens == 8000
    mine = resolve("qwen2_5_vl", "ocr", "Read it.", 5, None, None, model_id="olmOCR-2-7B")
    assert (mine.prompt, mine.max_tokens) == ("Read it.", 5)
    # LightOnOCR is prompted with the page image alone.
    assert resolve("mistral3", "ocr", None, None, None, None,
                   model_id="lightonai/LightOnOCR-2-1B").prompt == ""
    docling = resolve("idefics3", "ocr", None, None, None, None, model_id="granite-docling")
    assert "<end_of_utterance>" in docling.stop


def test_job_values_override_and_stops_merge() -> None:
    r = resolve("qwen2_vl", "caption", "Say hi.", 7, 0.5, ["END", "<|im_end|>"])
    assert (r.prompt, r.max_tokens, r.temperature) == ("Say hi.", 7, 0.5)
    assert r.stop == (*EXTRA_STOP, "END")
    assert resolve("QWEN2_VL", "caption", None, None, None, None).prompt == CAPTION_PROMPT


def test_a_model_type_outside_the_families_has_no_defaults() -> None:
    # The worker refuses such a model at start (deepseekocr: mlx_adapter.REFUSED).
    for model_type in ("deepseekocr", "SomeNewVLM"):
        with pytest.raises(ValueError, match="not one of vlmq's families"):
            resolve(model_type, "caption", None, None, None, None)
        assert preset_for(model_type, "deepseek-ai/DeepSeek-OCR") is None


def test_generate_needs_a_prompt_and_task_must_be_known() -> None:
    with pytest.raises(ValueError, match="needs a prompt"):
        resolve("qwen2_vl", "generate", None, None, None, None)
    assert resolve("qwen2_vl", "generate", "Hi", None, None, None).prompt == "Hi"
    with pytest.raises(ValueError, match="unknown task"):
        resolve("qwen2_vl", "translate", "Hi", None, None, None)
