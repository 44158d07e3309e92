"""The MLX engine: one thread owns every MLX call and runs a continuous batcher.

MLX (and mlx-vlm's generator state: rope deltas on the model, the shared
stopping criteria) is not safe to drive from several threads, and on Metal a
second thread submitting work can crash the process. So the model is loaded,
the vision tower runs, embeddings are built and `BatchGenerator.next()` is
called on one thread only. Everyone else talks to it through two queues:
`submit()` in, `get_finished()` out.

Requests from different jobs share batches: whatever was submitted is inserted
at the next step, up to the row limit (`max_batch`, or what the sizer measured under
it), the smallest job first; a small job may also take the express rows past the
limit, so that it starts at the next step whatever fills the batch (admission.py).

Interactive requests (`Request.interactive`) are admitted before every waiting bulk row,
into rows of their own past the limit. A streamed row (`Request.stream`) reports its
newly decoded text after each step through the same outbox as the finished rows
(`Streamed`, whole characters only, never the start of a stop string that may yet cut
it), so the caller can pass it on while the row runs. `cancel()` drops rows at the next
turn, before the next step.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from vlmq.worker.engine import admission, constraints, faults, kv_budget, prefix_cache
from vlmq.worker.engine.batch_size import FLOOR, BatchSizer, Shape
from vlmq.worker.engine.constraints import RowConstraint
from vlmq.worker.engine.match_budget import MatchBudget
from vlmq.worker.engine.repetition import RepetitionGuard
from vlmq.worker.model import blas, mlx_adapter
from vlmq.worker.model.families import FamilySpec
from vlmq.worker.model.mlx_adapter import LoadedModel, Prepared

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # how long the MLX thread blocks on the inbox when it has nothing to run
_MAX_CANCEL_EARLY = 4096  # cancelled keys kept for requests not submitted yet
_CLEAR_CACHE_DELAY = 8  # steps between a removal and mx.clear_cache (Metal pitfall)
IGNORE_LIMITS_ENV = "VLMQ_IGNORE_FAMILY_LIMITS"  # debug switch, see _apply_family_limits
PREFILL_ROWS = 8  # prompts prefilled together by default (the old max_batch default)


@dataclass
class Request:
    key: Hashable  # opaque to the engine, e.g. (job_id, item_index)
    prepared: Prepared
    cached_features: tuple[np.ndarray, str] | None  # (features, dtype_name) on a cache hit
    max_tokens: int
    temperature: float
    stop: tuple[str, ...]  # stop strings, in addition to the tokenizer's EOS
    # Called on the MLX thread after a tower run, so the caller can cache the features.
    on_features: Callable[[np.ndarray, str], None] | None = None
    # Wraps this request's own steps (tower, embedding) on the MLX thread, so that a crash
    # there is charged to it (worker/jobs/poison.py). Called with the step's name.
    risky: Callable[[str], AbstractContextManager[None]] | None = None
    # Lower is admitted first when rows free up, FIFO among equals. The worker passes its
    # job's items left, then its batch's items out (ItemOrder.priority), so a small job's
    # items overtake a big job's queued ones, and a batch with few rows another's.
    priority: int = 0
    # Its job's items left when submitted (0: not known): a job small enough may use the
    # express rows beyond the batch limit (admission.py).
    job_left: int = 0
    # An extract item's schema matcher (worker/engine/constraints.py): masks each step's logits,
    # and decides at the end whether the output is a whole JSON value.
    constraint: RowConstraint | None = None
    # The content key of the row's image (the vision cache's, worker/prep/preparer.py):
    # rows with the same key and prompt prefix share its prefilled K/V (prefix_cache.py).
    prefix_key: str | None = None
    # An interactive request: admitted before any bulk row, past the batch limit.
    interactive: bool = False
    # Report the text decoded so far after each step (Streamed). Such a row is never cut
    # or retried by the repetition guard: what it has sent cannot be taken back.
    stream: bool = False


@dataclass(frozen=True)
class Streamed:
    """Text a streamed row decoded since its previous Streamed: whole characters. The
    row's Finished text starts with all of its Streamed texts, in order."""

    key: Hashable
    text: str


@dataclass
class Finished:
    key: Hashable
    text: str
    finish_reason: str  # "stop" | "length" | "repetition" | "error" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    vision_cache_hit: bool
    error: str | None
    timings: dict[str, float]  # queue_s, vision_s, embed_s, prefill_s, generate_s
    tokens: list[int] = field(default_factory=list)
    repetition: str | None = None  # what the repetition guard did, if anything
    json: Any = None  # a constrained row's value, parsed from `text`
    prefix_tokens: int = 0  # prompt tokens a cached prefix spared this row's prefill
    # The engine's step count when the row joined the batch (EngineState.steps), and
    # when the engine first saw it: how many steps it waited for a row.
    admitted_step: int = 0
    seen_step: int = 0
    first_step: int = 0  # the step its first token came in (0: none came)
    # Characters of `text` a streamed row has already reported (Streamed).
    streamed: int = 0


Output = Finished | Streamed


@dataclass(frozen=True)
class EngineInfo:
    model_id: str
    model_type: str
    cacheable: bool
    context_length: int
    fingerprint: str


class EngineError(RuntimeError):
    """The engine could not start (model not found or not loadable) or was used after close."""


