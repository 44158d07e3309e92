"""Which waiting row the batch takes next, and when the batch is full for it.

The batch runs at the row limit the sizer measures (batch_size.py: the knee of tokens/s),
which serves throughput. A row frees only when one finishes, so a small job arriving at
a full batch would wait for a big job's row to end, which may be a whole max_tokens of
steps. Rows beyond the limit are therefore kept for small jobs: a waiting row whose job
has at most `express_rows(limit)` items left (the whole job fits there), fewer than the
biggest job in the batch, is admitted up to `limit + express_rows(limit)` rows, so it
starts decoding at the next turn, whatever is already in the batch. A batch of one-item
jobs (a backlog of them) keeps no express row for one more: it would only make every
step slower, and the next free row goes to the best priority anyway. Bigger jobs wait
for the limit; the KV budget binds everyone (a small job over it waits like any other
row), and the generator's own capacity is the last bound.

The reserve is a quarter of the limit (at least one row): the batch runs at most 25 %
over its knee, and only while small jobs are in it, which costs the big jobs a few per
cent of their rate for that time (the knee is where more rows stop paying, not where
they start to cost). Which row waits first is the worker's priority (its job's items
left, then its batch's items out), so the express rows go to the smallest jobs.

Interactive rows (a person or an app waits on each token) go before every waiting bulk
row, and past both the limit and the express rows, into INTERACTIVE_ROWS more: a full
batch never makes them wait for a bulk row to end. Only the KV budget holds them back
(a bulk batch that has the budget makes them wait; the budget is what memory allows).

mlx-vlm's generator decodes the batch first at every turn, then does one prefill phase
(a prompt step, or sampling the first tokens) for one prefill batch of prompts, taken in
the order they were inserted. So a new row's first token takes two turns or more, and a
row inserted behind other prompts waits for all of them, whatever its priority: at most
two prefill batches of rows wait there for their first token (one prefilling, one
queued), so that the priority still orders what comes after.

Rows prefill in chunks of up to the prefill batch a turn: filling an empty batch so is
15 % faster on the bench model than a row a turn (the rows already in decode at a small
batch meanwhile). But an interactive request that arrives then waits for the chunk's
towers (0.1 s a 448 px page on 2 CPU cores) and behind its prompts. So while a person is
on the machine (an interactive row waiting or in the batch, or one admitted in the last
INTERACTIVE_RECENT_S), bulk rows go in one at a time, each once the one before has its
first token; and from the turn that admits an interactive row until its first token, no
bulk row goes in. In-process at 16 rows, an interactive row's time to first token under
a bulk load had p95 2.06 s with chunks of eight, 0.56 s with one bulk row a turn and
0.47 s one at a time (0.20 s idle), with the bulk at 322, 332 and 338 tokens/s: in a
full batch rows end one at a time and refill one at a time anyway, so this costs the
bulk only while a batch fills.
"""

from __future__ import annotations

from dataclasses import dataclass

EXPRESS_SHARE = 4  # the express rows are the limit over this, at least one
# Rows kept for interactive requests past the limit and the express rows: a handful of
# people asking at once; more wait for one of them to end (or for a bulk row's).
INTERACTIVE_ROWS = 8


# How long interactive traffic counts as present after its last request: a person reading
# an answer and asking the next question.
INTERACTIVE_RECENT_S = 60.0


def bulk_prefill_rows(prefill_batch: int, *, last_interactive: float | None, now: float,
                      first_token_due: bool = False, prompts_in_flight: int = 0) -> int:
    """Bulk rows one turn may admit: up to two prefill batches in the generator's hands
    (`prompts_in_flight`: rows admitted with no first token yet), one prefilling and one
    queued, and at most the prefill batch a turn (the caller's bound). While a person is
    on the machine (`last_interactive`: when an interactive row was last waiting or
    live), one row at a time: one, once no admitted row waits for its first token. None
    while an interactive row in the batch has not had its first token
    (`first_token_due`)."""
    if first_token_due:
        return 0
    if last_interactive is not None and now - last_interactive < INTERACTIVE_RECENT_S:
        return 0 if prompts_in_flight else 1
    return max(0, 2 * prefill_batch - prompts_in_flight)


def express_rows(limit: int) -> int:
    """Rows beyond the limit kept for small jobs."""
    return max(1, limit // EXPRESS_SHARE)


@dataclass(frozen=True)
class Waiting:
    """What admission needs to know of the next waiting row."""

    job_left: int  # its job's items left when it was submitted; 0 when not known
    kv_cost: int   # prompt + max new tokens
    biggest_live: int = 0  # the most items left of any job with a row in the batch
    interactive: bool = False  # an interactive request's row


def admits(row: Waiting, *, live: int, limit: int, capacity: int, kv_in_flight: int,
           kv_budget: int) -> bool:
    """Whether `row` joins the batch now (one over the whole KV budget runs alone)."""
    if live and kv_in_flight + row.kv_cost > kv_budget:
        return False
    if live < limit:
        return True
    reserve = express_rows(limit)
    if row.interactive:
        return live < min(limit + reserve + INTERACTIVE_ROWS, capacity)
    return (0 < row.job_left <= reserve and row.job_left < row.biggest_live
            and live < min(limit + reserve, capacity))
