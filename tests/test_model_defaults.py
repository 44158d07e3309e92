"""The defaults table: job values win, model stop markers always apply."""

from __future__ import annotations

import pytest

from vlmq.worker.model_defaults import (
    CAPTION_PROMPT,
    DEFAULTS,
    EXTRA_STOP,
    FALLBACK,
    PRESETS,
    TASKS,
    preset_for,
    resolve,
)


def test_ocr_prompts_per_family() -> None:
    assert resolve("glm_ocr", "ocr", None, None, None, None).prompt == "Text Recognition:"
    assert resolve("deepseekocr", "ocr", None, None, None, None).prompt == (
        "Convert the document to markdown."
    )
    assert resolve("dots_ocr", "ocr", None, None, None, None).prompt == (
        "Convert this page to clean Markdown while preserving reading order."
    )
    assert "Markdown" in resolve("qwen2_5_vl", "ocr", None, None, None, None).prompt


def test_every_row_is_greedy_with_extra_stops() -> None:
    for row in [*DEFAULTS.values(), FALLBACK, *(p.rows for p in PRESETS)]:
        assert set(row) == set(TASKS)
        for d in row.values():
            assert d.temperature == 0.0
            assert d.stop[:len(EXTRA_STOP)] == EXTRA_STOP
            assert d.max_tokens > 0


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
    ("deepseek-ai/DeepSeek-OCR", "deepseekocr", "DeepSeek-OCR"),
    ("mlx-community/Qwen2.5-VL-7B-Instruct-4bit", "qwen2_5_vl", "Qwen2.5-VL"),
    ("Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl", "Qwen3-VL"),
    ("mlx-community/gemma-3-4b-it-qat-4bit", "gemma3", "Gemma 3"),
])
def test_each_real_checkpoint_gets_its_preset(model_id: str, model_type: str,
                                              name: str) -> None:
    preset = preset_for(model_type, model_id)
    assert preset is not None and preset.name == name
    assert preset.source.startswith("https://")
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


def test_unknown_model_uses_fallback() -> None:
    r = resolve("SomeNewVLM", "caption", None, None, None, None)
    assert r.prompt == CAPTION_PROMPT
    assert r.max_tokens == FALLBACK["caption"].max_tokens


def test_generate_needs_a_prompt_and_task_must_be_known() -> None:
    with pytest.raises(ValueError, match="needs a prompt"):
        resolve("qwen2_vl", "generate", None, None, None, None)
    assert resolve("qwen2_vl", "generate", "Hi", None, None, None).prompt == "Hi"
    with pytest.raises(ValueError, match="unknown task"):
        resolve("qwen2_vl", "translate", "Hi", None, None, None)