class _Temperature:
    """Per-request temperature as a logits processor.

    BatchGenerator has one sampler for the whole batch (argmax here). Adding
    Gumbel noise to logits / T makes that argmax an exact sample from
    softmax(logits / T), so rows with different temperatures share a batch.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        return logits / self.temperature + mx.random.gumbel(logits.shape)


@dataclass
class _Live:
    """A request inserted into the generator (MLX thread only)."""

    req: Request
    uid: int
    prompt_tokens: int
    hit: bool
    timings: dict[str, float]
    inserted_at: float
    tokens: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    stop_window: int = 0  # tokens to re-decode when looking for a stop string
    kv_cost: int = 0  # prompt + max new tokens: the KV cache this row can grow to
    prefix_tokens: int = 0  # of its prompt, those a cached prefix spared (prefix_cache.py)
    admitted_step: int = 0  # EngineState.steps when it was inserted
    seen_step: int = 0  # EngineState.steps when the loop took it from the inbox
    first_step: int = 0  # EngineState.steps when its first token came
    detok: mlx_adapter.TokenText | None = None  # a streamed row's text as it comes


@dataclass(eq=False)
class EngineState:
    """What the MLX thread shares with the engine's callers: the two queues, the counts
    behind Engine.waiting and Engine.active, and the counters stats read.

    The Engine makes it (submit() queues before the model has loaded) and hands it to the
    MLX thread's loop, the only writer of the counters; `lock` guards `waiting` and
    `active`, which both sides change. Other threads only read.
    """

    inbox: queue.SimpleQueue[tuple[Request, float] | None] = field(
        default_factory=queue.SimpleQueue)
    # A Queue, not a SimpleQueue: the main thread waits on it with a timeout, and on
    # CPython 3.11 a signal (SIGTERM) landing in SimpleQueue.get(timeout=...) can leave
    # that call blocked for good, so the worker never stops (tests/worker/engine/test_batcher.py).
    outbox: queue.Queue[Output] = field(default_factory=queue.Queue)
    cancels: queue.SimpleQueue[Hashable] = field(default_factory=queue.SimpleQueue)
    closing: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiting: int = 0  # submitted, not yet inserted or failed
    active: int = 0  # inserted, not yet finished
    peak_waiting: int = 0  # most requests ever submitted but not yet in the batch
    peak_active: int = 0
    kv_in_flight: int = 0  # sum of the active rows' (prompt + max new tokens)
    kv_budget: int = 0  # what kv_in_flight is admitted under (0: not known until loaded)
    batch_limit: int = 0  # the rows the batch admits now (worker/engine/batch_size.py chooses it)
    batch_reason: str = ""  # why that many
    peak_kv_in_flight: int = 0
    tower_calls: int = 0
    isolations: int = 0  # failed steps whose rows were rerun apart to find the culprit
    deferrals: int = 0  # constrained rows taken out to keep the matching budget
    busy_s: float = 0.0  # MLX thread time in model work (tower, embed, prefill, decode)
    # Of busy_s: turns that admit or prefill rows (their decode step included), and the
    # rows summed over the turns that only decode: where a run's time goes
    # (benchmarks/run.py prints both).
    prefill_turn_s: float = 0.0
    decode_turns: int = 0
    decode_turn_rows: int = 0
    tokens_generated: int = 0
    steps: int = 0  # decode steps run
    finished: int = 0
    errors: int = 0
    repetitions: int = 0  # rows cut for looping (each attempt counts)
    # Prefix reuse (worker/engine/prefix_cache.py): rows that started from a cached prefix,
    # the prompt tokens that spared, prompt tokens prefilled, and the bytes held.
    prefix_hits: int = 0
    prefix_tokens_skipped: int = 0
    prefill_tokens: int = 0
    prefix_bytes: int = 0
    peak_prefix_bytes: int = 0
    prefix_off: str = ""  # why reuse is off for this worker, if it is
    # Interactive rows admitted; bulk rows that waited while one took a row within the
    # limit; rows dropped by cancel().
    interactive_admitted: int = 0
    bulk_rows_delayed: int = 0
    cancelled: int = 0

    def submit(self, req: Request) -> None:
        with self.lock:
            self.waiting += 1
            self.peak_waiting = max(self.peak_waiting, self.waiting)
        self.inbox.put((req, time.perf_counter()))

    def move(self, *, waiting: int = 0, active: int = 0) -> None:
        """Requests changed hands: submitted -> inserted -> finished, or back (a retry)."""
        with self.lock:
            self.waiting += waiting
            self.active += active
            self.peak_active = max(self.peak_active, self.active)

    def emit(self, fin: Finished, *, waiting: int = 0, active: int = 0) -> None:
        # Outbox first: a reader that sees the counts drop to zero finds the result there.
        self.outbox.put(fin)
        self.finished += 1
        if fin.error is not None:
            self.errors += 1
        self.move(waiting=waiting, active=active)

    def abort_all(
        self, why: str, pending: deque[tuple[Request, float]], live: dict[int, _Live]
    ) -> None:
        """Fail everything still queued or running (shutdown or load failure)."""
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                pending.append(item)
        for req, _ in pending:
            self.emit(_error(req, why, 0), waiting=-1)
        pending.clear()
        for lv in live.values():
            self.emit(_error(lv.req, why, lv.prompt_tokens, lv.hit, lv.timings), active=-1)
        live.clear()
        self.kv_in_flight = 0


class Engine:
    """Continuous-batching generator over one loaded model; see module docstring."""

    def __init__(
        self, model_path: str, *, max_batch: int = 8, prefill_batch: int | None = None,
        repetition: RepetitionGuard | None = None,
        max_kv_tokens: int | None = None,
        fault: faults.StepFault | None = None,
        auto_batch: bool = False,
        prefix_cache_bytes: int | None = 0,
    ) -> None:
        """`auto_batch`: `max_batch` is a cap and the row limit follows measured
        throughput from 8 rows up (worker/engine/batch_size.py); otherwise it is `max_batch`.
        `fault`: a test hook raising in place of a generator step (worker/engine/faults.py);
        None reads VLMQ_FAULT_ROW, which is normally unset.
        `prefix_cache_bytes`: the budget of reused prompt prefixes (prefix_cache.py);
        None: derived from the machine's memory, 0: no reuse."""
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        blas.select()  # before MLX loads in the engine thread; no-op when already chosen
        if max_kv_tokens is not None and max_kv_tokens < 1:
            raise ValueError("max_kv_tokens must be at least 1")
        self.model_path = model_path
        self.repetition = repetition  # None: rows are never cut for looping
        # Admission budget: sum of (prompt + max_tokens) in flight; None: derived from the
        # model and the machine's memory once loaded (worker/engine/kv_budget.py).
        self.max_kv_tokens = max_kv_tokens
        self.max_batch = max_batch
        # Prompts prefilled together: at most PREFILL_ROWS by default, so a grown batch
        # does not stall its decoding rows behind one long prefill.
        self.prefill_batch = max(1, min(prefill_batch or min(max_batch, PREFILL_ROWS),
                                        max_batch))
        self.fault = fault if fault is not None else faults.from_env()
        self.prefix_cache_bytes = (prefix_cache.default_budget() if prefix_cache_bytes is None
                                   else prefix_cache_bytes)
        self.prefix_given = prefix_cache_bytes is not None  # on for every verified family
        self.state = EngineState()  # shared with the MLX thread; read it for counters
        self.state.kv_budget = max_kv_tokens or 0
        # Pure logic: made here so the limit is known before the model loads; from then on
        # only the MLX thread's loop calls it.
        self._sizer = BatchSizer(max_batch, floor=FLOOR if auto_batch else max_batch)
        self.state.batch_limit, self.state.batch_reason = self._sizer.limit, self._sizer.reason
        self._ready = threading.Event()
        self._loaded: LoadedModel | None = None
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="vlmq-mlx", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public API (any thread)

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        """Block until the model is loaded; raise EngineError if it could not be."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"model {self.model_path!r} not loaded after {timeout}s")
        if self._load_error is not None:
            raise EngineError(str(self._load_error)) from self._load_error
        return self.info

    @property
    def info(self) -> EngineInfo:
        loaded = self._require_loaded()
        return EngineInfo(
            model_id=loaded.model_id,
            model_type=loaded.model_type,
            cacheable=loaded.cacheable,
            context_length=loaded.context_length,
            fingerprint=loaded.fingerprint,
        )

    @property
    def processor(self) -> Any:
        """For CPU-side preparation (mlx_adapter.prepare); treat as read-only."""
        return self._require_loaded().processor

    @property
    def model_config(self) -> Any:
        """For CPU-side preparation (mlx_adapter.prepare); treat as read-only."""
        return self._require_loaded().model.config

    def submit(self, req: Request) -> None:
        """Queue a request for the next step; never blocks on MLX."""
        if self._load_error is not None:
            raise EngineError(f"engine has no model: {self._load_error}")
        if self.state.closing.is_set():
            raise EngineError("engine is closed")
        self.state.submit(req)

    def cancel(self, keys: Iterable[Hashable]) -> None:
        """Drop these requests, waiting or in the batch, before the next step; each ends
        as a Finished with finish_reason "cancelled" (a key not seen yet, when it comes)."""
        for key in keys:
            self.state.cancels.put(key)

    def get_finished(self, timeout: float) -> list[Finished]:
        """Everything finished since the last call; waits up to `timeout` for the first
        (what streamed rows reported meanwhile is left out: get_output has it)."""
        return [o for o in self.get_output(timeout) if isinstance(o, Finished)]

    def get_output(self, timeout: float) -> list[Output]:
        """Everything finished or streamed since the last call, in the order it happened;
        waits up to `timeout` for the first."""
        outbox = self.state.outbox
        out: list[Output] = []
        try:
            out.append(outbox.get(timeout=timeout) if timeout > 0 else outbox.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(outbox.get_nowait())
            except queue.Empty:
                return out

    def stats(self) -> dict[str, float]:
        st = self.state
        return {
            "waiting": st.waiting,
            "active": st.active,
            "peak_active": st.peak_active,
            "max_batch": self.max_batch,
            "batch_limit": st.batch_limit,
            "tower_calls": st.tower_calls,
            "tokens_generated": st.tokens_generated,
            "finished": st.finished,
            "errors": st.errors,
            "repetitions": st.repetitions,
            "isolations": st.isolations,
            "prefix_hits": st.prefix_hits,
            "prefix_tokens_skipped": st.prefix_tokens_skipped,
            "prefill_tokens": st.prefill_tokens,
            "prefix_bytes": st.prefix_bytes,
        }

    def close(self, timeout: float | None = None) -> None:
        """Stop the MLX thread; requests still queued or running finish with an error."""
        self.state.closing.set()
        self.state.inbox.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            # A submit that raced the shutdown lands here; answer it too.
            self.state.abort_all("engine closed", pending=deque(), live={})

    def _require_loaded(self) -> LoadedModel:
        if self._loaded is None:
            raise EngineError("model not loaded yet (call wait_ready first)")
        return self._loaded

    # ------------------------------------------------------------ MLX thread

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            mlx_adapter.release_thread_streams()

    def _serve(self) -> None:
        try:
            self._loaded = mlx_adapter.load_model(self.model_path)
        except Exception as exc:  # reported to wait_ready, not lost
            if isinstance(exc, mlx_adapter.ModelLoadError):
                log.debug("engine: model load failed: %s", exc)
            else:
                log.exception("engine: model load failed")
            self._load_error = exc
            self.state.closing.set()
            self._ready.set()
            self.state.abort_all("model failed to load", pending=deque(), live={})
            return
        self._apply_family_limits(self._loaded.family)
        self._ready.set()
        _Loop(self.state, self._loaded, max_batch=self.max_batch,
              prefill_batch=self.prefill_batch, repetition=self.repetition,
              max_kv_tokens=self.max_kv_tokens, fault=self.fault, sizer=self._sizer,
              prefix_cache_bytes=self.prefix_cache_bytes,
              prefix_given=self.prefix_given).run()

    def _apply_family_limits(self, family: FamilySpec) -> None:
        """Prefill one prompt at a time where mlx-vlm cannot prefill this family's prompts
        together exactly (every verified family decodes batched).

        VLMQ_IGNORE_FAMILY_LIMITS=1 skips this, to see why a limit exists: `vlmq model
        check` then shows the parity failure the limit prevents.
        """
        if os.environ.get(IGNORE_LIMITS_ENV) == "1":
            log.warning("%s=1: batching %s without its family limits; output may differ "
                        "from sequential generate", IGNORE_LIMITS_ENV,
                        self._require_loaded().model_type)
            return
        if family.prefill_one is not None and self.prefill_batch > 1:
            log.warning("model type %s prefills one prompt at a time (decoding still "
                        "batches): %s", self._require_loaded().model_type, family.prefill_one)
            self.prefill_batch = 1


def bulk_shape(reqs: list[Request], prompts: list[int]) -> Shape:
    """The shape of the batch's work as the sizer sees it: its bulk rows'. Interactive
    rows come and go in rows of their own past the limit, and their short answers would
    move the shape (so the sizer would start again from its floor) at every question."""
    rows = [(r, p) for r, p in zip(reqs, prompts, strict=True) if not r.interactive]
    rows = rows or list(zip(reqs, prompts, strict=True))
    return Shape.of([p for _, p in rows], [r.max_tokens for r, _ in rows],
                    sum(r.constraint is not None for r, _ in rows))


def _cancelled(fin: Finished) -> Finished:
    return replace(fin, finish_reason="cancelled")


def _error(
    req: Request,
    message: str,
    prompt_tokens: int,
    hit: bool = False,
    timings: dict[str, float] | None = None,
) -> Finished:
    return Finished(
        key=req.key,
        text="",
        finish_reason="error",
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        vision_cache_hit=hit,
        error=message,
        timings=dict(timings or {}),
    )


class _Loop:
    """The MLX thread's own state and steps; only that thread touches it.

    It keeps the generator, the pending and live rows and the KV budget, and shares only
    `state` (queues, counts, counters) with the engine's callers.
    """

    def __init__(self, state: EngineState, loaded: LoadedModel, *, max_batch: int,
                 prefill_batch: int, repetition: RepetitionGuard | None,
                 max_kv_tokens: int | None, fault: faults.StepFault | None = None,
                 sizer: BatchSizer | None = None, prefix_cache_bytes: int = 0,
                 prefix_given: bool = True) -> None:
        self.state = state
        self.m = loaded
        self.max_batch = max_batch
        # The most rows ever live: the limit's cap, the express rows and the interactive
        # rows past it.
        self.capacity = (max_batch + admission.express_rows(max_batch)
                         + admission.INTERACTIVE_ROWS)
        self.prefill_batch = prefill_batch
        self.repetition = repetition
        self.eos = mlx_adapter.eos_token_ids(loaded.processor)
        self.pending: deque[tuple[Request, float]] = deque()
        self.live: dict[int, _Live] = {}
        self.seen: dict[Hashable, int] = {}  # waiting request -> the step it was taken in at
        self.clear_cache_at: int | None = None
        self.retried: dict[Hashable, str] = {}  # key -> what its first attempt did
        self.fault = fault
        self.sizer = sizer if sizer is not None else BatchSizer(max_batch, floor=max_batch)
        # A failed step's rows, rerun in groups (halves) to find the row at fault: the
        # group running now (nothing else joins it), and the groups still to run.
        self.suspects: deque[list[tuple[Request, float]]] = deque()
        self.isolating: set[Hashable] = set()
        self.isolated: set[Hashable] = set()  # rows that have been rerun apart at least once
        max_kv, per_token, weights = kv_budget.model_budget(loaded.model)
        self.prefix = self._prefix_cache(prefix_cache_bytes, per_token, prefix_given)
        self.gen = self._new_generator()
        if max_kv_tokens is None:
            max_kv_tokens = max_kv
            log.info("engine: KV admission budget %d tokens (%d bytes/token, weights %.0f MB; "
                     "--max-kv-tokens overrides)", max_kv_tokens, per_token, weights / 1e6)
        self.kv_budget: int = max_kv_tokens
        state.kv_budget = max_kv_tokens
        self.warned_over_budget: set[Hashable] = set()
        # Schema matching over all rows of a step, held to a share of the model's time.
        self.matching = MatchBudget()
        # Characters each streamed row has reported, by key: a row rerun from its prompt
        # (a failed step's isolation, a deferral) reports only what is new.
        self.streamed: dict[Hashable, int] = {}
        # Cancelled keys not seen yet (still being prepared): dropped when they come.
        self.cancel_early: set[Hashable] = set()
        # When an interactive row was last waiting or live (admission.bulk_prefill_rows).
        self.last_interactive: float | None = None

    def _prefix_cache(self, budget: int, per_token: int,
                      given: bool) -> prefix_cache.PrefixCache | None:
        """The prefix store, when the budget allows one and the family's parity holds."""
        why = (prefix_cache.reason_off(self.m.model_type, given=given) if budget > 0
               else "budget 0")
        self.state.prefix_off = why or ""
        if why is not None:
            log.info("engine: prefix reuse off for %s: %s", self.m.model_type, why)
            return None
        log.info("engine: prefix reuse on, %.0f MB (--prefix-cache-mb)", budget / 1e6)
        return prefix_cache.PrefixCache(self.m.model, self.m.fingerprint, budget, per_token)

    def _new_generator(self) -> Any:
        from mlx_vlm.generate import BatchGenerator

        return BatchGenerator(
            self.m.model.language_model,
            self.m.processor,
            # The engine caps in-flight rows itself; this headroom makes the
            # generator admit a new prefill as soon as one is inserted.
            completion_batch_size=self.capacity + self.prefill_batch,
            prefill_batch_size=self.prefill_batch,
            compute_logprobs=False,
            apc_manager=None if self.prefix is None else self.prefix.manager,
        )

    def run(self) -> None:
        st = self.state
        while not st.closing.is_set():
            self._intake(block=not (self.live or self.pending or self.suspects))
            self._cancel()
            t0 = time.perf_counter()
            admitted = self._admit()
            if self.live:
                # A turn that prefills (rows just admitted, or not yet at their first token)
                # costs what the prompts cost, not what the batch's size does.
                prefill = admitted > 0 or any(lv.first_token_at is None
                                              for lv in self.live.values())
                rows = len(self.live)
                matchers = [c for _, c in self._constrained()]
                for c in matchers:
                    c.last_s = 0.0
                ts = time.perf_counter()
                tokens = self._step()
                self._size(rows, tokens, time.perf_counter() - t0, prefill)
                if prefill:
                    st.prefill_turn_s += time.perf_counter() - t0
                else:
                    st.decode_turns += 1
                    st.decode_turn_rows += rows
                    self.matching.observe(time.perf_counter() - ts,
                                          sum(c.last_s for c in matchers))
                self._hold_matching()
            st.busy_s += time.perf_counter() - t0
        while self.suspects:
            self.pending.extend(self.suspects.popleft())
        st.abort_all("engine closed", self.pending, self.live)
        self.gen.close()
        if self.prefix is not None:
            self.prefix.close()

    def _constrained(self) -> list[tuple[_Live, RowConstraint]]:
        """The rows with a schema matcher, oldest first."""
        return [(lv, lv.req.constraint) for lv in self.live.values()
                if lv.req.constraint is not None]

    def _hold_matching(self) -> None:
        """After a step: defer the costliest constrained rows while they cost over the
        matching budget (match_budget.py)."""
        if self.isolating or self._one_schema():
            return  # a failed step's rows rerun apart; or no other row to slow down
        rows = [(lv, c) for lv, c in self._constrained() if lv.first_token_at is not None]
        going = [rows[i][0] for i in self.matching.defer([c.cost_s for _, c in rows])]
        if going:
            self._defer(going)

    def _defer(self, rows: list[_Live]) -> None:
        """Take constrained rows out of the batch to wait for room in the matching
        budget; each restarts from its prompt (its matcher too) when admitted again."""
        import mlx.core as mx

        log.info("engine: %d constrained row(s) deferred: the rows cost %.1f ms a step, "
                 "over the matching budget of %.1f ms (%s)", len(rows),
                 1000 * sum(c.cost_s for _, c in self._constrained()),
                 1000 * (self.matching.budget_s or 0.0), ", ".join(repr(lv.req.key)
                                                                   for lv in rows))
        mx.synchronize()  # Metal: settle in-flight work before the batch is filtered
        for lv in rows:
            self.gen.remove(lv.uid)
            del self.live[lv.uid]
            self.state.kv_in_flight -= lv.kv_cost
            self.pending.appendleft((lv.req, time.perf_counter()))
        self.state.deferrals += len(rows)
        self.state.move(active=-len(rows), waiting=len(rows))
        self.clear_cache_at = self.state.steps + _CLEAR_CACHE_DELAY

    def _size(self, rows: int, tokens: int, seconds: float, prefill: bool) -> None:
        """Tell the sizer what this turn produced; say so when the row limit moves."""
        shape = bulk_shape([lv.req for lv in self.live.values()],
                           [lv.prompt_tokens for lv in self.live.values()])
        if self.sizer.observe(rows, tokens, seconds, shape, waiting=len(self.pending),
                              prefill=prefill):
            log.info("engine: batch limit %d rows: %s", self.sizer.limit, self.sizer.reason)
        self.state.batch_limit, self.state.batch_reason = self.sizer.limit, self.sizer.reason

    def _cancel(self) -> None:
        """Drop the rows cancel() named, waiting or live, before the next step."""
        import mlx.core as mx

        keys: set[Hashable] = set()
        while True:
            try:
                keys.add(self.state.cancels.get_nowait())
            except queue.Empty:
                break
        wanted = keys | self.cancel_early
        if not wanted:
            return
        found: set[Hashable] = set()
        kept: deque[tuple[Request, float]] = deque()
        for req, submitted_at in self.pending:
            if req.key not in wanted:
                kept.append((req, submitted_at))
                continue
            found.add(req.key)
            self.seen.pop(req.key, None)
            self.state.emit(_cancelled(_error(req, "cancelled", 0)), waiting=-1)
        self.pending = kept
        rows = [lv for lv in self.live.values() if lv.req.key in keys]
        if rows:
            mx.synchronize()  # Metal: settle in-flight work before the batch is filtered
        for lv in rows:
            self.gen.remove(lv.uid)
            found.add(lv.req.key)
            timings, _, _ = self._leave(lv, "cancelled", None, None)
            fin = _cancelled(_error(lv.req, "cancelled", lv.prompt_tokens, lv.hit, timings))
            fin.tokens = list(lv.tokens)
            self.state.emit(fin, active=-1)
        if rows:
            self.clear_cache_at = self.state.steps + _CLEAR_CACHE_DELAY
        self.state.cancelled += len(found)
        for key in found:
            self.streamed.pop(key, None)
        # Keys not seen yet are still being prepared (or never come: bounded anyway).
        early = (self.cancel_early | keys) - found
        self.cancel_early = early if len(early) <= _MAX_CANCEL_EARLY else keys - found

    def _intake(self, block: bool) -> None:
        """Move submitted requests to `pending`; block briefly only when idle."""
        inbox = self.state.inbox
        try:
            item = inbox.get(timeout=_IDLE_WAIT_S) if block else inbox.get_nowait()
            while True:
                if item is not None:
                    self.pending.append(item)
                    self.seen.setdefault(item[0].key, self.state.steps)
                item = inbox.get_nowait()
        except queue.Empty:
            return

    def _admit(self) -> int:
        """Embed and insert pending requests while admission.admits them.

        The next request is an interactive one if any waits, else the one with the best
        priority (its job's items left, then its batch's items out; FIFO among equals).
        Up to the batch limit any request joins; past it only a small job's, into the
        express rows, or an interactive one, into rows of its own (admission.py). If the
        next one does not fit, it waits (later ones wait behind it, so a long one is
        never starved); one over the whole KV budget runs alone, once nothing else is in
        flight.
        """
        if self._admit_suspects():
            return 1
        bulk_room = self._bulk_room()
        admitted = interactive = 0
        while self.pending and admitted < self.prefill_batch:
            pending = self.pending
            first = self._next_pending()
            if first is None:
                return admitted
            req, submitted_at = pending[first]
            if not req.interactive and (interactive or admitted >= bulk_room):
                return admitted  # an interactive row's prefill waits for no bulk prompt
            if not self._fits(req):
                return admitted
            del pending[first]
            self.warned_over_budget.discard(req.key)
            if req.interactive:
                self._count_interactive()
                interactive += 1
            self._insert_risky(req, submitted_at)
            admitted += 1
        return admitted

    def _bulk_room(self) -> int:
        """Bulk rows this turn may admit (admission.bulk_prefill_rows), noting whether a
        person is on the machine."""
        now = time.monotonic()
        chats = [lv for lv in self.live.values() if lv.req.interactive]
        if chats or any(req.interactive for req, _ in self.pending):
            self.last_interactive = now
        return admission.bulk_prefill_rows(
            self.prefill_batch, last_interactive=self.last_interactive, now=now,
            first_token_due=any(lv.first_token_at is None for lv in chats),
            prompts_in_flight=sum(lv.first_token_at is None for lv in self.live.values()))

    def _fits(self, req: Request) -> bool:
        """Whether admission.admits `req` now; one over the whole KV budget is warned of
        once (it runs alone)."""
        cost = self._kv_cost(req)
        biggest = (max(lv.req.job_left for lv in self.live.values())
                   if len(self.live) >= self.sizer.limit else 0)  # read past it only
        if not admission.admits(admission.Waiting(req.job_left, cost, biggest, req.interactive),
                                live=len(self.live), limit=self.sizer.limit,
                                capacity=self.capacity, kv_in_flight=self.state.kv_in_flight,
                                kv_budget=self.kv_budget):
            return False
        if cost > self.kv_budget and req.key not in self.warned_over_budget:
            self.warned_over_budget.add(req.key)
            log.warning("engine: request %r needs %d KV tokens (prompt + max_tokens), over "
                        "the --max-kv-tokens budget of %d: running it alone", req.key,
                        cost, self.kv_budget)
        return True

    def _count_interactive(self) -> None:
        """An interactive row goes in: the bulk rows waiting count as delayed when it
        took a row within the limit (past it, they would have waited anyway)."""
        st = self.state
        st.interactive_admitted += 1
        if len(self.live) < self.sizer.limit:
            st.bulk_rows_delayed += sum(not req.interactive for req, _ in self.pending)

    def _next_pending(self) -> int | None:
        """The pending request to admit next: an interactive one if any waits (the best
        priority of them); else the best priority, unless it is constrained and does not
        fit the matching budget; then the best unconstrained one (the constrained behind
        it wait too, so it is never starved), or None."""
        pending = self.pending
        interactive = [k for k in range(len(pending)) if pending[k][0].interactive]
        if interactive:
            return min(interactive, key=lambda k: pending[k][0].priority)
        first = min(range(len(pending)), key=lambda k: pending[k][0].priority)
        constraint = pending[first][0].constraint
        held = self._constrained()
        if constraint is None or self._one_schema() or (
                self.matching.admits([c.cost_s for _, c in held], constraint.cost_s)
                and not _unproven(constraint, held)):
            return first
        free = [k for k in range(len(pending)) if pending[k][0].constraint is None]
        return min(free, key=lambda k: pending[k][0].priority) if free else None

    def _one_schema(self) -> bool:
        """Every row in the batch and waiting is of one schema: its matching slows only
        rows that cost the same, so the budget has no one to protect (a batch of one
        extract job's pages runs at full width)."""
        costs = {id(r.constraint.schema_cost) if r.constraint is not None else None
                 for r in [*(lv.req for lv in self.live.values()),
                           *(req for req, _ in self.pending)]}
        return len(costs) == 1 and None not in costs

    def _insert_risky(self, req: Request, submitted_at: float) -> None:
        risky = req.risky("vision tower") if req.risky is not None else nullcontext()
        with risky:  # a crash in here is charged to this request's job
            self._insert(req, submitted_at)

    def _admit_suspects(self) -> bool:
        """While a failed step's rows are rerun apart, only they run: True then (normal
        admission waits), False once every group has finished."""
        if self.isolating & {lv.req.key for lv in self.live.values()}:
            return True
        self.isolating = set()
        if not self.suspects:
            return False
        if self.live:
            return True  # rows admitted before the failure finish first, then the group runs
        group = self.suspects.popleft()
        self.isolating = {req.key for req, _ in group}
        self.isolated |= self.isolating
        for req, submitted_at in group:
            self._insert_risky(req, submitted_at)
        return True

    def _kv_cost(self, req: Request) -> int:
        prompt = req.prepared.prompt_tokens or 0
        return prompt + max(0, min(req.max_tokens, self.m.context_length - prompt))

    def _insert(self, req: Request, submitted_at: float) -> None:
        import mlx.core as mx

        st, m = self.state, self.m
        t0 = time.perf_counter()
        timings = {"queue_s": t0 - submitted_at, "vision_s": 0.0}
        hit = False
        prompt_tokens = req.prepared.prompt_tokens or 0
        try:
            self._check_budget(req, prompt_tokens)
            features = None
            prepared = req.prepared
            if m.cacheable and req.cached_features is not None:
                features = mlx_adapter.features_from_numpy(*req.cached_features)
                hit = True
            elif m.cacheable and prepared.pixel_values is not None:
                tv = time.perf_counter()
                features = mlx_adapter.vision_features(m.model, prepared)
                st.tower_calls += 1
                timings["vision_s"] = time.perf_counter() - tv
                self._report_features(req, features)
            elif prepared.pixel_values is not None or prepared.deferred_image is not None:
                st.tower_calls += 1  # runs inside get_input_embeddings
            te = time.perf_counter()
            ids, kwargs = mlx_adapter.build_prompt_kwargs(m.model, m.processor, prepared, features)
            timings["embed_s"] = time.perf_counter() - te
            prompt_tokens = len(ids)
            max_tokens = self._check_budget(req, prompt_tokens)
            spared = self._prefix(req, ids, kwargs)
            procs: list[Any] = [_Temperature(req.temperature)] if req.temperature > 0 else []
            if req.constraint is not None:
                req.constraint.reset()  # a retried row starts its value again
                procs.append(req.constraint)
            (uid,) = self.gen.insert(
                [ids], max_tokens=[max_tokens], prompt_kwargs=[kwargs], logits_processors=[procs]
            )
        except Exception as exc:  # one bad item fails alone; the engine goes on
            log.exception("engine: request %r failed before generation", req.key)
            self.seen.pop(req.key, None)
            mx.clear_cache()
            st.emit(_error(req, f"{type(exc).__name__}: {exc}", prompt_tokens, hit, timings),
                    waiting=-1)
            return
        window = max((len(s.encode("utf-8")) for s in req.stop), default=0)
        cost = prompt_tokens + max_tokens
        st.kv_in_flight += cost
        st.peak_kv_in_flight = max(st.peak_kv_in_flight, st.kv_in_flight)
        self.live[uid] = _Live(
            req=req,
            uid=uid,
            prompt_tokens=prompt_tokens,
            hit=hit,
            timings=timings,
            inserted_at=time.perf_counter(),
            stop_window=window + 2 if window else 0,
            kv_cost=cost,
            prefix_tokens=spared,
            admitted_step=self.state.steps,
            seen_step=self.seen.pop(req.key, self.state.steps),
            detok=mlx_adapter.streaming_detokenizer(m.processor) if req.stream else None,
        )
        st.move(waiting=-1, active=1)

    def _prefix(self, req: Request, ids: list[int], kwargs: dict[str, Any]) -> int:
        """The row's cached prefix, looked up (prefilled and stored on a miss, so the
        rows after it with the same image and prefix prefill only their own tokens);
        returns the prompt tokens it spares this row."""
        st = self.state
        if self.prefix is None or req.prefix_key is None:
            st.prefill_tokens += len(ids)
            return 0
        hit, spared = self.prefix.prepare(ids, kwargs, req.prefix_key)
        # A miss prefills its prefix apart (stored for the rows after it), then the rest.
        st.prefill_tokens += len(ids) - (spared if hit else 0)
        ps = self.prefix.stats
        st.prefix_hits, st.prefix_tokens_skipped = ps.hits, ps.tokens_skipped
        st.prefix_bytes = self.prefix.held_bytes()
        st.peak_prefix_bytes = max(st.peak_prefix_bytes, st.prefix_bytes)
        return spared if hit else 0

    def _check_budget(self, req: Request, prompt_tokens: int) -> int:
        """Max new tokens this request may have: its own, clamped to the context left."""
        context = self.m.context_length
        if prompt_tokens >= context:
            raise ValueError(f"prompt has {prompt_tokens} tokens; model context is {context}")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens}")
        return int(min(req.max_tokens, context - prompt_tokens))

    def _report_features(self, req: Request, features: Any) -> None:
        if req.on_features is None:
            return
        try:
            req.on_features(*mlx_adapter.features_to_numpy(features))
        except Exception:  # a failing cache write must not fail the item
            log.exception("engine: on_features callback failed for %r", req.key)

    def _step(self) -> int:
        """One generator step; returns the tokens it produced."""
        import mlx.core as mx

        try:
            if self.fault is not None:
                self.fault([(lv.req.key, len(lv.tokens)) for lv in self.live.values()])
            _, responses = self.gen.next()
        except Exception as exc:  # noqa: BLE001  # whose fault is unknown: _step_failed finds it
            self._step_failed(exc)
            return 0
        self.state.steps += 1
        cuts = self._take_tokens(responses)
        cuts.failed.extend((lv, lv.req.constraint.failure) for lv in self.live.values()
                           if lv.req.constraint is not None
                           and lv.req.constraint.failure is not None)
        if cuts:
            self._cut(cuts)
        self._stream()
        if self.clear_cache_at is not None and self.state.steps >= self.clear_cache_at:
            mx.clear_cache()
            self.clear_cache_at = None
        return len(responses)

    def _stream(self) -> None:
        """Report what each streamed row still in the batch decoded this step: whole
        characters, up to where a stop string could yet begin (mlx_adapter.streamable)."""
        for lv in self.live.values():
            if lv.detok is None:
                continue
            sent = self.streamed.get(lv.req.key, 0)
            text, end = mlx_adapter.streamable(lv.detok, lv.req.stop, sent)
            if end > sent:
                self.streamed[lv.req.key] = end
                self.state.outbox.put(Streamed(lv.req.key, text[sent:end]))

    def _step_failed(self, exc: Exception) -> None:
        """A step raised and nothing says which row caused it (an MLX error): start afresh
        and rerun the rows by halves, each group alone, until a row fails by itself. Rows
        not at fault restart from their prompts: at temperature 0 they end with the tokens
        they would have had, and none is failed or charged a retry."""
        import mlx.core as mx

        rows = list(self.live.values())
        why = f"generation failed: {type(exc).__name__}: {exc}"
        if len(rows) == 1:
            log.error("engine: generator step failed with one row in the batch, %r: %s",
                      rows[0].req.key, why)
            alone = " (it fails alone: found by rerunning its batch's rows apart)"
            self._finish(rows[0], "error",
                         error=why + (alone if rows[0].req.key in self.isolated else ""))
        else:
            log.warning("engine: generator step failed with %d rows in the batch (%s): "
                        "rerunning them apart to find the row at fault", len(rows), why)
            self.state.isolations += 1
            for lv in rows:
                del self.live[lv.uid]
                self.state.kv_in_flight -= lv.kv_cost
            self.state.move(active=-len(rows), waiting=len(rows))
            half = len(rows) // 2
            groups = [[(lv.req, lv.inserted_at - lv.timings.get("queue_s", 0.0)) for lv in part]
                      for part in (rows[:half], rows[half:])]
            self.suspects.extendleft(reversed(groups))
            self.isolating = set()
        try:
            self.gen.close()
        except Exception:  # a broken generator is replaced either way
            log.exception("engine: closing the failed generator raised")
        mx.clear_cache()
        self.gen = self._new_generator()

    def _take_tokens(self, responses: Iterable[Any]) -> _Cuts:
        """Add each row's new token and end the rows the generator ended; returns the rows
        to cut mid-batch: at a stop string, at a loop, or failed by their own checks."""
        now = time.perf_counter()
        cuts = _Cuts()
        for r in responses:
            lv = self.live.get(r.uid)
            if lv is None:
                continue  # removed by us after this token was computed
            lv.tokens.append(int(r.token))
            if lv.detok is not None and r.finish_reason is None:
                lv.detok.add_token(int(r.token))
            self.state.tokens_generated += 1
            if lv.first_token_at is None:
                lv.first_token_at = now
                lv.first_step = self.state.steps
            try:
                if r.finish_reason is not None:
                    self._finish(lv, r.finish_reason)
                else:
                    self._check_row(lv, cuts)
            except Exception as exc:  # this row's own failure, cut alone
                log.exception("engine: row %r failed its checks", lv.req.key)
                if lv.uid in self.live:
                    cuts.failed.append((lv, f"{type(exc).__name__}: {exc}"))
        return cuts

    def _check_row(self, lv: _Live, cuts: _Cuts) -> None:
        """A running row's stop strings and repetition guard (not a streamed row's)."""
        guard = self.repetition if not lv.req.stream else None
        cut = self._stop_cut(lv) if lv.stop_window else None
        loop = guard.find(lv.tokens) if guard is not None and cut is None else None
        if cut is not None:
            cuts.stopped.append((lv, cut))
        elif loop is not None:
            cuts.looped.append((lv, *loop))

    def _cut(self, cuts: _Cuts) -> None:
        """Take rows out of the running batch, then end (or retry) them."""
        import mlx.core as mx

        mx.synchronize()  # Metal: settle in-flight work before the batch is filtered
        failed = {lv.uid: why for lv, why in cuts.failed}
        for lv in cuts.rows():
            self.gen.remove(lv.uid)
        for lv, cut in cuts.stopped:
            if lv.uid not in failed:
                self._finish(lv, "stop", cut=cut)
        for lv, period, keep in cuts.looped:
            if lv.uid not in failed:
                self._looped(lv, period, keep)
        for uid, why in failed.items():
            if uid in self.live:
                self._finish(self.live[uid], "error", error=why)
        self.clear_cache_at = self.state.steps + _CLEAR_CACHE_DELAY

    def _looped(self, lv: _Live, period: int, keep: int) -> None:
        """A row's tail loops: retry it once, hotter, or end it keeping the first copy."""
        guard = self.repetition
        assert guard is not None
        self.state.repetitions += 1
        what = (f"loop of {period} token{'s' if period > 1 else ''} from token "
                f"{keep - period} cut at token {len(lv.tokens)}")
        first = self.retried.get(lv.req.key)
        if guard.on_repetition == "retry" and first is None:
            self.retried[lv.req.key] = what
            del self.live[lv.uid]
            self.state.kv_in_flight -= lv.kv_cost
            req = replace(lv.req, temperature=max(lv.req.temperature, guard.retry_temperature))
            self.pending.appendleft((req, time.perf_counter()))
            self.state.move(active=-1, waiting=1)
            return
        note = what if first is None else (
            f"{first}; retried at temperature {guard.retry_temperature}: {what} again")
        self._finish(lv, "repetition", keep=keep, note=note)

    def _stop_cut(self, lv: _Live) -> int | None:
        """Index in the full text where the earliest stop string starts, if one has appeared."""
        tail = mlx_adapter.decode(self.m.processor, lv.tokens[-lv.stop_window :])
        if not any(s in tail for s in lv.req.stop):
            return None
        return _earliest(mlx_adapter.decode(self.m.processor, lv.tokens), lv.req.stop)

    def _finish(
        self, lv: _Live, reason: str, *, cut: int | None = None, error: str | None = None,
        keep: int | None = None, note: str | None = None,
    ) -> None:
        """End a row for good and emit its result; a row whose output cannot be decoded or
        judged fails alone, with that reason."""
        timings, error, note = self._leave(lv, reason, error, note)
        fin: Finished | None = None
        if error is None:
            try:
                fin = self._result(lv, reason, cut, keep, timings)
            except Exception as exc:  # this row's detokenizer or matcher, not the batch
                log.exception("engine: row %r could not be finished", lv.req.key)
                error = f"output could not be decoded: {type(exc).__name__}: {exc}"
        if fin is None:
            fin = _error(lv.req, error or "failed", lv.prompt_tokens, lv.hit, timings)
            fin.tokens = list(lv.tokens)
        fin.repetition = note
        fin.streamed = self.streamed.pop(lv.req.key, 0)
        self.state.emit(fin, active=-1)

    def _leave(self, lv: _Live, reason: str, error: str | None,
               note: str | None) -> tuple[dict[str, float], str | None, str | None]:
        """Take the row out of the engine's books: its timings, error and retry note."""
        del self.live[lv.uid]
        self.isolated.discard(lv.req.key)
        self.state.kv_in_flight -= lv.kv_cost
        constraint = lv.req.constraint
        if constraint is not None:
            constraint.close()
            if error is None and constraint.failure is not None:
                error = constraint.failure  # its last step failed as the generator ended it
        earlier = self.retried.pop(lv.req.key, None)
        if note is None and earlier is not None:
            note = (f"{earlier}; retried at temperature {lv.req.temperature}: "
                    f"ended with {reason}")
        now = time.perf_counter()
        first = lv.first_token_at or now
        timings = {**lv.timings, "prefill_s": first - lv.inserted_at, "generate_s": now - first}
        return timings, error, note

    def _result(self, lv: _Live, reason: str, cut: int | None, keep: int | None,
                timings: dict[str, float]) -> Finished:
        body = lv.tokens if keep is None else lv.tokens[:keep]
        if reason == "stop" and cut is None and body and body[-1] in self.eos:
            body = body[:-1]
        text = mlx_adapter.decode(self.m.processor, body)
        if cut is None and lv.req.stop:
            cut = _earliest(text, lv.req.stop)  # a stop string completed by the last token
        if cut is not None:
            text, reason = text[:cut], "stop"
        value, problem = None, None
        if lv.req.constraint is not None:
            timings["mask_s"] = lv.req.constraint.mask_s
            value, problem = _json_outcome(lv.req.constraint, lv.tokens, reason, text)
        return Finished(key=lv.req.key, text=text, finish_reason=reason,
                        prompt_tokens=lv.prompt_tokens, completion_tokens=len(lv.tokens),
                        vision_cache_hit=lv.hit, error=problem, timings=timings,
                        tokens=list(lv.tokens), json=value, prefix_tokens=lv.prefix_tokens,
                        admitted_step=lv.admitted_step, seen_step=lv.seen_step,
                        first_step=lv.first_step)


