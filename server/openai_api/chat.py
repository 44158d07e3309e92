"""`POST /v1/chat/completions`: one interactive request, answered in OpenAI's shapes.

A request is read as a batch line's body is (producer/openai_files.py: the same fields,
the same refusals of what vlmq cannot honour, the same response_format mapping), plus
what only a live request has: `stream` and `stream_options`, and a conversation (system,
user and assistant turns) rather than one prompt. It becomes one vlmq job on the `chat`
queue through the producer library (producer/chat.py), which every worker takes before
any bulk job; its answer is read from the job's token stream as the worker decodes it:
a `chat.completion`, or server-sent `chat.completion.chunk` events ending in
`data: [DONE]`.

Nothing waits on nobody: with no live (or starting) worker serving `chat` the request is
refused at once (503); a worker that dies mid-answer ends the answer with an error
(ChatStream watches who holds the job). A client that goes away cancels its request, so
the worker drops its row at its next step: waitress says so through the environ's
`waitress.client_disconnected`, which a watcher asks while the request waits.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from flask import Response, jsonify
from redis.exceptions import RedisError

from vlmq.producer import openai_files
from vlmq.producer.chat import (
    ChatError,
    ChatInput,
    ChatStream,
    NoWorker,
    chat_options,
    submit_chat,
)
from vlmq.producer.client import Client, Job
from vlmq.producer.openai_files import ModelPolicy
from vlmq.server.openai_api.errors import ApiError, error_body
from vlmq.server.openai_api.image_urls import OFF, RemoteImages
from vlmq.server.openai_api.metrics import ChatMetrics
from vlmq.shared import chat
from vlmq.shared import constants as C
from vlmq.shared import settings as S
from vlmq.shared.errors import InputError, PayloadError, VlmqError
from vlmq.shared.keys import Keys
from vlmq.shared.redis_text import as_str

log = logging.getLogger("vlmq.api")

# What a live request reads beyond a batch line's body: the stream switches.
STREAM_FIELDS = ("stream", "stream_options")
BODY_FIELDS = (*openai_files.BODY_FIELDS, *STREAM_FIELDS)
DEFAULT_ONLY: Mapping[str, Any] = {k: v for k, v in openai_files.DEFAULT_ONLY.items()
                                   if k not in STREAM_FIELDS}
# include_obfuscation pads chunks against a side channel of OpenAI's own network path.
STREAM_OPTIONS = ("include_usage", "include_obfuscation")
# OpenAI's roles on vlmq's: the developer role is OpenAI's newer name for system.
ROLES: Mapping[str, str] = {"system": "system", "developer": "system", "user": "user",
                            "assistant": "assistant"}
MESSAGE_FIELDS = ("role", "content", "name")
ASSISTANT_FIELDS = (*MESSAGE_FIELDS, "refusal")
# The worker's finish reasons as OpenAI names them; cancelled and error are no answer.
FINISH = {"stop": "stop", "length": "length", "repetition": "length"}
WATCH_S = 0.1  # how often a waiting request asks whether its client is still there
ONE_IMAGE = "vlmq answers about one image per request"


@dataclass(frozen=True)
class ChatCall:
    """A chat request, read and checked: what the job needs and how to answer."""

    model: str  # the name asked for, echoed in the answer
    model_setting: str | None  # the model a worker must serve (ModelPolicy), None: any
    messages: tuple[chat.Message, ...]
    image: tuple[str, str] | None  # (its param, its URL)
    schema: dict[str, Any] | None  # response_format json_schema / json_object
    max_tokens: int | None
    temperature: float | None
    stop: tuple[str, ...] | None
    stream: bool
    include_usage: bool


def parse_chat(body: Mapping[str, Any], models: ModelPolicy) -> ChatCall:
    """The request, or ApiError 400 naming the first field at fault (OpenAI's `param`)."""
    try:
        return _parse(body, models)
    except PayloadError as exc:
        param = exc.field.removeprefix("body.")
        raise ApiError(400, f"{param}: {exc.problem}" if param else exc.problem,
                       param=param or None) from None


def _parse(body: Mapping[str, Any], models: ModelPolicy) -> ChatCall:
    if body.get("model") is None:
        raise PayloadError("model", "is required (any name; `GET /v1/models` lists the "
                                    "models the workers serve)")
    name = openai_files.model_name_of(body["model"])
    assert name is not None  # given
    _check_fields(body)
    stream, include_usage = _stream(body)
    _task, schema = openai_files.task_of(body.get("response_format"))
    messages, image = _messages(body.get("messages"))
    wanted = models.setting(name)
    return ChatCall(
        model=name, model_setting=S.BY_NAME["model"].check(wanted, "model"),
        messages=messages, image=image, schema=schema, max_tokens=openai_files.max_tokens_of(body),
        temperature=S.BY_NAME["temperature"].check(body.get("temperature"), "temperature"),
        stop=openai_files.stop_of(body.get("stop")), stream=stream, include_usage=include_usage)


def _check_fields(body: Mapping[str, Any]) -> None:
    """Refuse what would change the answer and that vlmq cannot do, naming it; accept the
    bookkeeping and the sampling knobs a batch line accepts (openai_files says why)."""
    for name, value in body.items():
        if name in BODY_FIELDS or name in openai_files.IGNORED:
            continue
        if name in openai_files.NOT_APPLIED:
            openai_files.check_number(name, value, openai_files.NOT_APPLIED[name])
            continue
        if name in DEFAULT_ONLY:
            default = DEFAULT_ONLY[name]
            if value is None or (value == default
                                 and isinstance(value, bool) == isinstance(default, bool)):
                continue
            raise PayloadError(name, f"is not supported by vlmq: only {json.dumps(default)} "
                                     "(its default)")
        raise PayloadError(name, f"is not supported by vlmq (it reads "
                                 f"{', '.join(BODY_FIELDS)}; it ignores "
                                 f"{', '.join(openai_files.IGNORED)})")


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise PayloadError("stream", "must be true or false")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise PayloadError("stream_options", "is only allowed when stream is true")
    if not isinstance(options, dict):
        raise PayloadError("stream_options", "must be an object")
    unknown = sorted(set(options) - set(STREAM_OPTIONS))
    if unknown:
        raise PayloadError(f"stream_options.{unknown[0]}", "is not supported by vlmq "
                                                           f"(known: {', '.join(STREAM_OPTIONS)})")
    for name in STREAM_OPTIONS:
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise PayloadError(f"stream_options.{name}", "must be true or false")
    return True, bool(options.get("include_usage"))


def _messages(value: Any) -> tuple[tuple[chat.Message, ...], tuple[str, str] | None]:
    """The conversation as the wire carries it, and its one image (param, URL): each
    turn's text parts a newline apart, the image at the start of its user turn."""
    if not isinstance(value, list) or not value:
        raise PayloadError("messages", "must be a non-empty list of messages")
    turns: list[dict[str, Any]] = []
    image: tuple[str, str] | None = None
    for i, msg in enumerate(value):
        turn, image = _turn(msg, f"messages[{i}]", image)
        turns.append(turn)
    return chat.check_messages(turns), image


def _turn(msg: Any, where: str, image: tuple[str, str] | None
          ) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """One message as the wire's turn, and the conversation's image (param, URL) so far:
    `image` from the turns before, or this turn's; a second one, in this turn or after
    another turn's, is refused."""
    if not isinstance(msg, dict):
        raise PayloadError(where, f"must be an object, got {type(msg).__name__}")
    role = msg.get("role")
    if role in ("tool", "function"):
        raise PayloadError(f"{where}.role", f"{role} messages are not supported by vlmq: it "
                                            "runs no tools")
    if role not in ROLES:
        raise PayloadError(f"{where}.role", f"must be one of {', '.join(ROLES)}")
    role = str(role)
    unknown = sorted(set(msg) - set(ASSISTANT_FIELDS if role == "assistant"
                                    else MESSAGE_FIELDS))
    if unknown:
        raise PayloadError(f"{where}.{unknown[0]}", "is not supported by vlmq")
    content = msg.get("content")
    if content is None and role == "assistant":
        content = ""  # an assistant turn that only refused
    texts: list[str] = []
    before = image
    for text, ref in openai_files.content_parts(content, where, role):
        if text is not None:
            texts.append(text)
        elif ref is not None:
            if image is not None:
                raise PayloadError(ref[0], f"is a second image: {ONE_IMAGE} (the first is "
                                           f"{image[0]})")
            image = ref
    turn = {"role": ROLES[role], "content": "\n".join(texts),
            **({"image": True} if image is not before else {})}
    return turn, image


def live_models(client: Client, queue: str | None = None) -> set[str]:
    """The models live workers serve, from their stats (which expire with the worker);
    with `queue`, only the workers registered (or starting) on it."""
    redis, keys = client.redis, client.keys
    if queue is None:
        names = {as_str(n) for n in redis.smembers(keys.workers)}
    else:
        pipe = redis.pipeline(transaction=False)
        pipe.smembers(Keys.rq_queue_workers(queue))
        pipe.smembers(keys.queue_starting(queue))
        registered, starting = pipe.execute()
        prefix = Keys.rq_worker("")
        names = {as_str(n).removeprefix(prefix) for n in registered} | {
            as_str(n) for n in starting}
    pipe = redis.pipeline(transaction=False)
    for name in sorted(names):
        pipe.hget(keys.worker_stats(name), "model")
    return {as_str(m) for m in pipe.execute() if m is not None}


class _Hangup:
    """Asks, while a request waits for its answer, whether its client is still there; a
    client gone cancels the request at once (ChatStream.close), so the worker drops the
    row at its next step rather than decoding for nobody."""

    def __init__(self, disconnected: Callable[[], bool] | None, stream: ChatStream) -> None:
        self.gone = False
        self._disconnected = disconnected
        self._stream = stream
        self._stop = threading.Event()
        if disconnected is not None:
            threading.Thread(target=self._watch, name="chat-hangup", daemon=True).start()

    def _watch(self) -> None:
        assert self._disconnected is not None
        while not self._stop.wait(WATCH_S):
            if self._disconnected():
                self.gone = True
                log.info("chat %s: the client went away; cancelling", self._stream.id)
                try:
                    self._stream.close()
                except VlmqError as exc:  # gone or ended meanwhile: nothing left to stop
                    log.info("chat %s: %s", self._stream.id, exc)
                return

    def stop(self) -> None:
        self._stop.set()


class ChatCompletions:
    """The route's work: read, enqueue, answer; counted in `metrics`."""

    def __init__(self, client: Client, models: ModelPolicy, *,
                 remote: RemoteImages | None = None, metrics: ChatMetrics | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.models = models
        self.remote = remote
        self.metrics = metrics or ChatMetrics()
        self.clock = clock

    def create(self, owner: str, body: Mapping[str, Any],
               disconnected: Callable[[], bool] | None = None) -> Response:
        """The answer to one request: a ChatCompletion, or an event stream of chunks.
        `disconnected`: asks whether the client went away (waitress's)."""
        arrived = time.monotonic()
        stream = body.get("stream") is True
        try:
            call = parse_chat(body, self.models)
            job = self._enqueue(owner, call)
        except ApiError as exc:
            self.metrics.ended(stream, "unavailable" if exc.status == 503 else "refused")
            raise
        answer = ChatStream(self.client, job)
        hangup = _Hangup(disconnected, answer)
        reply = _Reply(call, f"chatcmpl-{job.id}", int(self.clock()), arrived, answer,
                       hangup, self.metrics)
        if call.stream:
            return Response(reply.events(), mimetype="text/event-stream",
                            headers={"X-Accel-Buffering": "no"})
        return jsonify(reply.completion())

    def _enqueue(self, owner: str, call: ChatCall) -> Job:
        """The request's job, or ApiError: no worker (503), an unserved model (404), a bad
        image (400)."""
        if self.client.serving(chat.CHAT_QUEUE) == 0:
            raise _no_worker()
        if call.model_setting is not None and call.model_setting not in live_models(
                self.client, chat.CHAT_QUEUE):
            raise ApiError(404, f"The model `{call.model}` does not exist or no live worker "
                                "serves it (`GET /v1/models` lists those served).",
                           param="model", code="model_not_found")
        data = self._image(call.image) if call.image is not None else None
        request = ChatInput(call.messages, data, "image")
        try:
            task, options = chat_options(request, max_tokens=call.max_tokens,
                                         temperature=call.temperature, stop=call.stop,
                                         schema=call.schema, model=call.model_setting)
            options = options.with_(labels={C.TENANT_LABEL: owner})
            return submit_chat(self.client, request, task, options)
        except NoWorker:
            raise _no_worker() from None
        except InputError as exc:  # the image, checked by content
            param = call.image[0] if call.image is not None else "messages"
            raise ApiError(400, f"{param}: the image {exc.problem}", param=param,
                           code="invalid_image") from None
        except PayloadError as exc:
            raise ApiError(400, str(exc), param=exc.field or None) from None

    def _image(self, ref: tuple[str, str]) -> bytes:
        param, url = ref
        scheme = url[:8].lower()
        if scheme.startswith("data:"):
            try:
                data, _mime = openai_files.data_uri_bytes(url, param)
            except PayloadError as exc:
                raise ApiError(400, str(exc), param=param, code="invalid_image") from None
            return data
        if scheme.startswith(("http://", "https://")):
            if self.remote is None:
                raise ApiError(400, f"{param}: {OFF}", param=param,
                               code="invalid_image_url")
            return self.remote.fetch(url, param)
        raise ApiError(400, f"{param}: must be a data: URI (base64) or an http(s) URL",
                       param=param, code="invalid_image_url")


def _no_worker() -> ApiError:
    return ApiError(503, f"No live vlmq worker serves queue '{chat.CHAT_QUEUE}': nothing would "
                         "answer. Start one (`vlmq worker --model M` serves it by default).",
                    code="no_worker", retry=False)


class _Reply:
    """One request's answer, read from its ChatStream: whole, or as events."""

    def __init__(self, call: ChatCall, completion_id: str, created: int, arrived: float,
                 answer: ChatStream, hangup: _Hangup, metrics: ChatMetrics) -> None:
        self.call = call
        self.id = completion_id
        self.created = created
        self.arrived = arrived
        self.answer = answer
        self.hangup = hangup
        self.metrics = metrics
        self.first: float | None = None
        self.counted = False

    def _count(self, outcome: str) -> None:
        """The request's end, counted once."""
        if not self.counted:
            self.counted = True
            self.metrics.ended(self.call.stream, outcome)

    def _deltas(self) -> Iterator[str]:
        """The answer's text as decoded; the metrics see its first token and its end."""
        for text in self.answer:
            if self.first is None:
                self.first = time.monotonic()
                self.metrics.first_token(self.call.stream, self.first - self.arrived)
            yield text

    def _outcome(self) -> str:
        """How it ended, once it has; counted, and the rate observed."""
        reason = self.answer.finish_reason or "error"
        outcome = ("disconnected" if self.hangup.gone else
                   FINISH.get(reason, reason if reason in ("cancelled", "error") else "stop"))
        self._count(outcome)
        usage = self.answer.usage
        if self.first is not None and usage is not None:
            self.metrics.rate(self.call.stream, usage.completion_tokens,
                              time.monotonic() - self.first)
        return outcome

    def completion(self) -> dict[str, Any]:
        """The whole answer as a ChatCompletion; ApiError when there is none."""
        try:
            text = "".join(self._deltas())
        except ChatError as exc:
            self._count("error")
            raise ApiError(503 if isinstance(exc, NoWorker) else 500, str(exc),
                           code="worker_error") from None
        finally:
            self.hangup.stop()
            self.answer.close()
        outcome = self._outcome()
        if outcome not in ("stop", "length"):
            raise ApiError(500, f"the request was {outcome} before it was answered "
                                f"({self.answer.error or 'vlmq cancel'})",
                           code="request_cancelled")
        usage = self.answer.usage
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.call.model, "system_fingerprint": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                     "refusal": None},
                             "logprobs": None, "finish_reason": outcome}],
                "usage": usage.to_dict() if usage is not None else _NO_USAGE}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.call.model, "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish}]}
        if self.call.include_usage:
            chunk["usage"] = None  # OpenAI's: null on every chunk but the last
        return _event(chunk)

    def events(self) -> Iterator[bytes]:
        """Server-sent events: the role, each delta as decoded, the finish reason, the
        usage when asked, then [DONE]; an error event (OpenAI's error shape, which the
        SDKs raise) when the answer cannot end. Each event goes out as it is made
        (waitress sends every write at once: its send_bytes is 1)."""
        try:
            yield self._chunk({"role": "assistant", "content": "", "refusal": None})
            for text in self._deltas():
                yield self._chunk({"content": text})
            outcome = self._outcome()
            if outcome in ("stop", "length"):
                yield self._chunk({}, outcome)
                if self.call.include_usage:
                    usage = self.answer.usage
                    yield _event({"id": self.id, "object": "chat.completion.chunk",
                                  "created": self.created, "model": self.call.model,
                                  "system_fingerprint": None, "choices": [],
                                  "usage": usage.to_dict() if usage is not None
                                  else _NO_USAGE})
            else:
                yield _event(error_body(500, f"the request was {outcome} before it was "
                                             f"answered ({self.answer.error or 'vlmq cancel'})",
                                        code="request_cancelled"))
        except (ChatError, RedisError) as exc:  # no silent cut: the client is told
            self._count("error")
            log.warning("chat %s: %s", self.answer.id, exc)
            yield _event(error_body(503 if isinstance(exc, NoWorker) else 500, str(exc),
                                    code="worker_error"))
        finally:
            self.hangup.stop()
            self.answer.close()  # a client gone mid-stream (waitress closes us): cancel
            self._count("disconnected")  # uncounted so far: the client left
        yield b"data: [DONE]\n\n"


_NO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
