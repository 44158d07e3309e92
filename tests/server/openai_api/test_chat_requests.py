"""`POST /v1/chat/completions` without a worker: how a request is read (messages, the one
image, the stream switches, response_format, the knobs vlmq cannot honour), what the
official SDK gets back for each refusal (OpenAI's error shape, at once), remote image
URLs (off by default; size, time and redirect limits when on), and the server's parts a
stream needs (the chat body cap, read-ahead for disconnects, unbuffered writes)."""

from __future__ import annotations

import base64
import http.server
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
from flask import Flask
from redis import Redis

from tests.support import openai_api as T
from vlmq.producer.client import Client
from vlmq.producer.openai_files import ModelPolicy
from vlmq.server.dashboard.trust import allow_list
from vlmq.server.openai_api.access import Gate
from vlmq.server.openai_api.app import ApiSettings, create_app
from vlmq.server.openai_api.chat import ONE_IMAGE, ChatCall, parse_chat
from vlmq.server.openai_api.errors import ApiError
from vlmq.server.openai_api.image_urls import RemoteImages
from vlmq.server.openai_api.limits import MAX_CHAT_BYTES, MAX_JSON_BYTES, ApiLimits
from vlmq.server.openai_api.server import Head, check_head, make_server
from vlmq.shared.chat import CHAT_QUEUE, Message
from vlmq.shared.keys import Keys

USER = {"role": "user", "content": "What is this?"}
POLICY = ModelPolicy()


def parse(**body: Any) -> ChatCall:
    return parse_chat({"model": "gpt-4o-mini", "messages": [USER], **body}, POLICY)


def refused(body: dict[str, Any], policy: ModelPolicy = POLICY) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_chat(body, policy)
    assert caught.value.status == 400
    return caught.value


def image_part(url: str = "data:image/png;base64,AAAA") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


# --- reading a request ---------------------------------------------------------------------


def test_a_conversation_with_its_image_in_the_user_turn_that_has_it() -> None:
    call = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, image_part(),
                                     {"type": "text", "text": "what colour?"}]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Sure?", "name": "ann"}]}, POLICY)
    assert call.messages == (Message("system", "Be brief."),
                             Message("user", "Look:\nwhat colour?", image=True),
                             Message("assistant", "Red."), Message("user", "Sure?"))
    assert call.image == ("messages[1].content[1].image_url.url", "data:image/png;base64,AAAA")
    assert (call.stream, call.include_usage, call.schema, call.model) == (False, False, None, "m")
    assert call.model_setting is None  # any name runs, as a batch line's does


def test_the_knobs_vlmq_honours() -> None:
    call = parse(max_completion_tokens=12, temperature=0, stop="END", stream=True,
                 stream_options={"include_usage": True}, seed=3, top_p=1, user="u-1")
    assert (call.max_tokens, call.temperature, call.stop) == (12, 0.0, ("END",))
    assert call.stream and call.include_usage
    assert parse(max_tokens=5, stop=["a", "b"]).stop == ("a", "b")
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
              "additionalProperties": False}
    made = parse(response_format={"type": "json_schema",
                                  "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert made.schema == schema
    assert parse(response_format={"type": "json_object"}).schema == {"type": "object"}
    assert parse(response_format={"type": "text"}).schema is None


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 2}, "n"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"logprobs": True}, "logprobs"), ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"functions": []}, "functions"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": "yes"}, "stream"),
    ({"stream": True, "stream_options": {"chunk": 1}}, "stream_options.chunk"),
    ({"max_tokens": 5, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": 9}, "temperature"),
    ({"top_p": 3}, "top_p"), ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_what_vlmq_cannot_honour_is_refused_naming_it(extra: dict[str, Any],
                                                      param: str) -> None:
    err = refused({"model": "m", "messages": [USER], **extra})
    assert err.param == param and err.message.startswith(param)
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("messages", "param", "why"), [
    ([], "messages", "non-empty"),
    ([{"role": "tool", "content": "42", "tool_call_id": "x"}], "messages[0].role", "tools"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": []}, USER],
     "messages[1].tool_calls", "not supported"),
    ([USER, {"role": "assistant", "content": "Hi"}], "messages", "last message"),
    ([{"role": "user", "content": [image_part(), image_part()]}],
     "messages[0].content[1].image_url.url", ONE_IMAGE),
    ([{"role": "user", "content": [image_part()]}, {"role": "assistant", "content": "ok"},
      {"role": "user", "content": [image_part()]}],
     "messages[2].content[0].image_url.url", ONE_IMAGE),
    ([{"role": "system", "content": [image_part()]}, USER], "messages[0].content[0]",
     "user messages"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0].type",
     "must be"),
    ([{"role": "critic", "content": "x"}], "messages[0].role", "must be one of"),
    ([{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}],
     "messages[0].content[0].file.file_id", "inline the file"),
])
def test_a_conversation_vlmq_cannot_answer_is_refused(messages: list[Any], param: str,
                                                      why: str) -> None:
    err = refused({"model": "m", "messages": messages})
    assert err.param == param and why in err.message


def test_the_model_is_required_and_follows_the_model_policy() -> None:
    assert refused({"messages": [USER]}).param == "model"
    assert refused({"model": "", "messages": [USER]}).param == "model"
    mapped = ModelPolicy(False, {"tiny": "org/tiny-model"})
    assert parse_chat({"model": "tiny", "messages": [USER]}, mapped).model_setting == \
        "org/tiny-model"
    strict = ModelPolicy(True)
    assert parse_chat({"model": "org/x", "messages": [USER]}, strict).model_setting == "org/x"


# --- the app, through the official SDK -------------------------------------------------------