@dataclass
class _Cuts:
    """Rows to take out of the batch after a step, and why."""

    stopped: list[tuple[_Live, int]] = field(default_factory=list)  # (row, text cut)
    looped: list[tuple[_Live, int, int]] = field(default_factory=list)  # (row, period, keep)
    failed: list[tuple[_Live, str]] = field(default_factory=list)  # (row, its own error)

    def __bool__(self) -> bool:
        return bool(self.stopped or self.looped or self.failed)

    def rows(self) -> list[_Live]:
        seen: dict[int, _Live] = {}
        for lv in ([r for r, _ in self.stopped] + [r for r, _, _ in self.looped]
                   + [r for r, _ in self.failed]):
            seen.setdefault(lv.uid, lv)
        return list(seen.values())


def _unproven(constraint: RowConstraint, held: list[tuple[_Live, RowConstraint]]) -> bool:
    """A row of a schema no row has run a step of yet, while one of its rows is in the
    batch: it waits for that row's first step, so a schema whose first mask looked cheaper
    than its steps are admits one row, not a batch full."""
    cost = constraint.schema_cost
    return not cost.measured and any(c.schema_cost is cost for _, c in held)


def _json_outcome(constraint: RowConstraint, tokens: list[int], reason: str,
                  text: str) -> tuple[Any, str | None]:
    """A constrained row's value, or why it has none: a value cut short is never returned
    as if it were whole."""
    if reason == "repetition":
        return None, ("output cut by the repetition guard before the JSON was complete "
                      "(the model looped inside the value)")
    if reason == "length" and not constraint.complete(tokens):
        return None, ("output cut at max_tokens before the JSON was complete: raise "
                      "--max-tokens")
    try:
        return constraints.parse(text), None
    except ValueError as exc:
        return None, f"output is not a complete JSON value (a stop string cut it?): {exc}"


def _earliest(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None
