"""Prefix reuse (worker/engine/prefix_cache.py) through a real engine on tiny models:
greedy output with a cached prefix equals output without it, token for token, in batched
runs; the prefix of one image is prefilled once; the byte budget holds; an entry evicted
while its row waits only costs a full prefill. Counts tokens and bytes, never time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import engine_rig
from tests.support.factories import random_image
from vlmq.worker.engine import prefix_cache
from vlmq.worker.engine.batcher import Engine, Finished, Request
from vlmq.worker.engine.constraints import Structured
from vlmq.worker.model import mlx_adapter

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

    def __init__(self, model: Path, budget: int, max_batch: int = 8,
                 repetition: Any = None) -> None:
        from mlx_vlm import load

        self.engine = Engine(str(model), max_batch=max_batch, prefix_cache_bytes=budget,
                             repetition=repetition)
        self.engine.wait_ready(timeout=120)
        self.model, self.processor = load(str(model))

    def request(self, key: object, seed: int, prompt: str, max_tokens: int = 12,
                constraint: Any = None) -> Request:
        prep = mlx_adapter.prepare(self.processor, self.model.config, random_image(seed, (112,
                                                                                          112)),
                                   prompt)
        return Request(key=key, prepared=prep, cached_features=None, max_tokens=max_tokens,
                       temperature=0.0, stop=(), prefix_key=f"image-{seed}",
                       constraint=constraint)

    def run(self, reqs: list[Request], timeout: float = 180) -> dict[object, Finished]:
        return engine_rig.run(self.engine, reqs, timeout)

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


def test_two_jobs_with_one_image_in_one_window_prefill_it_once(
        models: dict[str, Path]) -> None:
    bench = Bench(models["qwen2_5_vl"], 8 * MB)
    try:
        reqs = [bench.request(("job1", 0), 7, CAPTION), bench.request(("job2", 0), 7, OTHER)]
        got = bench.run(reqs)
        stats = bench.engine.stats()
    finally:
        bench.close()
    n1, n2 = (got[r.key].prompt_tokens for r in reqs)
    shared = got[("job2", 0)].prefix_tokens
    assert shared > 0 and got[("job1", 0)].prefix_tokens == 0
    assert stats["prefix_hits"] == 1 and stats["prefix_tokens_skipped"] == shared
    assert stats["prefill_tokens"] == n1 + n2 - shared  # the image's prefix once


def test_a_budget_of_a_few_mb_holds_and_evictions_mid_batch_change_nothing(
        models: dict[str, Path]) -> None:
    """One tiny-model snapshot is 256 KB (2 layers, whole 256-token steps): 600 KB holds
    two, so six images evict each other while their rows wait in the batch."""
    budget = 600 * 1024
    reqs: dict[int, list[Finished]] = {}
    for b in (0, budget):
        bench = Bench(models["qwen2_5_vl"], b)
        try:
            mixed = [bench.request((p, s), s, p) for s in range(6) for p in (CAPTION, OTHER)]
            got = bench.run(mixed)
            reqs[b] = [got[r.key] for r in mixed]
            st = bench.engine.state
            peak, hits = st.peak_prefix_bytes, st.prefix_hits
        finally:
            bench.close()
    assert [f.tokens for f in reqs[budget]] == [f.tokens for f in reqs[0]]
    assert 0 < peak <= budget
    assert hits > 0


def test_constrained_rows_keep_their_output(models: dict[str, Path]) -> None:
    schema = {"type": "object", "properties": {"total": {"type": "number"}},
              "required": ["total"]}
    outs = []
    for budget in (0, 8 * MB):
        bench = Bench(models["qwen2_5_vl"], budget)
        try:
            structured = Structured(bench.processor.tokenizer,
                                    mlx_adapter.eos_token_ids(bench.processor))
            reqs = [bench.request((i, s), s, "Extract the fields as JSON.", max_tokens=40,
                                  constraint=structured.row(schema))
                    for i in range(2) for s in range(2)]
            got = bench.run(reqs)
            outs.append([(got[r.key].tokens, got[r.key].error) for r in reqs])
            hits = bench.engine.stats()["prefix_hits"]
        finally:
            bench.close()
    assert outs[1] == outs[0]
    assert hits == 2


def test_families_off_say_why() -> None:
    assert prefix_cache.reason_off("gemma3") is not None
    assert prefix_cache.reason_off("qwen3_vl") is not None
    assert prefix_cache.reason_off("mistral3") == prefix_cache.UNVERIFIED
    # prompt-first qwen2_vl: verified, off unless --prefix-cache-mb is given
    assert prefix_cache.reason_off("qwen2_vl", given=False) is not None
    assert prefix_cache.reason_off("qwen2_5_vl", given=False) is None


def test_the_repetition_guards_retry_starts_from_the_cached_prefix(
        models: dict[str, Path]) -> None:
    """A looping row retried hotter is inserted again: its prefix is found, not prefilled;
    rows that do not loop keep the tokens they have without reuse."""
    from vlmq.worker.engine.repetition import RepetitionGuard

    guard = RepetitionGuard(max_period=4, min_repeats=3, min_span=3, on_repetition="retry")
    outs = []
    for budget in (0, 8 * MB):
        bench = Bench(models["qwen2_5_vl"], budget, repetition=guard)
        try:
            reqs = [bench.request(s, s, CAPTION, max_tokens=48) for s in range(8)]
            outs.append(bench.run(reqs))
        finally:
            bench.close()
    cold, warm = outs
    retried = [k for k, f in warm.items() if f.repetition and "retried" in f.repetition]
    assert retried, "a random tiny model loops on some images"
    assert all(warm[k].prefix_tokens > 0 for k in retried)
    plain = [k for k, f in cold.items() if f.repetition is None]
    assert all(warm[k].tokens == cold[k].tokens for k in plain)


def test_a_prompt_first_family_is_off_by_default_and_says_why(
        models: dict[str, Path]) -> None:
    for arch, off in (("qwen2_vl", True), ("qwen2_5_vl", False)):
        engine = Engine(str(models[arch]), max_batch=2, prefix_cache_bytes=None)
        try:
            engine.wait_ready(timeout=120)
            assert bool(engine.state.prefix_off) == off, engine.state.prefix_off
        finally:
            engine.close(timeout=10)
