"""Shortest-remaining-job-first item order across jobs in flight."""

from __future__ import annotations

from collections import deque

from tests.support.factories import job_payload
from vlmq.worker.item_order import ItemOrder, JobState


def _state(job_id: str, n: int) -> JobState:
    payload = job_payload(n, task="caption", name="{}.png")
    return JobState(job_id=job_id, payload=payload, pending=deque(range(n)))


def test_the_job_with_fewest_items_left_goes_first_and_ties_keep_arrival_order() -> None:
    s: ItemOrder[JobState] = ItemOrder()
    s.add(_state("big-1", 40))
    s.add(_state("big-2", 40))
    order = [s.next_item() for _ in range(3)]
    assert [(st.job_id, i) for st, i in order] == [("big-1", 0), ("big-1", 1), ("big-1", 2)]
    s.add(_state("small", 2))  # arrives while the big ones run
    nxt = [s.next_item() for _ in range(2)]
    assert [(st.job_id, i) for st, i in nxt] == [("small", 0), ("small", 1)]
    assert s.item_returned("small", 0) is not None and s.item_returned("small", 1) is not None
    assert s.jobs["small"].complete
    s.remove("small")
    st, i = s.next_item()  # back to the big job that is furthest along
    assert (st.job_id, i) == ("big-1", 3)


def test_an_item_retried_after_a_transient_error_comes_back_first() -> None:
    s: ItemOrder[JobState] = ItemOrder()
    s.add(_state("a", 3))
    _, i = s.next_item()
    s.retry_item("a", i)
    assert s.next_item()[1] == i
    assert s.item_returned("a", 99) is None  # not outstanding: ignored
    assert s.item_returned("a", i) is not None
    assert s.item_returned("a", i) is None  # came back twice: the second copy is unwanted


def test_items_whose_results_vanished_are_scheduled_again_first() -> None:
    s: ItemOrder[JobState] = ItemOrder()
    s.add(_state("a", 4))
    for _ in range(4):
        _, i = s.next_item()
        s.item_returned("a", i)
    assert s.jobs["a"].complete
    s.redo("a", [3, 1])
    assert not s.jobs["a"].complete
    assert [s.next_item()[1], s.next_item()[1]] == [1, 3]


def test_a_small_job_is_prepared_past_a_full_window_and_a_big_one_is_not() -> None:
    s: ItemOrder[JobState] = ItemOrder()
    s.add(_state("big", 40))
    window, small = 8, 4
    assert s.next_item_within(window - 1, window, small) is not None  # room: anyone
    assert s.next_item_within(window, window, small) is None  # full: 39 left is not small
    s.add(_state("small", 3))
    taken = [s.next_item_within(window + k, window, small) for k in range(3)]
    assert [(st.job_id, i) for st, i in taken if st] == [("small", 0), ("small", 1),
                                                          ("small", 2)]
    assert s.next_item_within(window, window, small) is None  # only the big job is left
    s.remove("small")
    s.add(_state("tiny", 1))
    assert s.next_item_within(window + small, window, small) is None  # past the allowance


def _in_batch(job_id: str, n: int, batch: str) -> JobState:
    payload = job_payload(n, task="caption", name="{}.png", batch=batch)
    return JobState(job_id=job_id, payload=payload, pending=deque(range(n)))


def test_among_equal_jobs_the_batch_with_fewest_items_out_goes_first() -> None:
    """Fair turns carried into the batch: a one-item job of a batch with nothing out is
    prepared, and admitted, before the one-item jobs of a batch that holds rows already."""
    s: ItemOrder[JobState] = ItemOrder()
    for k in range(3):
        s.add(_in_batch(f"big-{k}", 1, "b-big"))
    st, _ = s.next_item()
    assert st.job_id == "big-0"
    s.add(_in_batch("small", 1, "b-small"))  # taken in its batch's turn, after the others
    nxt = s.next_item()
    assert nxt is not None and nxt[0].job_id == "small"
    assert s.next_item()[0].job_id == "big-1"  # b-big: 2 items out, b-small: 1
    # The engine's priority says the same: items left first, then the batch's items out.
    s.add(_in_batch("big-3", 1, "b-big"))
    s.add(_in_batch("small-2", 1, "b-small"))
    assert s.priority(s.jobs["small-2"]) < s.priority(s.jobs["big-3"])
    s.add(_in_batch("two", 2, "b-other"))
    assert s.priority(s.jobs["big-3"]) < s.priority(s.jobs["two"])  # fewer items left first


def test_an_interactive_job_is_prepared_first_whatever_the_window_holds() -> None:
    s: ItemOrder[JobState] = ItemOrder()
    s.add(_state("small", 1))
    s.add(_state("big", 40))
    chat = _state("chat", 1)
    chat.interactive = True
    s.add(chat)  # arrives last, with as few items left as the small job
    window, small = 8, 4
    assert s.best() is chat
    taken = s.next_item_within(window + small, window, small)  # the window is full
    assert taken is not None and taken[0] is chat
    assert s.next_item_within(window + small, window, small) is None  # bulk items wait
