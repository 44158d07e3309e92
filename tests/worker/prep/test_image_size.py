"""The image the model sees is the one vlmq chose, and the transformers lines filtered at
worker start are noise.

vlmq decodes an input with its longest side at most the job's max_side (worker/prep/
decode.py); a Qwen-style processor then fits it to its own pixel bounds (smart_resize:
sides multiples of patch x merge, area within min_pixels..max_pixels, the processor
config vlmq keys its vision cache by). These tests follow one image through the worker's
own calls (decode_image, mlx_adapter.prepare, build_prompt_kwargs, vision_features) and
check the grid, the pixel rows and the image tokens the language model gets against that
arithmetic, done here independently, for two processor shapes (qwen2_vl: 14 px patches,
qwen3_vl: 16 px).

The "Kwargs passed to `processor.__call__` have to be in `processor_kwargs`" warning
comes from the chat template step, not the image processor: mlx-vlm adds
enable_thinking=False for every processor, and a template without that variable renders
the same text with or without it. The pinning test below fails the day it does not.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from vlmq.worker.model import blas

blas.select()

from vlmq.worker.model import mlx_adapter  # noqa: E402
from vlmq.worker.prep.decode import decode_image  # noqa: E402

NOISE = "Kwargs passed to `processor.__call__` have to be in"


def smart_resize(h: int, w: int, factor: int, lo: int, hi: int) -> tuple[int, int]:
    """Qwen2-VL's rule, written out: round each side to the factor, then scale the area
    into [lo, hi] keeping the aspect."""
    hb, wb = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if hb * wb > hi:
        beta = math.sqrt(h * w / hi)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < lo:
        beta = math.sqrt(lo / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str,
                                                                      mlx_adapter.LoadedModel]]:
    from vlmq.worker.model.tiny import build_tiny_model

    out = {}
    for arch in ("qwen2_vl", "qwen3_vl", "gemma3"):
        folder = build_tiny_model(tmp_path_factory.mktemp(f"size-{arch}"), arch=arch, seed=0)
        out[arch] = mlx_adapter.load_model(str(folder))
    yield out


def png(w: int, h: int) -> bytes:
    rng = np.random.default_rng(w * 7919 + h)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def seen(loaded: mlx_adapter.LoadedModel, data: bytes, max_side: int | None) -> dict[str, Any]:
    """What the model gets for one image, through the worker's calls."""
    image = decode_image(data, max_side)
    prepared = mlx_adapter.prepare(loaded.processor, loaded.model.config, image, "Read the page.")
    ids, kwargs = mlx_adapter.build_prompt_kwargs(loaded.model, loaded.processor, prepared, None)
    feats = mlx_adapter.vision_features(loaded.model, prepared)
    feats = feats[0] if isinstance(feats, tuple) else feats  # qwen3_vl: (features, deepstack)
    image_id = loaded.processor.tokenizer.convert_tokens_to_ids(loaded.processor.image_token)
    return {"decoded": image.size, "grid": np.asarray(kwargs["image_grid_thw"]).tolist(),
            "pixel_rows": int(np.asarray(prepared.pixel_values).shape[0]),
            "image_tokens": ids.count(image_id), "features": int(feats.shape[0])}


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize(("size", "max_side"), [
    ((640, 320), 112),    # max_side binds: 112 x 56 px
    ((640, 320), 200),    # max_side binds, sides rounded to the patch grid
    ((640, 320), None),   # the processor's max_pixels binds
    ((60, 40), 1000),     # tiny input: never upscaled by vlmq, min_pixels lifts it
])
def test_the_model_sees_the_size_vlmq_chose(models: dict[str, mlx_adapter.LoadedModel], arch: str,
                                            size: tuple[int, int],
                                            max_side: int | None) -> None:
    loaded = models[arch]
    ip = loaded.processor.image_processor
    patch, merge = int(ip.patch_size), int(ip.merge_size)
    lo, hi = int(ip.min_pixels), int(ip.max_pixels)
    got = seen(loaded, png(*size), max_side)
    w, h = size
    if max_side is not None and max(w, h) > max_side:
        scale = max_side / max(w, h)
        w, h = (max_side, round(h * scale)) if w >= h else (round(w * scale), max_side)
    assert got["decoded"] == (w, h)  # vlmq's choice: longest side <= max_side
    hb, wb = smart_resize(h, w, patch * merge, lo, hi)
    assert got["grid"] == [[1, hb // patch, wb // patch]]
    assert got["pixel_rows"] == (hb // patch) * (wb // patch)  # one row per patch
    assert got["image_tokens"] == got["features"] == got["pixel_rows"] // merge**2


def test_max_side_changes_what_the_model_sees(models: dict[str, mlx_adapter.LoadedModel]) -> None:
    """The choice takes effect: a smaller max_side, fewer image tokens."""
    loaded = models["qwen2_vl"]
    data = png(640, 320)
    small, large = seen(loaded, data, 112), seen(loaded, data, 224)
    assert small["image_tokens"] < large["image_tokens"]


def test_fixed_size_processors_see_their_own_size(models: dict[str,
                                                               mlx_adapter.LoadedModel]) -> None:
    """gemma3 resizes every image to its processor's square: max_side only bounds the
    detail kept, not the tokens (the deferred path, mlx-vlm's prepare_inputs)."""
    loaded = models["gemma3"]
    counts = set()
    for max_side in (56, 300, None):
        image = decode_image(png(640, 320), max_side)
        prepared = mlx_adapter.prepare(loaded.processor, loaded.model.config, image, "Read.")
        ids, _ = mlx_adapter.build_prompt_kwargs(loaded.model, loaded.processor, prepared, None)
        counts.add(len(ids))
    assert len(counts) == 1


# --- the warning: what it is about, and that only it is filtered --------------------------


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records() -> Iterator[Records]:
    mlx_adapter.quiet_library_noise()
    handler = Records()
    logger = logging.getLogger("transformers.processing_utils")
    # mlx_vlm sets TRANSFORMERS_VERBOSITY=error when it is imported before transformers;
    # whichever comes first, the filter must not depend on it, so warnings show here.
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])  # gemma3's is the tokenizer's
def test_enable_thinking_changes_nothing_the_template_renders(
        models: dict[str, mlx_adapter.LoadedModel], arch: str) -> None:
    """Pinning test: the only kwarg mlx-vlm adds is one these templates ignore. If a
    template starts reading it, this fails, and the filter must go."""
    processor = models[arch].processor
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "Read."}]}]
    plain = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with_kw = processor.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=True, enable_thinking=False)
    assert plain == with_kw


def test_format_prompt_warns_no_more_but_others_still_do(models: dict[str, mlx_adapter.LoadedModel],
                                                         records: Records) -> None:
    loaded = models["qwen2_vl"]
    mlx_adapter.format_prompt(loaded.processor, loaded.model.config, "Read.", num_images=1)
    assert not [m for m in records.messages if m.startswith(NOISE)]
    # The same warning for a call vlmq did not make stays: the filter is scoped.
    loaded.processor.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                         unknown_kwarg=1)
    assert [m for m in records.messages if m.startswith(NOISE)]


def test_the_worker_logs_neither_line(tiny_model: Path, tmp_path: Path) -> None:
    """A real `vlmq worker` start (Redis out of reach ends it after the imports)."""
    import os
    import subprocess
    import sys

    from vlmq.worker.redis_server import free_port

    vlmq = Path(sys.executable).with_name("vlmq")
    proc = subprocess.run(
        [str(vlmq), "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "worker", "--model",
         str(tiny_model), "--burst"], capture_output=True, text=True, timeout=300,
        env={"HOME": str(tmp_path), "PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    assert proc.returncode == 69, proc.stderr
    assert "PyTorch was not found" not in proc.stderr
    assert "[transformers]" not in proc.stderr, proc.stderr
