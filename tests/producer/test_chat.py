"""Client.chat without a model: the request as enqueued, and the stream follower against
token streams written here as a worker writes them (shared/chat.py's encode).

A fake worker is a member of RQ's `rq:workers:chat` set, which is all Client.serving
reads; the e2e tests (tests/e2e/test_chat_e2e.py) run the real one.
"""

from __future__ import annotations

import base64
import threading
import time
from pathlib import Path

import pytest
from redis import Redis

from tests.support.helpers import make_images
from vlmq.producer import chat
from vlmq.producer.client import Client
from vlmq.shared.chat import CHAT_QUEUE, Delta, End, encode
from vlmq.shared.errors import InputError, PayloadError
from vlmq.shared.keys import Keys


def _serve(redis: Redis, name: str = "fake") -> None:
    """A live worker as a follower sees one: on RQ's list of the queue's workers, with
    its stats published."""
    redis.sadd(Keys.rq_queue_workers(CHAT_QUEUE), Keys.rq_worker(name))
    redis.hset(Keys().worker_stats(name), "model", "fake")


def _write(client: Client, job_id: str, *entries: Delta | End) -> None:
    for entry in entries:
        client.redis.xadd(client.keys.job_tokens(job_id), encode(entry))


@pytest.fixture
def client(redis_url: str) -> Client:
    c = Client(redis_url)
    yield c  # type: ignore[misc]
    c.close()


def test_no_worker_is_refused_at_once_and_nothing_is_enqueued(client: Client,
                                                              redis: Redis) -> None:
    t0 = time.monotonic()
    with pytest.raises(chat.NoWorker, match="no live worker serves queue 'chat'"):
        client.chat("What is this?")
    assert time.monotonic() - t0 < 1.0
    assert not redis.exists(Keys.rq_queue(CHAT_QUEUE))


def test_a_question_about_an_image_is_one_chat_job(client: Client, redis: Redis,
                                                   tmp_path: Path) -> None:
    _serve(redis)
    image = make_images(tmp_path, 1)[0]
    stream = client.chat("What colour is it?", image=image, system="Be brief.",
                         max_tokens=8, temperature=0.5, stop=["\n\n"])
    job = stream.job
    assert job.queue == CHAT_QUEUE and job.task == "generate" and job.items == 1
    payload = job.payload()
    assert [i.kind for i in payload.items] == ["image"]
    settings = payload.settings
    assert [m.to_dict() for m in settings["messages"]] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What colour is it?", "image": True}]
    assert settings["stream"] is True and settings["result_cache"] == "off"
    assert settings["max_tokens"] == 8 and settings["temperature"] == 0.5
    assert tuple(settings["stop"]) == ("\n\n",)
    stream.close()
    assert job.status() == "canceled"  # closed before its answer ended


def test_a_schema_makes_an_extract_job_and_no_image_a_text_item(client: Client,
                                                                redis: Redis) -> None:
    _serve(redis)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    with client.chat("How many?", schema=schema) as stream:
        assert stream.job.task == "extract"
        payload = stream.job.payload()
        assert [i.kind for i in payload.items] == ["text"]
        assert payload.settings["schema"] == schema


def test_openai_messages_with_a_data_uri_and_two_turns(tmp_path: Path) -> None:
    png = make_images(tmp_path, 1)[0].read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    request = chat.chat_input([
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "Colour?"},
                                     {"type": "image_url", "image_url": {"url": uri}}]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "And the shape?"}])
    assert request.image == png
    assert [m.to_dict() for m in request.messages] == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Colour?", "image": True},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "And the shape?"}]


