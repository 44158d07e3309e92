"""Memory admission: sequences in flight never hold more than --max-kv-tokens of KV cache."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.support import engine_rig
from vlmq.worker.engine.batcher import Engine, Request, kv_budget
from vlmq.worker.model import mlx_adapter


def _prepared(tiny_model: Path, n: int) -> list[mlx_adapter.Prepared]:
    from mlx_vlm import load

    model, processor = load(str(tiny_model))
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        img = Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8))
        out.append(mlx_adapter.prepare(processor, model.config, img, "Read."))
    return out



def test_admission_keeps_kv_in_flight_under_the_budget(tiny_model: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    preps = _prepared(tiny_model, 6)
    prompt = preps[0].prompt_tokens or 0
    assert all(p.prompt_tokens == prompt for p in preps)
    per_request = prompt + 12
    budget = 2 * per_request + per_request // 2  # room for 2 of the 12-token requests
    engine = Engine(str(tiny_model), max_batch=6, max_kv_tokens=budget)
    try:
        engine.wait_ready(timeout=60)
        reqs = [Request(key=i, prepared=p, cached_features=None, max_tokens=12, temperature=0.0,
                        stop=()) for i, p in enumerate(preps)]
        got = engine_rig.run(engine, reqs, 120)
        assert all(f.error is None for f in got.values())
        assert engine.state.peak_kv_in_flight <= budget
        assert engine.state.peak_active == 2  # the batch had 6 rows, the budget allowed 2
        assert engine.state.kv_in_flight == 0

        # One request over the whole budget runs, alone, with a warning.
        caplog.set_level(logging.WARNING, logger="vlmq.worker.engine.batcher")
        big = Request(key="big", prepared=preps[0], cached_features=None,
                      max_tokens=budget, temperature=0.0, stop=())
        small = Request(key="small", prepared=preps[1], cached_features=None,
                        max_tokens=4, temperature=0.0, stop=())
        engine.state.peak_active = 0
        got = engine_rig.run(engine, [big, small], 120)
        assert got["big"].error is None and got["small"].error is None
        assert engine.state.peak_active == 1
        assert "over the --max-kv-tokens budget" in caplog.text
    finally:
        engine.close(timeout=10)


def test_default_budget_comes_from_model_and_memory() -> None:
    class Text:
        num_hidden_layers = 28
        num_attention_heads = 28
        num_key_value_heads = 4
        hidden_size = 3584

    per_token = kv_budget.kv_bytes_per_token(Text(), 2)
    assert per_token == 2 * 28 * 4 * 128 * 2  # Qwen2.5-VL-7B: 56 KiB per token
    gib = 1024**3
    tokens = kv_budget.default_max_kv_tokens(per_token, 5 * gib, 21 * gib)
    assert tokens == int(16 * gib * kv_budget.KV_MEMORY_SHARE) // per_token
    assert kv_budget.default_max_kv_tokens(per_token, 30 * gib, 21 * gib) == \
        kv_budget.MIN_KV_TOKENS
    assert kv_budget.machine_memory_bytes({"max_recommended_working_set_size": 7}) == 7
    assert kv_budget.machine_memory_bytes({}) > gib
