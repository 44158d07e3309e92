"""Constrained JSON decoding (task extract) in the continuous batch: the real engine and
tiny random-weight models of three families, llguidance matchers, and jsonschema as the
judge. A random model writes nonsense, but inside the schema: every value it returns must
validate, and a value cut short must fail, never be returned."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from PIL import Image

from vlmq.worker.engine import mlx_adapter as A
from vlmq.worker.engine.batcher import Engine, Finished, Request
from vlmq.worker.engine.constraints import ConstraintError, Structured, apply_portable
from vlmq.worker.model.tiny import build_tiny_model

PROMPT = "Extract the fields of this document as JSON."
LINE = {"type": "object", "additionalProperties": False, "required": ["name", "qty"],
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}
RECEIPT = {  # nested objects, an array with min/max items, an enum, a bounded number
    "type": "object", "additionalProperties": False,
    "required": ["vendor", "total", "currency", "lines"],
    "properties": {
        "vendor": {"type": "string", "maxLength": 24},
        "total": {"type": "number", "minimum": 0, "maximum": 100000, "multipleOf": 0.01},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": LINE}}}
INVOICE = {  # a string pattern, optional fields, a boolean
    "type": "object", "additionalProperties": False, "required": ["date", "number"],
    "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "number": {"type": "integer", "minimum": 0, "maximum": 999999},
        "paid": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 16}}}
PERSON = {  # an object in an object, an array of enums, a nullable field
    "type": "object", "additionalProperties": False, "required": ["person", "tags"],
    "properties": {
        "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                   "properties": {"name": {"type": "string", "maxLength": 16},
                                  "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                  "email": {"type": ["string", "null"], "maxLength": 20}}},
        "tags": {"type": "array", "items": {"enum": ["invoice", "receipt", "letter"]},
                 "maxItems": 3}}}
SCHEMAS = [RECEIPT, INVOICE, PERSON]
MAX_TOKENS = 220


def _image(seed: int, size: tuple[int, int] = (112, 112)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


class Rig:
    """One model loaded in an engine at `max_batch`, and what builds its requests."""

    def __init__(self, model: Path, max_batch: int) -> None:
        from mlx_vlm import load

        self.engine = Engine(str(model), max_batch=max_batch)
        self.engine.wait_ready(timeout=120)
        self.model, self.processor = load(str(model))
        self.structured = Structured(self.processor.tokenizer,
                                     A.eos_token_ids(self.processor))

    def request(self, key: object, seed: int, schema: dict[str, Any] | None,
                max_tokens: int = MAX_TOKENS, size: tuple[int, int] = (112, 112)) -> Request:
        prep = A.prepare(self.processor, self.model.config, _image(seed, size), PROMPT)
        return Request(key=key, prepared=prep, cached_features=None, max_tokens=max_tokens,
                       temperature=0.0, stop=(),
                       constraint=None if schema is None else self.structured.row(schema))

    def run(self, reqs: list[Request], timeout: float = 120) -> dict[object, Finished]:
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
