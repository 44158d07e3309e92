"""The defaults table: job values win, model stop markers always apply."""

from __future__ import annotations

import pytest

from vlmq.worker.model_defaults import (
    CAPTION_PROMPT,
    DEFAULTS,
    EXTRA_STOP,
    FALLBACK,
    TASKS,
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
    for row in [*DEFAULTS.values(), FALLBACK]:
        assert set(row) == set(TASKS)
        for d in row.values():
            assert d.temperature == 0.0
            assert d.stop == EXTRA_STOP
            assert d.max_tokens > 0


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
