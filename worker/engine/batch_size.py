"""The batch's row limit, chosen by measured throughput rather than a constant.

On these CPUs (and on Metal) the batch keeps paying well past 8 rows on some work and not
on other: OCR pages at 448 px gained x1.28 at 16 rows and x1.37 at 32 over 8. A fixed
default is wrong for one of them, and a user who does not tune gets it. So the engine
measures tokens/s at the current limit and doubles the limit until a doubling reads
more than `loss` below the best limit before it, the knee: it goes back there. A
doubling that reads about the same is kept and doubled again. Readings in a worker whose
prep threads share the cores swing by 10 % between windows, in either order (16 rows
read 6 % under 8 in one run and 25 % over in the next), while whole runs on the bench
model made 20-45 % more tokens/s at 32 rows than at 16 and 8: in the noise, the bigger
limit is the better bet, and only a clear loss is believed.

What it reads is the turns that only decode, once the batch has filled to the limit. A
row's prefill costs the same at any limit, so over a row's life a limit's tokens/s is
1 / (step time / rows + prefill per row / new tokens per row), and only the first term
moves with the limit: decoding tokens/s decides. Readings over every turn (prefills
included) were charged the new limit's own fill in their first second, and with rows of
equal length, a whole wave of refills at once: they read 16 and 32 rows at a fifth of 8
and held the batch at 8 (D/E 0.80 on the defaults benchmark). The turn after a prefill is
left out too: MLX evaluates lazily, and part of a prefill's cost lands there.

It doubles only when the rows in the batch and waiting for it could fill the next
limit: a limit the work cannot fill can never be measured, and while it stands every
waiting row goes in at once, past the knee, so a small job arriving then shares the step
with all of them; it is held instead, and looked at again after SHORT_HOLD_S. It
measures again after `hold_s`, and from the start whenever the shape of the work changes
(prompt length, new tokens, constrained rows), since the knee moves with it.
`--max-batch` is the cap; the KV admission budget still bounds memory on its own.

It never goes below `floor` (8, or the cap when lower): measurements at
a limit the work cannot fill say nothing, and a noisy reading must not shrink a batch
that a fixed setting would have kept. Pure logic on an injected clock, so the rule is
tested without a model (tests/worker/engine/test_batch_size.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_CAP = 64  # --max-batch's default: the most rows the batch may grow to
# Where it starts, and the least it holds at. Starting at 16 measured no faster on OCR
# work here (D/E 1.17-1.20 against 1.12-1.23) and served small jobs later (p95 27-28 s
# against 13-25 s): a small batch early lets the smallest jobs through first.
FLOOR = 8
LOSS = 0.15  # a doubling that reads this much below the limit before it is undone
# Seconds of decoding one reading takes at least: a doubling also doubles the prep
# window, and a shorter reading caught its burst on the shared cores (32 rows read 20 %
# under 16 in a worker, 18 % over in-process).
WINDOW_S = 3.0
MIN_STEPS = 8  # ... and at least this many steps
HOLD_S = 120.0  # at the knee this long, then measured again
SHAPE_SETTLE = 3  # windows a new shape of work must last before the knee is sought again
# Held below a doubling that the work in hand could not fill, then looked at again.
SHORT_HOLD_S = 10.0
# A reading starts once the rows a new limit let in have their first tokens, or after this.
SETTLE_MAX_S = 5.0


@dataclass(frozen=True)
class Shape:
    """What moves the knee: the rows' prompt and new-token sizes (as powers of two) and
    whether most are constrained."""

    prompt: int
    new_tokens: int
    constrained: bool

    @classmethod
    def of(cls, prompts: list[int], new_tokens: list[int], constrained: int) -> Shape:
        n = max(1, len(prompts))
        return cls(_log2(sum(prompts) / n), _log2(sum(new_tokens) / n), 2 * constrained > n)


def _log2(x: float) -> int:
    return int(math.log2(x)) if x >= 1 else 0


class BatchSizer:
    """See the module docstring. Only the engine's MLX thread calls it."""

    def __init__(self, cap: int, *, floor: int = FLOOR, loss: float = LOSS,
                 window_s: float = WINDOW_S, min_steps: int = MIN_STEPS,
                 hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic) -> None:
        if cap < 1:
            raise ValueError(f"the batch cap must be at least 1, got {cap}")
        self.cap = cap
        self.floor = max(1, min(floor, cap))
        self.loss, self.window_s, self.min_steps, self.hold_s = loss, window_s, min_steps, hold_s
        self.clock = clock
        self.limit = self.floor
        self.readings: dict[int, float] = {}  # limit -> tokens/s measured there (this shape)
        self.shape: Shape | None = None
        self.held_until: float | None = None  # measuring when None
        self.reason = (f"starting at {self.limit} rows (cap {cap})" if self.limit < cap
                       else f"fixed at the cap of {cap} rows")
        self._tokens = 0
        self._seconds = 0.0
        self._steps = 0
        self._candidate: tuple[Shape, float] | None = None  # a new shape, since when
        self._work = 0  # rows in the batch and waiting, at the last turn
        # A limit just set, not read until the batch has filled to it (since when).
        self._settling = True
        self._settle_start: float | None = None
        self._after_prefill = False  # the last turn prefilled: the next is not read

    def observe(self, rows: int, tokens: int, seconds: float, shape: Shape,
                waiting: int = 0, prefill: bool = False) -> bool:
        """One turn of the engine: `rows` in the batch, `tokens` it produced in
        `seconds`, `waiting` rows submitted and not yet in it, `prefill` whether it
        admitted rows or had rows with no first token yet. True when the limit changed
        (the engine logs `reason`)."""
        self._work = rows + waiting
        if self.limit == self.cap == self.floor:
            return False  # nothing to choose
        if self._shape_changed(shape):
            return self._restart(f"the work changed ({_describe(shape)})")
        if self.held_until is not None:
            if self.clock() < self.held_until:
                return False
            self.held_until = None  # measure the knee again
            self.readings.pop(self.limit, None)
        if rows + waiting < self.limit:
            return False  # the work in hand cannot fill it: says nothing about this limit
        if not self._settled(rows):
            return False
        if prefill or self._after_prefill:
            self._after_prefill = prefill  # the turn after a prefill carries part of it
            return False
        self._tokens += tokens
        self._seconds += seconds
        self._steps += 1
        if self._seconds < self.window_s or self._steps < self.min_steps:
            return False
        return self._judge(self._tokens / self._seconds if self._seconds > 0 else 0.0)

    def _settled(self, rows: int) -> bool:
        """Whether the batch has filled to a limit just set: the rows it let in prefill
        in the first turns after the change (eight 448 px pages: 1.2 s here), and a
        reading that began then would charge that whole fill to the new limit, one that
        its rows then pay back over their lives at any limit alike. Readings of 16 and 32
        rows that did so came out at a fifth of 8 rows' and held the batch at 8. Turns
        with rows still prefilling are prefill turns, left out below."""
        if not self._settling:
            return True
        now = self.clock()
        if self._settle_start is None:
            self._settle_start = now
        if rows >= self.limit or now - self._settle_start >= SETTLE_MAX_S:
            self._settling, self._settle_start = False, None
            return True
        return False

    def _shape_changed(self, shape: Shape) -> bool:
        """True once a new shape has lasted SHAPE_SETTLE windows: rows of mixed jobs come
        and go, and the knee is measured again only when the mix has really moved."""
        if self.shape is None:
            self.shape = shape
        if shape == self.shape:
            self._candidate = None
            return False
        now = self.clock()
        if self._candidate is None or self._candidate[0] != shape:
            self._candidate = (shape, now)
            return False
        if now - self._candidate[1] < SHAPE_SETTLE * self.window_s:
            return False
        self.shape, self._candidate = shape, None
        return True

    def _judge(self, tok_s: float) -> bool:
        """A reading at the current limit is complete: go up, stay, or go back."""
        self._reset_window()
        limit = self.limit
        self.readings[limit] = tok_s
        below = [k for k in self.readings if k < limit]
        if below:
            best = max(below, key=self.readings.__getitem__)  # a slow drift adds up too
            if tok_s < self.readings[best] * (1 - self.loss):
                return self._hold(best, f"{limit} rows gave {tok_s:.0f} tok/s against "
                                        f"{self.readings[best]:.0f} at {best}: the knee")
        if limit >= self.cap:
            return self._hold(limit, f"{tok_s:.0f} tok/s at the cap of {self.cap} rows")
        nxt = min(self.cap, 2 * limit)
        if self._work < nxt:
            self.limit = limit
            self.held_until = self.clock() + SHORT_HOLD_S
            self.reason = (f"holding at {limit} rows ({tok_s:.0f} tok/s): {self._work} rows "
                           f"in hand cannot fill {nxt}")
            return False
        self.limit = nxt
        self._settle()
        self.reason = f"{tok_s:.0f} tok/s at {limit} rows: trying {nxt}"
        return True

    def _hold(self, limit: int, why: str) -> bool:
        changed = limit != self.limit
        if changed:
            self._settle()
        self.limit = limit
        self.held_until = self.clock() + self.hold_s
        self.reason = f"holding at {limit} rows: {why}"
        return changed

    def _restart(self, why: str) -> bool:
        changed = self.limit != self.floor
        self.readings.clear()
        self.held_until = None
        self._reset_window()
        if changed:
            self._settle()
        self.limit = self.floor
        self.reason = f"measuring again from {self.floor} rows: {why}"
        return changed

    def _settle(self) -> None:
        self._settling, self._settle_start = True, None

    def _reset_window(self) -> None:
        self._tokens, self._seconds, self._steps = 0, 0.0, 0


def _describe(shape: Shape) -> str:
    return (f"prompts ~{2 ** shape.prompt} tokens, ~{2 ** shape.new_tokens} new tokens"
            + (", constrained" if shape.constrained else ""))