@pytest.mark.parametrize(("messages", "image", "problem"), [
    ([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     None, "one image per request"),
    ([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
     None, "http"),
    ([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}]}],
     None, "base64"),
    ([{"role": "tool", "content": "x"}], None, "role"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], None,
     "last message must be the user's"),
    ([{"role": "user", "content": [  # one in the messages, one as the image argument
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     b"\x89PNG", "one image per request"),
])
def test_what_cannot_be_asked_is_refused_naming_why(messages: object, image: bytes | None,
                                                    problem: str) -> None:
    with pytest.raises(PayloadError, match=problem):
        chat.chat_input(messages, image=image)  # type: ignore[arg-type]


def test_a_missing_image_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        chat.chat_input("What?", image=tmp_path / "nope.png")


def test_the_stream_yields_deltas_then_the_end(client: Client, redis: Redis) -> None:
    _serve(redis)
    stream = client.chat("Say hello.")
    _write(client, stream.id, Delta("Hel"), Delta("lo, é"), End("stop", 7, 3))
    assert list(stream) == ["Hel", "lo, é"]
    assert stream.text == "Hello, é" and stream.finish_reason == "stop"
    assert stream.usage is not None and stream.usage.to_dict() == {
        "prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    stream.close()  # after the end: nothing to cancel
    assert stream.job.status() == "queued"


def test_an_end_with_an_error_raises_naming_it(client: Client, redis: Redis) -> None:
    _serve(redis)
    stream = client.chat("Say hello.")
    _write(client, stream.id, Delta("He"), End("error", error="the image could not "
                                                                    "be decoded"))
    with pytest.raises(chat.ChatError, match="the image could not be decoded"):
        stream.result()
    assert stream.text == "He" and stream.finish_reason == "error"


def test_leaving_mid_answer_cancels_the_request(client: Client, redis: Redis) -> None:
    _serve(redis)
    stream = client.chat("Say hello.")
    _write(client, stream.id, Delta("He"))
    with stream:
        for delta in stream:
            assert delta == "He"
            break
    assert stream.job.status() == "canceled" and stream.finish_reason == "cancelled"


@pytest.mark.parametrize("gone", ["unregistered", "killed"])
def test_a_queued_request_whose_worker_went_away_is_an_error(client: Client, redis: Redis,
                                                             gone: str) -> None:
    _serve(redis)
    job = client.chat("Say hello.").job
    if gone == "unregistered":
        redis.delete(Keys.rq_queue_workers(CHAT_QUEUE))
    else:  # RQ still lists it, but its stats expired: nothing publishes them
        redis.delete(Keys().worker_stats("fake"))
    stream = chat.ChatStream(client, job, look_s=0.1, unserved_grace_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(chat.NoWorker, match="any more"):
        stream.result()
    assert 0.5 <= time.monotonic() - t0 < 5
    assert job.status() == "canceled"


def test_a_worker_that_publishes_late_is_waited_for(client: Client, redis: Redis) -> None:
    _serve(redis)
    job = client.chat("Say hello.").job
    redis.delete(Keys().worker_stats("fake"))  # registered with RQ, first stats not out yet
    stream = chat.ChatStream(client, job, look_s=0.1, unserved_grace_s=1.0)
    later = [threading.Timer(0.5, _serve, (redis,)),
             threading.Timer(1.5, _write, (client, job.id, Delta("Hi"), End("stop", 1, 1)))]
    for timer in later:
        timer.start()
    assert stream.result() == "Hi"  # 1.5 s queued, never 1.0 s without a live worker
    for timer in later:
        timer.join()


def test_a_worker_that_died_mid_answer_ends_the_stream_with_an_error(
        client: Client, redis: Redis) -> None:
    _serve(redis)
    stream = client.chat("Say hello.")
    # What a worker killed mid-answer leaves: the job started, its owner key, and its
    # execution in the started registry past its heartbeat (RQ's own test of death).
    redis.lrem(Keys.rq_queue(CHAT_QUEUE), 0, stream.id)
    redis.hset(Keys.rq_job(stream.id), "status", "started")
    redis.set(client.keys.job_owner(stream.id), "exec1 w1")
    redis.hset(Keys.rq_worker("w1"), "state", "busy")
    now = float(redis.time()[0])
    redis.zadd(Keys.rq_registry("started", CHAT_QUEUE), {f"{stream.id}:exec1": now - 5})
    _write(client, stream.id, Delta("He"))
    t0 = time.monotonic()
    with pytest.raises(chat.ChatError, match="died mid-answer"):
        stream.result()
    assert stream.text == "He" and time.monotonic() - t0 < 5


def test_a_timeout_cancels_and_says_so(client: Client, redis: Redis) -> None:
    _serve(redis)
    stream = client.chat("Say hello.", timeout=0.3)
    with pytest.raises(chat.ChatTimeout, match=r"within 0\.3s"):
        stream.result()
    assert stream.job.status() == "canceled"
