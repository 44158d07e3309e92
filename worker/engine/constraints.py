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
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import llguidance
import llguidance.numpy
import numpy as np

from vlmq.shared import extract_schema
from vlmq.worker.engine.match_budget import ema
from vlmq.worker.model.mlx_adapter import quiet_library_noise

T = TypeVar("T")
V = TypeVar("V")

if TYPE_CHECKING:  # MLX loads after the worker picked its BLAS (worker/model/blas.py)
    import mlx.core as mx

# Compact JSON with ", " and ": " (what people write; no free whitespace, so a random or
# confused model cannot pad forever between tokens).
_SEPARATORS = (", ", ": ")
GRAMMAR_CACHE = 64  # compiled grammars kept per worker (schemas of recent jobs)
# A schema's cost is its own job's: its matcher is built, and its first mask computed, on a
# prep thread within BUILD_BUDGET_S; each later mask must come within STEP_BUDGET_S or the
# row is cut. A hostile pattern such as (a{700}){700} costs about 1 s to build and 0.15 s a
# step on this CPU; an ordinary schema's masks take microseconds.
BUILD_BUDGET_S = 1.0
STEP_BUDGET_S = 0.02
STARVED_WAIT = 20  # a thread the machine starves of CPU is waited for this many budgets
# llguidance's own limits bound what a matcher may build (about 1-2 kB per lexer state),
# so one schema cannot take the worker's memory; exceeding one puts the matcher in error.
MAX_LEXER_STATES = 50_000
MAX_GRAMMAR_SIZE = 200_000
# Lexer work per build and per step (llguidance's defaults are 1 M and 200 k): ordinary
# schemas, a 40-field object of dates, emails, enums and patterns included, need under a
# tenth of this; (a{700}){700} runs out in 0.1 s instead of computing for seconds.
INITIAL_LEXER_FUEL = 200_000
STEP_LEXER_FUEL = 50_000


def _limits() -> llguidance.LLParserLimits:
    # verbose_errors off: an error quotes no parser state (a job's data) into messages.
    return llguidance.LLParserLimits(max_lexer_states=MAX_LEXER_STATES,
                                     max_grammar_size=MAX_GRAMMAR_SIZE,
                                     initial_lexer_fuel=INITIAL_LEXER_FUEL,
                                     step_lexer_fuel=STEP_LEXER_FUEL, verbose_errors=False)


def _too_costly(why: str) -> str:
    """An over-budget schema's error: what ran out, and the budget it had."""
    return (f"schema: too costly to match ({why}; the matcher's budget is "
            f"{BUILD_BUDGET_S:g} s to build, {STEP_BUDGET_S:g} s a step, {MAX_LEXER_STATES} "
            f"lexer states and {INITIAL_LEXER_FUEL}/{STEP_LEXER_FUEL} lexer fuel)")


class ConstraintError(ValueError):
    """A schema the matcher refuses, or one over the matcher's budget (its item fails)."""


class _Offload:
    """One daemon thread that runs matcher work, so the caller can stop waiting at a budget.

    llguidance drops the GIL while it computes, and a matcher cannot be interrupted: work
    past its budget is abandoned here and finishes alone. A daemon thread, not an executor,
    so an abandoned computation never holds up the worker's exit.

    The budget is the work's own CPU time where the OS can tell (Linux: the thread's CPU
    clock), so a loaded machine that starves the thread does not cut an innocent row; it
    is then waited for up to STARVED_WAIT times the budget. Elsewhere it is wall time.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._clock: int | None = None

    def run(self, work: Callable[[], T], timeout: float) -> T | None:
        """`work()`'s result, or None when it took over `timeout` seconds."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, daemon=True, name="vlmq-mask")
            self._thread.start()
        done = threading.Event()
        started: list[float] = []  # the thread's CPU clock when the work began
        box: list[T] = []
        failed: list[BaseException] = []

        def job() -> None:
            started.append(time.thread_time())
            try:
                box.append(work())
            except Exception as exc:  # noqa: BLE001  # re-raised on the caller's thread
                failed.append(exc)
            finally:
                done.set()

        self._jobs.put(job)
        if not done.wait(timeout) and not self._starved(done, started, timeout):
            return None
        if failed:
            raise failed[0]
        return box[0]

    def _starved(self, done: threading.Event, started: list[float], budget: float) -> bool:
        """Past the budget in wall time: wait on while the work has used less than the
        budget in CPU time; True when it then finished."""
        clock = self._cpu_clock()
        if clock is None:
            return False
        hard = time.monotonic() + budget * STARVED_WAIT
        while time.monotonic() < hard:
            try:
                used = time.clock_gettime(clock) - started[0] if started else 0.0
            except OSError:  # the thread is gone
                return done.is_set()
            if used >= budget:
                return done.is_set()
            if done.wait(min(0.005, budget)):
                return True
        return done.is_set()

    def _cpu_clock(self) -> int | None:
        ident = self._thread.ident if self._thread is not None else None
        getter = getattr(time, "pthread_getcpuclockid", None)  # absent on macOS
        if self._clock is None and ident is not None and getter is not None:
            try:
                self._clock = int(getter(ident))
            except OSError:
                return None
        return self._clock

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def close(self) -> None:
        """The thread ends once any abandoned work is done."""
        if self._thread is not None:
            self._jobs.put(None)


