"""Interactive rows in the engine (worker/engine/admission.py, batcher.py): one goes before
every waiting bulk row and past a full batch at the next step, streams its text as it is
decoded (adding up to its final text), and leaves the batch within one step of a cancel.

The rule by itself, then the real engine with the tiny model at a fixed limit of 4 rows:
a 40-item bulk job fills the batch, and every output, the bulk rows' and the interactive
row's, equals its output without the other."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engine_rig import Rig
from vlmq.worker.engine.admission import (
    INTERACTIVE_RECENT_S,
    INTERACTIVE_ROWS,
    Waiting,
    admits,
    bulk_prefill_rows,
    express_rows,
)
from vlmq.worker.engine.batcher import Finished, Request, Streamed
from vlmq.worker.item_order import SHARE_RANKS

BIG, CHAT_TOKENS, BIG_TOKENS, ROWS = 40, 24, 24, 4
# The longest an interactive row may wait for a row of the batch: the step the engine
# was running when it was submitted.
WAIT_STEPS = 1


def test_an_interactive_row_passes_the_limit_and_the_express_rows_within_the_kv_budget(
        ) -> None:
    limit = 16
    top = limit + express_rows(limit) + INTERACTIVE_ROWS
    room = {"limit": limit, "capacity": 100, "kv_in_flight": 1_000, "kv_budget": 100_000}
    chat = Waiting(job_left=0, kv_cost=300, biggest_live=40, interactive=True)
    bulk = Waiting(job_left=40, kv_cost=300, biggest_live=40)
    assert not admits(bulk, live=limit, **room)
    assert admits(chat, live=limit, **room)
    assert admits(chat, live=top - 1, **room)
    assert not admits(chat, live=top, **room)  # its own rows are full too
    assert not admits(chat, live=limit, limit=limit, capacity=limit, kv_in_flight=0,
                      kv_budget=10**6)  # the generator's capacity binds
    assert not admits(chat, live=limit, limit=limit, capacity=100, kv_in_flight=99_800,
                      kv_budget=100_000)  # and so does the KV budget


def test_bulk_rows_go_in_one_at_a_time_while_a_person_is_on_the_machine() -> None:
    apart = bulk_prefill_rows(8, last_interactive=None, now=1_000.0)
    assert apart > 1
    assert bulk_prefill_rows(8, last_interactive=1_000.0, now=1_000.0) == 1
    assert bulk_prefill_rows(8, last_interactive=1_000.0,
                             now=1_000.0 + INTERACTIVE_RECENT_S - 0.1) == 1
    assert bulk_prefill_rows(8, last_interactive=1_000.0,
                             now=1_000.0 + INTERACTIVE_RECENT_S) == apart
    # The one before still waits for its first token: none yet.
    assert bulk_prefill_rows(8, last_interactive=1_000.0, now=1_000.0,
                             prompts_in_flight=1) == 0
    # An interactive row in the batch still waiting for its first token: none.
    assert bulk_prefill_rows(8, last_interactive=1_000.0, now=1_000.0,
                             first_token_due=True) == 0


@pytest.fixture(scope="module")
def rig(tiny_model: Path) -> Iterator[Rig]:
    r = Rig(tiny_model, ROWS)
    yield r
    r.close()


def _chat(rig: Rig, *, stream: bool, max_tokens: int = CHAT_TOKENS) -> Request:
    # An image the tiny model answers at length (no end token in its first 300).
    r = rig.request(("chat", 0), 6, None, max_tokens=max_tokens)
    # A worse priority than the bulk rows': only `interactive` puts it first.
    r.priority, r.job_left = BIG * BIG * SHARE_RANKS, 0
    r.interactive, r.stream = True, stream
    return r


class _Outputs:
    """What the engine reported, gathered: finished rows by key, streamed pieces in order."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.got: dict[object, Finished] = {}
        self.streamed: list[Streamed] = []

    def poll(self, timeout: float = 0.1) -> None:
        for out in self.rig.engine.get_output(timeout=timeout):
            if isinstance(out, Streamed):
                self.streamed.append(out)
            else:
                self.got[out.key] = out

    def until(self, n: int) -> dict[object, Finished]:
        for _ in range(6000):
            if len(self.got) >= n:
                break
            self.poll()
        assert len(self.got) == n, f"{len(self.got)}/{n} came back"
        return self.got


