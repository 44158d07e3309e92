"""Constrained JSON decoding for extract jobs: one llguidance matcher per batch row.

mlx-vlm 0.7.10 ships an llguidance logits processor (mlx_vlm/structured.py), but its mask is
a Metal kernel, so it cannot run on Linux CPU or CUDA, and it keeps one processor per batch
rather than per row. This adapter is the per-row form: each extract item gets a
`RowConstraint` (made on a prep thread, so compiling the grammar never blocks the MLX
thread), which BatchGenerator calls like any logits processor: `__call__` for the first
token after prefill, `process_last_token` for each decode step. Rows with different schemas,
and unconstrained rows, share one batch.

The mask is llguidance's packed bitmask (one bit per token id). On Metal it is applied by
a small kernel, as mlx-vlm does; elsewhere by portable MLX ops (shift, and, where), which
run on the CPU and CUDA backends alike. Each row keeps the seconds its masks took, so a
job's results say what constraining cost (timings["mask_s"]).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from vlmq.shared import json_schema

if TYPE_CHECKING:  # MLX loads after the worker picked its BLAS (worker/blas.py)
    import mlx.core as mx

# Compact JSON with ", " and ": " (what people write; no free whitespace, so a random or
# confused model cannot pad forever between tokens).
_SEPARATORS = (", ", ": ")
GRAMMAR_CACHE = 64  # compiled grammars kept per worker (schemas of recent jobs)


class ConstraintError(ValueError):
    """A schema the matcher refuses, or a token it cannot take (a bug, not bad input)."""


class Structured:
    """The worker's constraint factory: one llguidance tokenizer for the served model, and
    the compiled grammars of recent schemas. Thread-safe."""

    def __init__(self, hf_tokenizer: Any, eos_ids: frozenset[int]) -> None:
        self._hf = hf_tokenizer
        self._eos = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use: it walks the whole vocabulary (about a second for 150 k)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, eos_token=self._eos or None)
            return self._tokenizer

    def grammar(self, schema: dict[str, Any] | str) -> str:
        """The schema's grammar (given as an object or as its text), checked against this
        model's tokenizer (ConstraintError)."""
        text = schema if isinstance(schema, str) else json_schema.schema_text(schema)
        with self._lock:
            hit = self._grammars.get(text)
            if hit is not None:
                self._grammars.move_to_end(text)
                return hit
        try:
            grammar = llguidance.JsonCompiler(separators=_SEPARATORS,
                                              whitespace_pattern="").compile(text)
        except ValueError as exc:
            raise ConstraintError(f"schema: the matcher cannot compile it ({exc})") from exc
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise ConstraintError(f"schema: the matcher refuses it ({problem})")
        with self._lock:
            self._grammars[text] = grammar
            while len(self._grammars) > GRAMMAR_CACHE:
                self._grammars.popitem(last=False)
        return grammar

    def row(self, schema: dict[str, Any] | str) -> RowConstraint:
        return RowConstraint(self.tokenizer, self.grammar(schema))


class RowConstraint:
    """The logits processor of one row: masks every token the schema does not allow next."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        error = self.matcher.get_error()
        if error:
            raise ConstraintError(f"schema: the matcher refuses it ({error})")
        self.vocab = int(tokenizer.vocab_size)
        self._bitmask = np.full((1, (self.vocab + 31) // 32), -1, dtype=np.int32)
        self._started = False
        self.consumed = 0  # tokens of the row's output the matcher has taken
        self.mask_s = 0.0  # seconds spent computing and applying masks
        self.steps = 0

    def reset(self) -> None:
        """Back to the first token (the engine retries a looping row from its prompt)."""
        self.matcher.reset()
        self._started = False
        self.consumed = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """The first token after prefill (mlx-vlm calls this with the row's context)."""
        last = int(np.asarray(tokens).reshape(-1)[-1]) if self._started and tokens.size else None
        return self._masked(last, logits)

    def process_last_token(self, last_token: int, logits: mx.array) -> mx.array:
        """A decode step: `last_token` is the token sampled at the previous step."""
        return self._masked(int(last_token), logits)

    def _masked(self, last: int | None, logits: mx.array) -> mx.array:
        t0 = time.perf_counter()
        if self._started and last is not None:
            self._consume(last)
        self._started = True
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        out = apply_mask(logits, self._bitmask)
        self.mask_s += time.perf_counter() - t0
        self.steps += 1
        return out

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"token {token} broke the schema's grammar: "
                                  f"{self.matcher.get_error()}")
        self.consumed += 1

    def complete(self, tokens: list[int]) -> bool:
        """Whether the row's output `tokens` (its end-of-sequence token included, if any)
        is a whole value of the schema: the tokens the last steps sampled but no step fed
        back are taken first."""
        for token in tokens[self.consumed:]:
            if not self.matcher.consume_token(token):
                return False
            self.consumed += 1
        return bool(self.matcher.is_accepting())


def parse(text: str) -> Any:
    """The row's JSON value; ValueError when the text is not one (cut by a stop string)."""
    return json.loads(text)


# --- the mask -----------------------------------------------------------------------------

_METAL_SOURCE = """
    uint batch = thread_position_in_grid.y;
    uint token = thread_position_in_grid.x;
    uint word = token >> 5;
    uint bit = token & 31;
    bool allowed = word < mask_shape[1] &&
        ((as_type<uint>(mask[batch * mask_shape[1] + word]) >> bit) & 1u);
    uint offset = batch * logits_shape[1] + token;
    out[offset] = allowed ? logits[offset] : -metal::numeric_limits<T>::infinity();
"""
_kernel: Any = None


def _metal() -> bool:
    import mlx.core as mx

    return bool(mx.metal.is_available()) and mx.default_device().type == mx.DeviceType.gpu


def apply_mask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """`logits` (rows x vocab) with every token whose bit is clear set to -inf; token ids
    past the mask's bits (a model whose embedding is padded past its tokenizer) too."""
    if _metal():
        import mlx.core as mx

        return _apply_metal(logits, mx.array(bitmask))
    return apply_portable(logits, bitmask)


def apply_portable(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """The mask by plain array ops, on any backend: the bits unpacked on the host (a few
    microseconds), then one penalty added on the device. Measured on this CPU at 151,936
    ids, a where() with -inf took 4x as long as this add (benchmarks/structured.py)."""
    import mlx.core as mx

    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")  # ids ascending
    if bits.shape[1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    allowed = mx.array(bits[:, :vocab]).astype(mx.float32)
    penalty = ((allowed - 1) * _BLOCKED).astype(logits.dtype)  # 0, or -inf in float16
    return logits + penalty


# A disallowed token's penalty: the largest float32, so the token's logit sinks below
# any allowed one's (and to -inf in float16) while an allowed logit is left as it was.
_BLOCKED = float(np.finfo(np.float32).max)


def _apply_metal(logits: mx.array, mask: mx.array) -> mx.array:
    import mlx.core as mx

    global _kernel
    if _kernel is None:
        _kernel = mx.fast.metal_kernel(name="vlmq_json_mask", input_names=["logits", "mask"],
                                       output_names=["out"], source=_METAL_SOURCE)
    out: mx.array = _kernel(inputs=[logits, mask], template=[("T", logits.dtype)],
                            grid=(logits.shape[1], logits.shape[0], 1),
                            threadgroup=(256, 1, 1), output_shapes=[logits.shape],
                            output_dtypes=[logits.dtype])[0]
    return out
