"""Detect a decoding loop: the same block of tokens repeated at the end of a row.

OCR models loop (mlx-vlm#1021): one line repeated until max_tokens, which holds a
batch slot for thousands of tokens and returns garbage. The engine asks `find`
after each new token; when the tail is one block of up to `max_period` tokens
repeated enough times, the row is stopped (or retried once, hotter) and only the
text up to the end of the block's first copy is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ON_REPETITION = ("stop", "retry")


@dataclass(frozen=True)
class RepetitionGuard:
    """A tail counts as a loop when a block of p <= max_period tokens repeats at least
    max(min_repeats, ceil(min_span / p)) times: short blocks must cover min_span
    tokens, so a legitimate run (a dotted leader, a table rule) is not cut early."""

    max_period: int = 64
    min_repeats: int = 8
    min_span: int = 32
    on_repetition: str = "stop"
    retry_temperature: float = 0.7  # the one retry samples at this temperature

    def __post_init__(self) -> None:
        if self.max_period < 1 or self.min_repeats < 2 or self.min_span < 1:
            raise ValueError("repetition guard needs max_period >= 1, min_repeats >= 2, "
                             "min_span >= 1")
        if self.on_repetition not in ON_REPETITION:
            raise ValueError(f"on_repetition must be one of {ON_REPETITION}")

    def repeats_needed(self, period: int) -> int:
        return max(self.min_repeats, -(-self.min_span // period))

    def find(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(period, keep) if the tail loops, else None.

        `keep` is how many leading tokens to keep: everything before the looping
        region plus one copy of its block. The smallest period wins.
        """
        n = len(tokens)
        if n < 2:
            return None
        last = tokens[-1]
        for p in range(1, min(self.max_period, n // 2) + 1):
            if tokens[-1 - p] != last:
                continue
            span = p * self.repeats_needed(p)
            if span > n:
                continue
            tail = tokens[n - span:]
            if tail[p:] != tail[:-p]:
                continue
            start = n - span
            while start > 0 and tokens[start - 1] == tokens[start - 1 + p]:
                start -= 1
            return p, start + p
        return None