@pytest.fixture
def app(redis_url: str, tmp_path: Path) -> Iterator[Flask]:
    client = Client(redis_url)
    try:
        yield create_app(ApiSettings(redis_url=redis_url, files_dir=tmp_path / "files",
                                     keys=T.KEYS, models=ModelPolicy(True)), client=client)
    finally:
        client.close()


def png_uri(width: int = 40, height: int = 30) -> str:
    return T.data_uri(1, (width, height))


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header declaring a canvas far past the caps (its data never decoded)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def ask(api: openai.OpenAI, content: Any = "Hello?", **extra: Any) -> Any:
    return api.chat.completions.create(model=extra.pop("model", "org/tiny"),
                                       messages=[{"role": "user", "content": content}],
                                       **extra)


def serving(redis: Redis, model: str = "org/tiny") -> None:
    """A worker registered on the chat queue, as RQ and the worker's stats list it (no
    process behind it: requests enqueue, and nothing answers)."""
    keys = Keys.from_env()
    redis.sadd(Keys.rq_queue_workers(CHAT_QUEUE), Keys.rq_worker("fake"))
    redis.hset(keys.worker_stats("fake"), "model", model)
    redis.sadd(keys.workers, "fake")


def test_no_worker_is_an_error_at_once(app: Flask) -> None:
    """At once even for an SDK that retries (its default): the answer says not to."""
    api = openai.OpenAI(api_key=T.KEYS[0], base_url="http://127.0.0.1:8000/v1", max_retries=2,
                        http_client=httpx.Client(transport=httpx.WSGITransport(app=app)))
    for stream in (False, True):
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            ask(api, model="gpt-anything", stream=stream)
        assert time.monotonic() - started < 1.0
        assert caught.value.status_code == 503
        body = caught.value.body
        assert isinstance(body, dict) and body["code"] == "no_worker"
        assert body["type"] == "server_error" and "chat" in body["message"]


def test_keys_models_and_refusals_in_openai_shape(app: Flask, redis: Redis) -> None:
    with pytest.raises(openai.AuthenticationError):
        ask(T.sdk(app, "not-a-key-at-all-123"))
    serving(redis)
    api = T.sdk(app)
    with pytest.raises(openai.NotFoundError) as unknown:
        ask(api, model="gpt-4o")  # strict: a model no chat worker serves
    assert isinstance(unknown.value.body, dict)
    assert unknown.value.body["code"] == "model_not_found"
    assert unknown.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as many:
        ask(api, n=2)
    assert isinstance(many.value.body, dict) and many.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as web:
        ask(api, [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}])
    assert isinstance(web.value.body, dict) and web.value.body["code"] == "invalid_image_url"
    assert "--image-urls" in web.value.body["message"]


@pytest.mark.parametrize(("data", "why"), [
    (b"not an image at all, only text", "neither"),
    (bomb_png(60_000, 60_000), "decompression bomb"),
])
def test_a_bad_image_is_refused_before_anything_is_enqueued(app: Flask, redis: Redis,
                                                            data: bytes, why: str) -> None:
    serving(redis)
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    with pytest.raises(openai.BadRequestError) as caught:
        ask(T.sdk(app), [{"type": "text", "text": "What?"},
                         {"type": "image_url", "image_url": {"url": uri}}])
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "invalid_image"
    assert body["param"] == "messages[0].content[1].image_url.url"
    assert why in body["message"].lower()
    assert redis.llen(Keys.rq_queue(CHAT_QUEUE)) == 0


# --- remote image URLs -----------------------------------------------------------------


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(40):
                    self.wfile.write(b"x" * 10)
                    self.wfile.flush()
                    time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the fetch gave up, as it should
            return
        if self.path == "/elsewhere":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
            return
        body = b"y" * (5000 if self.path == "/big" else 100)
        self.send_response(200)
        if self.path != "/unannounced":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body * (30 if self.path == "/unannounced" else 1))

    def log_message(self, format: str, *args: Any) -> None:
        del format, args


@pytest.fixture
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_remote_images_within_their_limits(image_server: str) -> None:
    remote = RemoteImages(max_bytes=1000, timeout_s=0.5)
    assert remote.fetch(image_server + "/small", "p") == b"y" * 100
    for path, why in (("/big", "5,000 bytes"), ("/unannounced", "over"),
                      ("/slow", "longer than 0.5 s"), ("/elsewhere", "is not allowed"),
                      ("/missing-port", "")):
        url = image_server + path if path != "/missing-port" else "http://127.0.0.1:1/a"
        with pytest.raises(ApiError) as caught:
            remote.fetch(url, "messages[0].content[0].image_url.url")
        assert caught.value.status == 400 and caught.value.code == "invalid_image_url"
        assert why in caught.value.message, (path, caught.value.message)


# --- the server's parts --------------------------------------------------------------------


def test_the_server_reads_a_chat_body_and_sends_each_write_at_once(app: Flask) -> None:
    limits = ApiLimits()
    gate = Gate(T.KEYS, uploads_per_key=4)
    allowed = allow_list("127.0.0.1", 8000, ())
    head = {"HOST": "127.0.0.1:8000", "AUTHORIZATION": f"Bearer {T.KEYS[0]}"}
    assert check_head(Head("POST", "/v1/chat/completions", head, "c", MAX_CHAT_BYTES),
                      gate, allowed, limits) is None
    with pytest.raises(ApiError) as caught:
        check_head(Head("POST", "/v1/batches", head, "c", MAX_JSON_BYTES + 1), gate,
                   allowed, limits)
    assert caught.value.status == 413
    server = make_server(app, gate, allowed, limits, host="127.0.0.1", port=0)
    try:
        # Read-ahead lets waitress see a closed connection while a request waits; each
        # write of a streamed answer goes out without waiting for more.
        assert server.adj.channel_request_lookahead == 1
        assert server.adj.send_bytes == 1
    finally:
        server.close()