def _collect(rig: Rig, n: int) -> tuple[dict[object, Finished], list[Streamed]]:
    seen = _Outputs(rig)
    return seen.until(n), seen.streamed


def _fill(rig: Rig) -> None:
    for r in rig.big_job(BIG, BIG_TOKENS):
        rig.engine.submit(r)
    for _ in range(3000):  # until the bulk job fills the batch
        if rig.engine.state.active >= ROWS:
            return
        time.sleep(0.01)
    raise AssertionError("the bulk job never filled the batch")


def test_an_interactive_row_starts_at_the_next_step_beside_a_full_batch_and_streams(
        rig: Rig) -> None:
    alone, alone_streamed = _collect_one(rig, _chat(rig, stream=False))
    assert not alone_streamed  # a row that did not ask streams nothing
    without, _ = _run(rig, rig.big_job(BIG, BIG_TOKENS))
    _fill(rig)
    rig.engine.submit(_chat(rig, stream=True))
    got, streamed = _collect(rig, BIG + 1)
    chat = got[("chat", 0)]
    waited = chat.admitted_step - chat.seen_step
    assert waited <= WAIT_STEPS, f"the interactive row waited {waited} steps for a row"
    assert chat.tokens == alone.tokens  # batched beside the bulk rows, same tokens
    for i in range(BIG):
        assert got[("big", i)].tokens == without[("big", i)].tokens, i
    # The streamed pieces: whole characters, at most one per step, the start of the text.
    pieces = [s.text for s in streamed if s.key == ("chat", 0)]
    assert len(pieces) >= 2 and all(p and not p.endswith("\ufffd") for p in pieces)
    assert len(pieces) <= len(chat.tokens)
    sent = "".join(pieces)
    assert chat.text.startswith(sent) and chat.streamed == len(sent)


def test_an_interactive_rows_prefill_waits_for_no_bulk_prompt(rig: Rig) -> None:
    """Submitted together with a chunk of bulk rows: the interactive row's turn admits it
    alone, and the bulk rows follow one at a time (a person is on the machine)."""
    bulk = rig.big_job(ROWS, BIG_TOKENS)
    chat = _chat(rig, stream=True)
    got, _ = _run(rig, [chat, *bulk])
    steps = [got[r.key].admitted_step for r in bulk]
    # No bulk row goes in until the interactive row has its first token (its step is
    # the one its first token came in, at the earliest the step after its admission).
    assert min(steps) > got[chat.key].admitted_step
    assert len(set(steps)) == len(steps), f"bulk rows admitted together: steps {steps}"
    # Each once the one before it has its first token.
    firsts = sorted(got[r.key].first_step for r in bulk)
    assert all(a >= f for a, f in zip(sorted(steps)[1:], firsts, strict=False)), (steps, firsts)


def _run(rig: Rig, reqs: list[Request]) -> tuple[dict[object, Finished], list[Streamed]]:
    for r in reqs:
        rig.engine.submit(r)
    return _collect(rig, len(reqs))


def _collect_one(rig: Rig, req: Request) -> tuple[Finished, list[Streamed]]:
    got, streamed = _run(rig, [req])
    return got[req.key], streamed


def test_a_cancelled_interactive_row_leaves_within_one_step_and_the_bulk_goes_on(
        rig: Rig) -> None:
    without, _ = _run(rig, rig.big_job(BIG, BIG_TOKENS))
    _fill(rig)
    rig.engine.submit(_chat(rig, stream=True, max_tokens=400))
    seen = _Outputs(rig)
    for _ in range(3000):  # until it has decoded something
        if seen.streamed:
            break
        seen.poll(0.01)
    assert seen.streamed and ("chat", 0) not in seen.got
    steps_at_cancel = rig.engine.state.steps
    rig.engine.cancel([("chat", 0)])
    got = seen.until(BIG + 1)
    chat = got[("chat", 0)]
    assert chat.finish_reason == "cancelled"
    # One token per step while it was in the batch: at most one step ran after the cancel.
    assert len(chat.tokens) <= steps_at_cancel - chat.admitted_step + 1
    for i in range(BIG):
        assert got[("big", i)].tokens == without[("big", i)].tokens, i
    assert rig.engine.state.cancelled >= 1
