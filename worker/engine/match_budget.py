"""How much schema matching one decode step may carry, over every constrained row together.

Each constrained row's mask is computed on the MLX thread's step, one row after another,
so every row in the batch waits for all of them. The per-row cut (constraints.py,
STEP_BUDGET_S) bounds one row; sixteen rows just under it cost sixteen times that, and an
unconstrained row beside them went 14-19x slower. So the matching of a step is held, in
total, to MATCH_SHARE times the model's own time for a step (measured: the step's time less
its matching), and never less than one constrained row: beside any number of constrained
rows an unconstrained row's step takes at most (1 + MATCH_SHARE) x its model time, or its
model time plus one row's matching (under the 20 ms cut) where that is more.

It is kept by admission and, when rows turn out costlier than they looked, by deferral:
- a constrained row is admitted while the rows in the batch and it fit the budget, or when
  no constrained row is in the batch; one that does not fit waits, and so do the
  constrained rows behind it (unconstrained rows go on being admitted), so it is never
  starved;
- while the rows in the batch cost over DEFER_OVER x the budget for DEFER_STEPS steps,
  the costliest rows (the newest among equals) leave the batch until the rest fit, and
  wait again; each restarts from its prompt later (greedy output is the same), and at
  least one constrained row always stays.
A row's cost is its own measured matching per step once it has run a step, else its
schema's (the last rows of that schema, or its first mask's build time). A schema no row
has run a step of gets one row until it has. While every row in the batch and waiting is
of one schema, nothing is held: those rows slow only each other, equally, and holding
them back would only cost their own throughput.
"""

from __future__ import annotations

from collections.abc import Sequence

# The matching of a step, over all its rows, may take this times the model's own time.
MATCH_SHARE = 1.0
# Deferral starts once the rows in the batch cost this much over the budget this many
# steps running (rows' costs are averages already, so one slow mask moves them little;
# every step over is a step an innocent row pays for).
DEFER_OVER = 1.5
DEFER_STEPS = 1
# Weight of the newest step in the model-time average.
EMA = 0.2


def ema(old: float | None, new: float, weight: float = EMA) -> float:
    return new if old is None else old + weight * (new - old)


class MatchBudget:
    """The per-step matching budget, from the model time of decode steps (MLX thread)."""

    def __init__(self, share: float = MATCH_SHARE) -> None:
        self.share = share
        self.model_s: float | None = None  # a decode step's model time, averaged
        self._over = 0  # decode steps running the batch has been over DEFER_OVER x budget

    @property
    def budget_s(self) -> float | None:
        """Seconds of matching a step may carry; None until a decode step was measured."""
        return None if self.model_s is None else self.share * self.model_s

    def observe(self, step_s: float, match_s: float) -> None:
        """A decode step took `step_s`, `match_s` of it matching."""
        self.model_s = ema(self.model_s, max(0.0, step_s - match_s))

    def admits(self, live: Sequence[float], cost: float) -> bool:
        """Whether a row costing `cost` a step may join rows costing `live`."""
        budget = self.budget_s
        if not live:
            return True  # one constrained row always runs
        return budget is not None and sum(live) + cost <= budget

    def defer(self, live: Sequence[float]) -> list[int]:
        """After a decode step: the indexes in `live` of the rows to defer now, costliest
        first and the last of equals first (callers list rows oldest first), until the
        rest fit the budget; at least one row stays."""
        budget = self.budget_s
        if budget is None or len(live) < 2 or sum(live) <= DEFER_OVER * budget:
            self._over = 0
            return []
        self._over += 1
        if self._over < DEFER_STEPS:
            return []
        self._over = 0
        out: list[int] = []
        left = sum(live)
        for i in sorted(range(len(live)), key=lambda k: (-live[k], -k)):
            if left <= budget or len(out) == len(live) - 1:
                break
            out.append(i)
            left -= live[i]
        return out
