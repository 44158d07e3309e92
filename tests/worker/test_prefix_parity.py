"""Prefix reuse (worker/engine/prefix_cache.py) through a real engine on tiny models:
greedy output with a cached prefix equals output without it, token for token, in batched
runs; the prefix of one image is prefilled once; the byte budget holds; an entry evicted
while its row waits only costs a full prefill. Counts tokens and bytes, never time."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.factories import random_image
from vlmq.worker.engine import mlx_adapter as A
from vlmq.worker.engine import prefix_cache
from vlmq.worker.engine.batcher import Engine, Finished, Request

CAPTION = "Describe this image."
OTHER = "Read all the text in this image, line by line."
MB = 1024 * 1024


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vlmq.worker.model.tiny import build_tiny_model

    return {arch: build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, seed=0)
            for arch in ("qwen2_vl", "qwen2_5_vl", "glm_ocr", "idefics3")}


class Bench:
    """An engine over one tiny model, and what builds its requests."""

    def __init__(self, model: Path, budget: int, max_batch: int = 8) -> None:
        from mlx_vlm import load

        self.engine = Engine(str(model), max_batch=max_batch, prefix_cache_bytes=budget)
        self.engine.wait_ready(timeout=120)
        self.model, self.processor = load(str(model))

    def request(self, key: object, seed: int, prompt: str, max_tokens: int = 12,
                constraint: Any = None) -> Request:
        prep = A.prepare(self.processor, self.model.config, random_image(seed, (112, 112)),
                         prompt)
        return Request(key=key, prepared=prep, cached_features=None, max_tokens=max_tokens,
                       temperature=0.0, stop=(), prefix_key=f"image-{seed}",
                       constraint=constraint)

    def run(self, reqs: list[Request], timeout: float = 180) -> dict[object, Finished]:
        for r in reqs:
            self.engine.submit(r)
        got: dict[object, Finished] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(reqs) and time.monotonic() < deadline:
            for f in self.engine.get_finished(timeout=0.2):
                got[f.key] = f
        assert len(got) == len(reqs), f"{len(got)}/{len(reqs)} came back"
        return got

    def close(self) -> None:
        self.engine.close(timeout=10)


def _passes(bench: Bench) -> list[dict[object, Finished]]:
    """A first pass, a second with a new prompt, a retry of the first with more tokens."""
    first = [bench.request(("a", s), s, CAPTION) for s in range(4)]
    second = [bench.request(("b", s), s, OTHER) for s in range(4)]
    retry = [bench.request(("c", s), s, CAPTION, max_tokens=20) for s in range(4)]
    return [bench.run(first), bench.run(second), bench.run(retry)]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "glm_ocr", "idefics3"])
def test_cached_prefix_gives_the_same_tokens(models: dict[str, Path], arch: str) -> None:
    assert prefix_cache.reason_off(arch) is None
    outs = {}
    for budget in (0, 8 * MB):
        bench = Bench(models[arch], budget)
        try:
            outs[budget] = _passes(bench)
            stats = bench.engine.stats()
        finally:
            bench.close()
    for cold, warm in zip(outs[0], outs[8 * MB], strict=True):
        assert {k: f.tokens for k, f in warm.items()} == {k: f.tokens for k, f in cold.items()}
        assert all(f.error is None for f in warm.values())
    # the retry always reuses its image's prefix; a new prompt does where the image
    # comes first in the family's template
    assert all(f.prefix_tokens > 0 for f in outs[8 * MB][2].values())
    image_first = arch != "qwen2_vl"
    assert all((f.prefix_tokens > 0) == image_first for f in outs[8 * MB][1].values())
    assert stats["prefix_hits"] == 4 + 4 * image_first
