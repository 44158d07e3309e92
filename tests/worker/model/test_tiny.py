"""The tiny model is a real mlx-vlm checkpoint whose output depends on the image."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.support.factories import random_image
from vlmq.worker.model import families
from vlmq.worker.model.tiny import SIZES, build_tiny_model


def _greedy_ids(model, processor, image: Image.Image, max_tokens: int = 8) -> list[int]:
    from mlx_vlm import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    prompt = apply_chat_template(processor, model.config, "Describe this image.", num_images=1)
    *_, last = stream_generate(
        model, processor, prompt, image=[image], max_tokens=max_tokens, temperature=0.0
    )
    return list(last.token_ids)


def test_loads_with_mlx_vlm_processor(tiny_model: Path) -> None:
    from mlx_vlm import load

    model, processor = load(str(tiny_model))
    assert type(processor).__module__.startswith("mlx_vlm")
    assert model.config.model_type == "qwen2_vl"
    tok = processor.tokenizer
    assert model.config.vocab_size == len(tok)
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")


def test_distinct_images_give_distinct_outputs(tiny_model: Path) -> None:
    from mlx_vlm import load

    model, processor = load(str(tiny_model))
    outputs = {tuple(_greedy_ids(model, processor, random_image(seed, (224, 224))))
               for seed in range(4)}
    assert len(outputs) == 4


def test_same_seed_same_bytes_and_reuse(tmp_path: Path, tiny_model: Path) -> None:
    again = build_tiny_model(tmp_path / "again", arch="qwen2_vl", seed=0)
    digest = hashlib.sha256((tiny_model / "model.safetensors").read_bytes()).hexdigest()
    assert hashlib.sha256((again / "model.safetensors").read_bytes()).hexdigest() == digest
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(again, arch="qwen2_vl", seed=0) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime
    other = build_tiny_model(tmp_path / "other", arch="qwen2_vl", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_qwen2_5_vl_loads_and_generates(tmp_path: Path) -> None:
    from mlx_vlm import load

    path = build_tiny_model(tmp_path / "q25", arch="qwen2_5_vl", seed=0)
    model, processor = load(str(path))
    assert type(processor).__module__.startswith("mlx_vlm")
    assert model.config.model_type == "qwen2_5_vl"
    assert len(_greedy_ids(model, processor, random_image(0, (112, 84)), max_tokens=4)) == 4


def test_unknown_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny arch"):
        build_tiny_model(tmp_path, arch="llava")


def _placeholders(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _placeholders(v)
    elif isinstance(value, list):
        for v in value:
            yield from _placeholders(v)
    elif isinstance(value, str) and value.startswith("@") and value != "@vocab":
        yield value[1:]


@pytest.mark.parametrize("name", families.names())
def test_each_family_recipe_names_only_its_own_tokens(name: str) -> None:
    """Checked without building: a wrong token name would fail only deep in the build."""
    build = families.get(name).tiny
    assert build.config["model_type"] == name
    named = {build.eos, build.pad} | ({build.bos} if build.bos else set())
    assert named <= set(build.specials)
    assert set(_placeholders([build.config, build.tokenizer_extra])) <= set(build.specials)
    assert set(build.sizes) <= set(SIZES) - {"tiny"}


def test_a_size_exists_only_for_families_that_list_it(tmp_path: Path) -> None:
    assert "bench" in families.get("qwen2_vl").tiny.sizes
    with pytest.raises(ValueError, match="no 'bench' size for arch 'gemma3'"):
        build_tiny_model(tmp_path, arch="gemma3", size="bench")