class SchemaCost:
    """What one step of a schema's matcher costs, averaged over its rows' steps (until
    one has run, its first mask's time): what the engine's matching budget
    (match_budget.py) judges a row by before that row has run a step. Rows write it on
    the MLX thread only."""

    def __init__(self, first_s: float) -> None:
        self.per_step_s = first_s  # the first mask's time until a row has run a step
        self.measured = False  # a row has run a step of it

    def observe(self, seconds: float) -> None:
        self.per_step_s = ema(None if not self.measured else self.per_step_s, seconds)
        self.measured = True


@dataclass(frozen=True)
class _Template:
    """A schema's matcher at its first step, mask computed: rows start from copies of it."""

    matcher: llguidance.LLMatcher | None
    first_mask: np.ndarray | None
    problem: str | None  # why this schema cannot be matched within budget (cached too)
    cost: SchemaCost = field(default_factory=lambda: SchemaCost(0.0))


class Structured:
    """The worker's constraint factory: one llguidance tokenizer for the served model, and
    the compiled grammars of recent schemas. Thread-safe."""

    def __init__(self, hf_tokenizer: Any, eos_ids: frozenset[int]) -> None:
        self._hf = hf_tokenizer
        self._eos = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._templates: OrderedDict[str, _Template] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use: it walks the whole vocabulary (about a second for 150 k)."""
        # llguidance.hf imports transformers, whose import line about PyTorch is noise here.
        quiet_library_noise()
        import llguidance.hf

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, eos_token=self._eos or None)
            return self._tokenizer

    def grammar(self, schema: dict[str, Any] | str) -> str:
        """The schema's grammar (given as an object or as its text), checked against this
        model's tokenizer (ConstraintError)."""
        text = schema if isinstance(schema, str) else extract_schema.schema_text(schema)
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
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer,
                                                        limits=_limits())
        if problem:
            raise ConstraintError(f"schema: the matcher refuses it ({problem})")
        with self._lock:
            _remember(self._grammars, text, grammar)
        return grammar

    def row(self, schema: dict[str, Any] | str) -> RowConstraint:
        """A row's matcher, built here (a prep thread) within the build budget; a schema
        over it raises ConstraintError, and its next rows raise at once."""
        text = schema if isinstance(schema, str) else extract_schema.schema_text(schema)
        with self._lock:
            template = self._templates.get(text)
        if template is None:
            template = self._build(self.grammar(text))
            with self._lock:
                _remember(self._templates, text, template)
        if template.problem is not None:
            raise ConstraintError(template.problem)
        assert template.matcher is not None and template.first_mask is not None
        return RowConstraint(template.matcher.deep_copy(), template.first_mask,
                             cost=template.cost)

    def _build(self, grammar: str) -> _Template:
        tokenizer = self.tokenizer
        vocab = int(tokenizer.vocab_size)

        def first() -> tuple[llguidance.LLMatcher, np.ndarray, str, float]:
            matcher = llguidance.LLMatcher(tokenizer, grammar, limits=_limits(), log_level=0)
            mask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
            t0 = time.perf_counter()
            if not matcher.is_error():
                llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            took = time.perf_counter() - t0
            return matcher, mask, matcher.get_error() or _probe(matcher, mask), took

        offload = _Offload()
        try:
            built = offload.run(first, BUILD_BUDGET_S)
        finally:
            offload.close()
        if built is None:
            return _Template(None, None, _too_costly(
                f"its first mask took over {BUILD_BUDGET_S:g} s"))
        matcher, mask, error, took = built
        if error:
            return _Template(None, None, _too_costly(_first_line(error)))
        return _Template(matcher, mask, None, SchemaCost(took))


