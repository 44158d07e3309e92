"""Constrained JSON decoding (task extract) in the continuous batch: the real engine and
tiny random-weight models of three families, llguidance matchers, and jsonschema as the
judge. A random model writes nonsense, but inside the schema: every value it returns must
validate, and a value cut short must fail, never be returned."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from tests.support.engine_rig import Rig
from tests.support.schemas import INVOICE, PERSON, RECEIPT, SCHEMAS
from vlmq.worker.engine.batcher import Finished
from vlmq.worker.engine.constraints import ConstraintError, apply_portable
from vlmq.worker.model.tiny import build_tiny_model


@pytest.fixture(scope="module")
def rigs(tiny_model: Path) -> Iterator[tuple[Rig, Rig]]:
    batched, sequential = Rig(tiny_model, 8), Rig(tiny_model, 1)
    yield batched, sequential
    batched.close()
    sequential.close()


def _valid(f: Finished, schema: dict[str, Any]) -> None:
    assert f.error is None, f.error
    assert f.finish_reason == "stop", (f.finish_reason, f.text)
    jsonschema.validate(f.json, schema)


def test_the_portable_mask_keeps_exactly_the_allowed_tokens() -> None:
    import mlx.core as mx

    vocab = 70  # more ids than the mask's 64 bits: the padded tail must be masked too
    allowed = {0, 5, 31, 32, 63}
    bitmask = np.zeros((1, 2), dtype=np.int32)
    for t in allowed:
        bitmask.view(np.uint32)[0, t // 32] |= np.uint32(1 << (t % 32))
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        logits = mx.arange(vocab, dtype=dtype)[None, :]
        out = np.array(apply_portable(logits, bitmask).astype(mx.float32))[0]
        assert out.dtype == np.float32
        assert {i for i in range(vocab) if out[i] > -1e30} == allowed, dtype
        assert all(out[i] == i for i in allowed)  # an allowed logit is left as it was
        assert int(mx.argmax(apply_portable(logits, bitmask)).item()) == 63


def test_batched_rows_equal_sequential_rows_token_for_token(rigs: tuple[Rig, Rig]) -> None:
    """Two schemas and an unconstrained row in one batch; each row follows its own
    constraint, and every row's tokens equal its run alone at max batch 1."""
    batched, sequential = rigs
    plan = [(0, RECEIPT), (1, INVOICE), (2, None), (3, RECEIPT), (4, INVOICE), (5, PERSON),
            (6, None), (7, PERSON)]
    together = batched.run([batched.request(k, seed, sch) for k, (seed, sch) in enumerate(plan)])
    alone = {}
    for k, (seed, sch) in enumerate(plan):
        alone.update(sequential.run([sequential.request(k, seed, sch)]))
    for k, (_, sch) in enumerate(plan):
        assert together[k].tokens == alone[k].tokens, k
        if sch is None:
            assert together[k].json is None and "mask_s" not in together[k].timings
        else:
            _valid(together[k], sch)
            assert together[k].timings["mask_s"] > 0
    # Unconstrained rows are free text: the same images under a schema differ from them.
    assert together[2].tokens != batched.run([batched.request("c", 2, RECEIPT)])["c"].tokens


def test_a_value_cut_at_max_tokens_fails_and_is_not_returned(rigs: tuple[Rig, Rig]) -> None:
    batched, _ = rigs
    got = batched.run([batched.request(k, seed, RECEIPT, max_tokens=6)
                       for k, seed in enumerate(range(3))])
    for f in got.values():
        assert f.finish_reason == "length" and f.json is None
        assert f.error == ("output cut at max_tokens before the JSON was complete: raise "
                           "--max-tokens")


def test_a_schema_the_matcher_refuses_is_a_clear_error(rigs: tuple[Rig, Rig]) -> None:
    batched, _ = rigs
    with pytest.raises(ConstraintError, match="look-around"):
        batched.structured.grammar({"type": "string", "pattern": "(?<=a)b"})


@pytest.mark.parametrize("arch", ["qwen2_vl", "gemma3", "mistral3"])
def test_every_value_validates_on_three_families(arch: str, tiny_model: Path,
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    model = tiny_model if arch == "qwen2_vl" else build_tiny_model(
        tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)
    rig = Rig(model, 6)
    try:
        plan = [(seed, SCHEMAS[seed % 3]) for seed in range(12)]
        got = rig.run([rig.request(k, 100 + seed, sch, size=(112, 84 + 14 * (seed % 3)))
                       for k, (seed, sch) in enumerate(plan)])
    finally:
        rig.close()
    for k, (_, sch) in enumerate(plan):
        _valid(got[k], sch)
