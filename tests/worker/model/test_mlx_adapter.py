"""Pins the mlx-vlm behaviour vlmq relies on, through the real tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.support.factories import random_image
from vlmq.worker.model import families, mlx_adapter
from vlmq.worker.model.tiny import build_tiny_model

PROMPT = "Read this page."


@pytest.fixture(scope="module")
def loaded(tiny_model: Path) -> mlx_adapter.LoadedModel:
    return mlx_adapter.load_model(str(tiny_model))


def _greedy(loaded: mlx_adapter.LoadedModel, ids: list[int], kwargs: dict,
            max_tokens: int) -> list[int]:
    """Tokens from mlx-vlm's BatchGenerator for one request (the engine's path)."""
    from mlx_vlm.generate import BatchGenerator

    gen = BatchGenerator(loaded.model.language_model, loaded.processor, compute_logprobs=False)
    (uid,) = gen.insert([ids], max_tokens=max_tokens, prompt_kwargs=[kwargs])
    out: list[int] = []
    while gen.has_work:
        for r in gen.next()[1]:
            assert r.uid == uid
            out.append(r.token)
    gen.close()
    return out


def _sequential(loaded: mlx_adapter.LoadedModel, image: Image.Image, max_tokens: int) -> list[int]:
    from mlx_vlm import stream_generate

    text = mlx_adapter.format_prompt(loaded.processor, loaded.model.config, PROMPT, num_images=1)
    *_, last = stream_generate(
        loaded.model,
        loaded.processor,
        text,
        image=[image],
        max_tokens=max_tokens,
        temperature=0.0,
    )
    return list(last.token_ids)


def test_load_reports_type_and_cacheability(loaded: mlx_adapter.LoadedModel,
                                            tiny_model: Path) -> None:
    assert loaded.model_type == "qwen2_vl"
    assert loaded.cacheable and loaded.family is families.get("qwen2_vl").spec
    assert loaded.context_length == 4096
    assert loaded.model_id == str(tiny_model)


@pytest.mark.parametrize("name", families.names())
def test_each_family_is_accepted_and_its_spec_is_coherent(name: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(f'{{"model_type": "{name.upper()}"}}')
    assert mlx_adapter.check_family(tmp_path, name) == name
    spec = mlx_adapter.family_of(name)
    assert spec is families.get(name).spec
    # Cached features and per-row positions both ride on the grid (numpy) path.
    assert spec.grid_prep or not (spec.cacheable or spec.rope_index)
    assert spec.cacheable or spec.cache_off  # uncached always says why


def test_refused_types_are_not_families() -> None:
    assert not set(mlx_adapter.REFUSED) & set(families.names())
    with pytest.raises(ValueError, match="not one of vlmq's families"):
        mlx_adapter.family_of("deepseekocr")


def test_load_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(mlx_adapter.ModelLoadError, match=r"no config\.json"):
        mlx_adapter.load_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl"}')
    with pytest.raises(mlx_adapter.ModelLoadError, match="cannot load model"):
        mlx_adapter.load_model(str(tmp_path))
    with pytest.raises(mlx_adapter.ModelLoadError, match="does not exist"):
        mlx_adapter.load_model(str(tmp_path / "missing"))
    with pytest.raises(mlx_adapter.ModelLoadError, match="cannot load model 'not a repo id!'"):
        mlx_adapter.load_model("not a repo id!")


@pytest.mark.parametrize("size", [(224, 224), (300, 120), (64, 200), (57, 57), (500, 400)])
def test_prepare_matches_processor_and_hit_path(loaded: mlx_adapter.LoadedModel, size) -> None:
    proc, cfg = loaded.processor, loaded.model.config
    image = random_image(1, size)
    prep = mlx_adapter.prepare(proc, cfg, image, PROMPT)
    assert isinstance(prep.input_ids, np.ndarray)
    assert isinstance(prep.pixel_values, np.ndarray)
    assert isinstance(prep.image_grid_thw, np.ndarray)

    ref = proc(text=[prep.text], images=[image], padding=True)  # mlx-vlm's own call
    assert prep.input_ids.tolist() == np.array(ref["input_ids"])[0].tolist()
    assert np.array_equal(prep.pixel_values, np.array(ref["pixel_values"]))
    assert prep.image_grid_thw.tolist() == np.array(ref["image_grid_thw"]).tolist()

    hit = mlx_adapter.prepare_from_grid(proc, cfg, prep.image_grid_thw, PROMPT)
    assert hit.pixel_values is None
    assert hit.input_ids.tolist() == prep.input_ids.tolist()


def test_text_only_prepare(loaded: mlx_adapter.LoadedModel) -> None:
    prep = mlx_adapter.prepare(loaded.processor, loaded.model.config, None, "Hello there.")
    assert prep.pixel_values is None and prep.image_grid_thw is None
    assert loaded.processor.image_token not in prep.text
    ids, kwargs = mlx_adapter.build_prompt_kwargs(loaded.model, loaded.processor, prep, None)
    assert ids == prep.input_ids.tolist()
    assert kwargs["inputs_embeds"].shape[:2] == (1, len(ids))


def test_uncached_path_matches_sequential_generate(loaded: mlx_adapter.LoadedModel) -> None:
    image = random_image(2, (224, 168))
    prep = mlx_adapter.prepare(loaded.processor, loaded.model.config, image, PROMPT)
    ids, kwargs = mlx_adapter.build_prompt_kwargs(loaded.model, loaded.processor, prep, None)
    assert _greedy(loaded, ids, kwargs, 8) == _sequential(loaded, image, 8)


def test_cached_features_give_same_tokens(loaded: mlx_adapter.LoadedModel) -> None:
    proc, cfg, model = loaded.processor, loaded.model.config, loaded.model
    image = random_image(3, (224, 224))
    miss = mlx_adapter.prepare(proc, cfg, image, PROMPT)
    feats = mlx_adapter.vision_features(model, miss)
    assert feats.shape[0] == int(miss.input_ids.tolist().count(cfg.image_token_id))

    ids_u, kw_u = mlx_adapter.build_prompt_kwargs(model, proc, miss, None)
    arr, name = mlx_adapter.features_to_numpy(feats)
    hit = mlx_adapter.prepare_from_grid(proc, cfg, miss.image_grid_thw, PROMPT)
    ids_c, kw_c = mlx_adapter.build_prompt_kwargs(model, proc, hit,
                                                  mlx_adapter.features_from_numpy(arr, name))
    assert ids_c == ids_u
    assert np.array_equal(np.array(kw_c["inputs_embeds"]), np.array(kw_u["inputs_embeds"]))
    assert np.array_equal(np.array(kw_c["position_ids"]), np.array(kw_u["position_ids"]))
    assert _greedy(loaded, ids_c, kw_c, 8) == _greedy(loaded, ids_u, kw_u, 8)


def test_cached_features_are_really_used(loaded: mlx_adapter.LoadedModel) -> None:
    """Features of another same-size image change the output: the hit path runs no tower."""
    proc, cfg, model = loaded.processor, loaded.model.config, loaded.model
    a = mlx_adapter.prepare(proc, cfg, random_image(4, (224, 224)), PROMPT)
    b = mlx_adapter.prepare(proc, cfg, random_image(5, (224, 224)), PROMPT)
    hit = mlx_adapter.prepare_from_grid(proc, cfg, a.image_grid_thw, PROMPT)
    ids, kw_with_b = mlx_adapter.build_prompt_kwargs(model, proc, hit,
                                                     mlx_adapter.vision_features(model, b))
    ids_b, kw_b = mlx_adapter.build_prompt_kwargs(model, proc, b, None)
    assert _greedy(loaded, ids, kw_with_b, 6) == _greedy(loaded, ids_b, kw_b, 6)
    ids_a, kw_a = mlx_adapter.build_prompt_kwargs(model, proc, a, None)
    assert _greedy(loaded, ids_a, kw_a, 6) != _greedy(loaded, ids, kw_with_b, 6)


def test_numpy_round_trip_is_exact(loaded: mlx_adapter.LoadedModel) -> None:
    import mlx.core as mx

    prep = mlx_adapter.prepare(loaded.processor, loaded.model.config, random_image(6, (112, 112)),
                               PROMPT)
    feats = mlx_adapter.vision_features(loaded.model, prep)
    arr, name = mlx_adapter.features_to_numpy(feats)
    assert (name, arr.dtype) == ("float32", np.float32)
    back = mlx_adapter.features_from_numpy(arr, name)
    assert back.dtype == mx.float32 and mx.array_equal(back, feats).item()

    bf = feats.astype(mx.bfloat16)
    arr16, name16 = mlx_adapter.features_to_numpy(bf)
    assert (name16, arr16.dtype) == ("bfloat16", np.uint16)
    back16 = mlx_adapter.features_from_numpy(arr16, name16)
    assert back16.dtype == mx.bfloat16
    assert mx.array_equal(back16.view(mx.uint16), bf.view(mx.uint16)).item()
    with pytest.raises(ValueError, match="unknown MLX dtype"):
        mlx_adapter.features_from_numpy(arr, "complex_float9")


def test_qwen2_5_vl_hit_path(tmp_path: Path) -> None:
    loaded = mlx_adapter.load_model(str(build_tiny_model(tmp_path / "q25", arch="qwen2_5_vl")))
    assert loaded.cacheable
    proc, cfg, model = loaded.processor, loaded.model.config, loaded.model
    miss = mlx_adapter.prepare(proc, cfg, random_image(7, (168, 112)), PROMPT)
    hit = mlx_adapter.prepare_from_grid(proc, cfg, miss.image_grid_thw, PROMPT)
    assert hit.input_ids.tolist() == miss.input_ids.tolist()
    _, kw_u = mlx_adapter.build_prompt_kwargs(model, proc, miss, None)
    _, kw_c = mlx_adapter.build_prompt_kwargs(model, proc, hit, mlx_adapter.vision_features(model,
                                                                                            miss))
    assert np.array_equal(np.array(kw_c["inputs_embeds"]), np.array(kw_u["inputs_embeds"]))


def test_deferred_path_matches_numpy_path(loaded: mlx_adapter.LoadedModel) -> None:
    """The generic (MLX-thread) preparation used for non-Qwen families gives the same tokens."""
    image = random_image(8, (224, 140))
    prep = mlx_adapter.prepare(loaded.processor, loaded.model.config, image, PROMPT)
    deferred = mlx_adapter.Prepared(text=prep.text, input_ids=None, deferred_image=image)
    assert deferred.prompt_tokens is None
    ids_d, kw_d = mlx_adapter.build_prompt_kwargs(loaded.model, loaded.processor, deferred, None)
    ids_n, kw_n = mlx_adapter.build_prompt_kwargs(loaded.model, loaded.processor, prep, None)
    assert ids_d == ids_n
    assert _greedy(loaded, ids_d, kw_d, 6) == _greedy(loaded, ids_n, kw_n, 6)


def test_fingerprint_follows_the_weights(tiny_model: Path, tmp_path: Path) -> None:
    import shutil

    copy = Path(shutil.copytree(tiny_model, tmp_path / "m"))
    first = mlx_adapter.fingerprint(copy)
    assert mlx_adapter.fingerprint(copy) == first
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b"\0")
    assert mlx_adapter.fingerprint(copy) != first