def _probe(matcher: llguidance.LLMatcher, first_mask: np.ndarray) -> str:
    """The error of one step past the first, on a copy: a hostile pattern's lexer explodes
    only once its first token is taken, and found here it costs a prep thread, not the
    batch. The first allowed token stands in for the model's choice."""
    bits = np.unpackbits(first_mask.view(np.uint8), bitorder="little")
    allowed = np.flatnonzero(bits)
    if allowed.size == 0:
        return ""
    trial = matcher.deep_copy()
    if trial.consume_token(int(allowed[0])):
        llguidance.numpy.fill_next_token_bitmask(trial, np.empty_like(first_mask), 0)
    return trial.get_error()


def _remember(cache: OrderedDict[str, V], text: str, value: V) -> None:
    cache[text] = value
    cache.move_to_end(text)
    while len(cache) > GRAMMAR_CACHE:
        cache.popitem(last=False)


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0] if error.strip() else error


class RowConstraint:
    """The logits processor of one row: masks every token the schema does not allow next.

    It never raises into the generator (one row's matcher must not fail the batch): a
    matcher error, or a mask later than STEP_BUDGET_S, sets `failure`, and the engine cuts
    this row alone after the step. Each mask is computed on the row's own thread, so a
    costly one is abandoned at the budget instead of holding up every row.
    """

    def __init__(self, matcher: llguidance.LLMatcher, first_mask: np.ndarray, *,
                 step_budget_s: float = STEP_BUDGET_S, cost: SchemaCost | None = None) -> None:
        self.matcher = matcher
        self._first = first_mask
        self._bitmask = first_mask.copy()
        self._started = False
        self._offload = _Offload()
        self.step_budget_s = step_budget_s
        self.failure: str | None = None  # why this row must be cut, once it must
        self.consumed = 0  # tokens of the row's output the matcher has taken
        self.mask_s = 0.0  # seconds spent computing and applying masks
        self.steps = 0
        self.last_s = 0.0  # the last step's seconds (the engine sums a step's rows)
        self.schema_cost = cost if cost is not None else SchemaCost(0.0)
        self._own_s: float | None = None  # this row's steps, averaged

    @property
    def cost_s(self) -> float:
        """What a step of this row costs: its own steps' average once it has run one,
        else its schema's."""
        return self.schema_cost.per_step_s if self._own_s is None else self._own_s

    def reset(self) -> None:
        """Back to the first token (the engine retries a looping row from its prompt)."""
        self.matcher.reset()
        self._started = False
        self.consumed = 0

    def close(self) -> None:
        """The row has left the batch: its mask thread may end."""
        self._offload.close()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """The first token after prefill (mlx-vlm calls this with the row's context)."""
        last = int(np.asarray(tokens).reshape(-1)[-1]) if self._started and tokens.size else None
        return self._masked(last, logits)

    def process_last_token(self, last_token: int, logits: mx.array) -> mx.array:
        """A decode step: `last_token` is the token sampled at the previous step."""
        return self._masked(int(last_token), logits)

    def _masked(self, last: int | None, logits: mx.array) -> mx.array:
        if self.failure is not None:
            return logits  # cut after this step; its token is discarded
        t0 = time.perf_counter()
        advanced = self._started and last is not None
        try:
            if last is None or not self._started:
                np.copyto(self._bitmask, self._first)  # computed when the row was built
            elif self._offload.run(partial(self._advance, last), self.step_budget_s) is None:
                self.failure = (_too_costly(f"a mask step took over the "
                                            f"{self.step_budget_s:g} s step budget")
                                + f"; the row was cut after {self.consumed} tokens")
                return logits
            self._started = True
            out = apply_mask(logits, self._bitmask)
        except Exception as exc:  # noqa: BLE001  # this row's failure; the batch goes on
            self.failure = f"{type(exc).__name__}: {exc}"
            return logits
        finally:
            self._count(time.perf_counter() - t0, advanced)
        return out

    def _count(self, seconds: float, advanced: bool) -> None:
        self.mask_s += seconds
        self.steps += 1
        self.last_s = seconds
        if advanced:  # a real step: what the next ones of this row and schema will cost
            self._own_s = ema(self._own_s, seconds)
            self.schema_cost.observe(seconds)

    def _advance(self, token: int) -> bool:
        """Take the sampled token and compute the next mask (the row's mask thread)."""
        # The mask allowed only what the grammar takes, so an error here is the matcher
        # running out of its limits.
        if self.matcher.consume_token(token):
            self.consumed += 1
            llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        error = self.matcher.get_error()
        if error:
            raise ConstraintError(_too_costly(_first_line(error))
                                  + f"; the row was cut after {self.consumed} tokens")
        return True

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
