"""Pins what interactive requests take from mlx-vlm (worker/model/mlx_adapter.py): a
conversation renders through the model's own chat template (system, user and assistant
turns, the image at the start of the turn that carries it), and the streaming
detokenizer's text is the start of the whole decode, whole characters only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vlmq.shared.chat import Message, check_messages
from vlmq.worker.model import mlx_adapter


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> mlx_adapter.LoadedModel:
    return mlx_adapter.load_model(str(tiny_model))


def _render(loaded: mlx_adapter.LoadedModel, prompt: mlx_adapter.Prompt,
            images: int = 1) -> str:
    return mlx_adapter.format_prompt(loaded.processor, loaded.model.config, prompt, images)


TURNS = check_messages([
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is in the picture?", "image": True},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": "What colour is it?"},
])


def test_a_multi_turn_conversation_renders_every_turn_in_order_with_the_template(
        loaded: mlx_adapter.LoadedModel) -> None:
    text = _render(loaded, TURNS)
    # qwen2_vl's template: ChatML turns, the image's pad between vision markers, and the
    # assistant's turn opened at the end for the model to answer.
    expected = ("<|im_start|>system\nYou answer in one word.<|im_end|>\n"
                "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                "What is in the picture?<|im_end|>\n"
                "<|im_start|>assistant\nA cat.<|im_end|>\n"
                "<|im_start|>user\nWhat colour is it?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert text == expected


def test_the_image_goes_in_the_turn_that_carries_it_and_nowhere_without_an_image(
        loaded: mlx_adapter.LoadedModel) -> None:
    later = check_messages([{"role": "user", "content": "Hi."},
                            {"role": "assistant", "content": "Hello."},
                            {"role": "user", "content": "And this?", "image": True}])
    text = _render(loaded, later)
    assert text.count("<|image_pad|>") == 1
    assert text.index("Hi.") < text.index("Hello.") < text.index("<|image_pad|>")
    # A text item: the marked turn renders as text alone.
    assert "<|image_pad|>" not in _render(loaded, TURNS, images=0)


def test_the_image_leads_its_turn_where_a_text_prompt_has_it_last(
        loaded: mlx_adapter.LoadedModel) -> None:
    """A conversation puts the image first in its turn (what Qwen's own examples do, and
    what lets a second question about the image share its prefill); mlx-vlm puts it after
    a job's text prompt. Either way the rest of the template is the same."""
    one = _render(loaded, (Message("user", "Read this page.", image=True),))
    text = _render(loaded, "Read this page.")
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    assert image + "Read this page.<|im_end|>" in one
    assert "Read this page." + image + "<|im_end|>" in text
    assert one.replace(image, "") == text.replace(image, "")


def test_the_streaming_text_is_the_decode_so_far_token_by_token(
        loaded: mlx_adapter.LoadedModel) -> None:
    proc = loaded.processor
    # Multi-byte characters split over tokens, spaces, and a special token.
    text = "Grüße, 東京 — naïve café! <|im_end|> ok ✓"
    ids = [int(i) for i in np.asarray(proc.tokenizer(text, add_special_tokens=False)
                                      ["input_ids"])]
    detok = mlx_adapter.streaming_detokenizer(proc)
    for k, token in enumerate(ids, 1):
        detok.add_token(token)
        so_far, end = mlx_adapter.streamable(detok, (), 0)
        whole = mlx_adapter.decode(proc, ids[:k])
        assert "\ufffd" not in so_far[:end]
        # Each token's text as soon as its characters are whole, not a word later.
        assert so_far[:end] == whole.rstrip("\ufffd"), (k, so_far, whole)
    detok.finalize()
    assert detok.text == mlx_adapter.decode(proc, ids) == text
    # A second detokenizer starts empty: rows never share one.
    assert mlx_adapter.streaming_detokenizer(proc).text == ""


class _Text:
    def __init__(self, text: str) -> None:
        self.text = text


@pytest.mark.parametrize(("text", "stops", "end"), [
    ("Hello wor", (), 9),
    ("caf\ufffd", (), 3),  # a character whose bytes have not all come
    ("answer<|im", ("<|im_end|>",), 6),  # could be the start of a stop string
    ("answer<|im_end|>more", ("<|im_end|>",), 6),  # is one
    ("a <", ("<|im_end|>",), 2),
    ("a < b", ("</s>", "<|im_end|>"), 5),
])
def test_streamable_text_stops_where_a_stop_string_could_begin(
        text: str, stops: tuple[str, ...], end: int) -> None:
    detok: Any = _Text(text)
    assert mlx_adapter.streamable(detok, stops, 0) == (text, end)
