"""Interactive requests through a real worker (shared/chat.py, PROTOCOL.md section 3b): a
chat job's answer streams to its token stream as it is decoded and adds up to the item's
text, the same text as the request run without streaming; one sent while a bulk job fills
the batch does not wait for a bulk row to end, and the bulk job's output is unchanged; a
cancel ends its stream at once; a raw chat job with malformed messages fails alone."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.helpers import finished_results, make_images, raw_enqueue, wait_for
from vlmq.producer.client import Client, Job
from vlmq.producer.options import JobOptions
from vlmq.shared import chat
from vlmq.shared.keys import Keys

pytestmark = pytest.mark.slow

ROWS = 4
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is in this picture?", "image": True},
    {"role": "assistant", "content": "Shapes."},
    {"role": "user", "content": "Which colours?"},
]


@pytest.fixture(scope="module")
def served(module_redis_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Path]]:
    """One worker serving chat before the bulk queue, at a fixed batch of ROWS rows."""
    tmp = tmp_path_factory.mktemp("chat-worker")
    proc = helpers.start_worker(module_redis_url, tiny_model, tmp, "--queues", "chat,bulk",
                                "--max-batch", str(ROWS), "--fixed-batch", name="chat1")
    out = helpers.Output(proc)
    started: list[subprocess.Popen[str]] = [proc]
    try:
        out.wait_for("ready", timeout=300)
        yield module_redis_url, tmp
    finally:
        helpers.stop_all(started)


def _chat(client: Client, image: Path, *, stream: bool, max_tokens: int = 24,
          messages: list[dict[str, Any]] | None = None, result_cache: str = "off") -> Job:
    return client.submit("generate", [image], JobOptions(
        messages=messages or CONVERSATION, stream=stream, temperature=0.0,
        max_tokens=max_tokens, result_cache=result_cache, queue=chat.CHAT_QUEUE))


def _read_stream(redis: Redis, job_id: str, timeout: float = 120
                 ) -> tuple[list[str], chat.End, float | None]:
    """The Delta texts and the End of a job's token stream, and when the first Delta came
    (monotonic), read as a client would (XREAD BLOCK from 0)."""
    key = Keys.from_env().job_tokens(job_id)
    last, deltas, first = "0", [], None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, entries in redis.xread({key: last}, block=200) or []:
            for entry_id, fields in entries:
                last = entry_id
                entry = chat.decode(fields)
                if isinstance(entry, chat.End):
                    return deltas, entry, first
                first = first if first is not None else time.monotonic()
                deltas.append(entry.text)
    raise AssertionError(f"no End in {job_id}'s token stream after {timeout} s: {deltas}")


def test_a_streamed_answer_adds_up_to_the_item_text_and_to_the_unstreamed_answer(
        served: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = served
    client, redis = Client(url), Redis.from_url(url)
    image = make_images(tmp_path / "img", 1)[0]
    streamed = _chat(client, image, stream=True)
    deltas, end, _ = _read_stream(redis, streamed.id)
    (res,) = finished_results(client, streamed.id)
    assert res.ok and res.text and "".join(deltas) == res.text
    assert len(deltas) >= 2, deltas  # as decoded, not in one piece at the end
    assert end.finish_reason in ("stop", "length") and end.error is None
    assert (end.prompt_tokens, end.completion_tokens) == (res.prompt_tokens,
                                                          res.completion_tokens)
    plain = _chat(client, image, stream=False)
    (again,) = finished_results(client, plain.id)
    assert again.text == res.text and again.completion_tokens == res.completion_tokens
    assert not redis.exists(Keys.from_env().job_tokens(plain.id))
    # The stream outlives its End by a minute only.
    assert 0 < redis.ttl(Keys.from_env().job_tokens(streamed.id)) <= chat.TOKEN_STREAM_TTL_S


def _bulk(client: Client, images: list[Path], max_tokens: int = 64) -> Job:
    return client.submit("caption", images, JobOptions(
        max_tokens=max_tokens, temperature=0.0, result_cache="off", queue="bulk"))


def test_a_chat_job_sent_while_a_bulk_job_fills_the_batch_does_not_wait_for_a_bulk_row(
        served: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = served
    client = Client(url)
    images = make_images(tmp_path / "bulk", 40)
    alone = [r.text for r in finished_results(client, _bulk(client, images, 200).id)]
    bulk = _bulk(client, images, 200)
    wait_for(lambda: client.job(bulk.id).status() == "started", 60, "the bulk job to start")
    asked = _chat(client, images[0], stream=True, max_tokens=8)
    _read_stream(Redis.from_url(url), asked.id)
    (answer,) = finished_results(client, asked.id)
    assert client.job(bulk.id).status() == "started", "the bulk job ended first"
    rows = finished_results(client, bulk.id)
    # The bound: it waited for a row less than any bulk row took from its first token
    # to its last (a row past the batch's limit is kept for it).
    shortest_bulk_row = min(r.timings["generate_s"] for r in rows)
    waited = answer.timings.get("queue_s", 0.0)  # a stored result leaves out a 0 (< 1 ms)
    assert "prefill_s" in answer.timings and waited < shortest_bulk_row, (answer.timings,
                                                                          shortest_bulk_row)
    assert [r.text for r in rows] == alone  # the bulk output, token for token


def test_a_chat_job_is_taken_at_once_when_bulk_jobs_fill_the_workers_window(
        served: tuple[str, Path], tmp_path: Path) -> None:
    """The window is max(4, the batch's rows) jobs: one-item bulk jobs that each decode
    to max_tokens fill it twice over, and the chat job starts before any of them ends."""
    url, _ = served
    client, redis = Client(url), Redis.from_url(url)
    images = make_images(tmp_path / "bulk", 24)
    # The images the tiny model captions at full length (no early end token).
    tried = finished_results(client, _bulk(client, images, 96).id)
    long = [images[r.index] for r in tried if r.finish_reason == "length"][:2 * ROWS]
    assert len(long) == 2 * ROWS, [r.finish_reason for r in tried]
    bulk = [_bulk(client, [image], 96) for image in long]
    wait_for(lambda: sum(client.job(j.id).status() == "started" for j in bulk) == ROWS, 60,
             "the bulk jobs to fill the window")
    asked = _chat(client, images[0], stream=False, max_tokens=8)
    assert finished_results(client, asked.id)[0].ok
    for job in bulk:
        assert finished_results(client, job.id)[0].ok
    chat_started = _time(redis, asked.id, "started_at")
    assert chat_started < min(_time(redis, j.id, "ended_at") for j in bulk), (
        "the chat job waited for a bulk job to end")


def _time(redis: Redis, job_id: str, field: str) -> str:
    """An RQ timestamp of the job (ISO text, so ordered as text)."""
    raw = redis.hget(Keys.rq_job(job_id), field)
    assert raw, (job_id, field)
    return raw.decode()


def test_a_streamed_answer_from_the_result_cache_still_streams_whole(
        served: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = served
    client, redis = Client(url), Redis.from_url(url)
    image = make_images(tmp_path / "img", 1)[0]
    first = _chat(client, image, stream=True, max_tokens=12, result_cache="on")
    _read_stream(redis, first.id)
    (made,) = finished_results(client, first.id)
    again = _chat(client, image, stream=True, max_tokens=12, result_cache="on")
    deltas, end, _ = _read_stream(redis, again.id)
    (hit,) = finished_results(client, again.id)
    assert hit.result_cache_hit and hit.text == made.text == "".join(deltas)
    assert end.finish_reason in ("stop", "length")


def test_a_cancelled_chat_job_ends_its_stream_at_once_and_the_worker_goes_on(
        served: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = served
    client, redis = Client(url), Redis.from_url(url)
    image = make_images(tmp_path / "img", 1)[0]
    # The tiny model ends a free answer within a second: a schema with a long string
    # keeps this one decoding for seconds, so the cancel never races its end.
    long = client.submit("extract", [image], JobOptions(
        messages=CONVERSATION, stream=True, temperature=0.0, max_tokens=4000,
        schema={"type": "object", "properties": {"t": {"type": "string", "minLength": 3000}},
                "required": ["t"]},
        result_cache="off", queue=chat.CHAT_QUEUE))
    key = Keys.from_env().job_tokens(long.id)
    wait_for(lambda: redis.xlen(key) > 0, 120, "its first delta")
    t0 = time.monotonic()
    client.cancel(long.id)
    deltas, end, _ = _read_stream(redis, long.id, timeout=30)
    assert end.finish_reason == "cancelled", (end, deltas)
    assert time.monotonic() - t0 < 5.0
    assert client.job(long.id).status() == "canceled"
    after = _chat(client, image, stream=False, max_tokens=4)
    assert finished_results(client, after.id)[0].ok


def test_a_raw_chat_job_with_malformed_messages_fails_alone(
        served: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = served
    client, redis = Client(url), Redis.from_url(url)
    image = make_images(tmp_path / "img", 1)[0]
    good = _chat(client, image, stream=False, max_tokens=4)
    blob = good.payload().items[0].blob
    base = {"v": 1, "task": "generate", "items": [{"kind": "image", "blob": blob,
                                                   "source": "a.png"}]}
    bad = [raw_enqueue(redis, {**base, "messages": messages}, queue=chat.CHAT_QUEUE)
           for messages in ([{"role": "bot", "content": "hi"}], "hi",
                            [{"role": "user", "content": "a", "image": True},
                             {"role": "assistant", "content": "b"}])]
    after = _chat(client, image, stream=False, max_tokens=4)
    for job_id in bad:
        job = client.job(job_id)
        assert job.wait(timeout=60) == "failed"
        assert "messages" in (job.error() or ""), job.error()
    assert finished_results(client, good.id)[0].ok
    assert finished_results(client, after.id)[0].ok


def test_a_streamed_chat_job_that_fails_as_a_whole_ends_its_stream_with_the_reason(
        served: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = served
    client, redis = Client(url), Redis.from_url(url)
    image = make_images(tmp_path / "img", 1)[0]
    other = client.submit("generate", [image], JobOptions(
        messages=CONVERSATION, stream=True, model="someone/other-model",
        queue=chat.CHAT_QUEUE))
    deltas, end, _ = _read_stream(redis, other.id, timeout=60)
    assert deltas == [] and end.finish_reason == "error"
    assert "someone/other-model" in (end.error or "")
    assert client.job(other.id).wait(timeout=30) == "failed"
