"""Interactive requests from Python: one conversation about at most one image, enqueued as
a job on the `chat` queue, answered as a stream of text (shared/chat.py owns the wire).

`chat_input` reads the conversation (OpenAI-style dicts, or a question and an image),
`chat_options` and `submit_chat` make and enqueue its job (Client.chat and `vlmq api` alike),
and `ChatStream` follows the job's token stream. A follower must
never hang on a request nobody is answering, so while it waits it looks at who holds the
job: no live worker for the queue while the job is queued, or the worker running it gone
(its execution past its heartbeat, or unregistered), ends the stream with an error.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from redis.exceptions import RedisError

from vlmq.producer.job_admin import CannotCancel
from vlmq.producer.options import JobOptions
from vlmq.shared import constants as C
from vlmq.shared.chat import CHAT_QUEUE, Delta, End, Message, check_messages, decode
from vlmq.shared.errors import InputError, PayloadError, VlmqError
from vlmq.shared.keys import Keys
from vlmq.shared.redis_text import as_str

if TYPE_CHECKING:
    from vlmq.producer.client import Client, Job
    from vlmq.producer.inputs import Prepared

# How long one blocking read of the token stream waits before the follower looks at
# the job's state again: the bound on noticing a dead worker, on top of its heartbeat.
LOOK_S = 1.0
# A job that ended with no End entry may still have one on its way (the worker writes the
# stream before it ends the job, but a reader can see the end first on a replica).
END_GRACE_S = 1.0
READ_COUNT = 512
LIVE_SCAN = 100  # workers looked up per round trip
# A queued request with no live worker for its queue this long is refused: long enough for
# a worker that has just registered with RQ to publish its first stats.
UNSERVED_GRACE_S = 10.0
# OpenAI's roles that vlmq maps onto its own; the developer role is OpenAI's new system.
ROLE_OF = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MessagesIn = Sequence[Mapping[str, Any]] | str


class ChatError(VlmqError):
    """The request was not answered: the message says why (the worker's error, a dead
    worker, a timeout); `job_id` is the job that carried it, when one was enqueued."""

    def __init__(self, message: str, job_id: str | None = None) -> None:
        self.job_id = job_id
        super().__init__(message if job_id is None else f"{message} (job {job_id})")


class NoWorker(ChatError):
    """No live (or starting) worker serves the chat queue: nothing would answer."""


class ChatTimeout(ChatError, TimeoutError):
    """The answer did not end within the caller's timeout; the request was cancelled."""


@dataclass(frozen=True)
class Usage:
    """Tokens the answer cost, as the worker counted them (OpenAI's names)."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclass(frozen=True)
class ChatInput:
    """A conversation ready to enqueue: the wire messages and the one image's bytes."""

    messages: tuple[Message, ...]
    image: bytes | None
    image_name: str = "image"


# --- building the request ------------------------------------------------------------------


def chat_input(messages: MessagesIn, *, image: str | os.PathLike[str] | bytes | None = None,
               system: str | None = None) -> ChatInput:
    """The conversation from either form: a question (str) with `image` (a path or its
    bytes), or OpenAI-style messages whose content is a string or a list of `text` and
    `image_url` parts (a `data:` URI, a `file://` URL or a local path; http(s) is refused,
    since vlmq fetches nothing from the web). `image` given with messages goes at the
    start of the last user turn. `system` adds a system turn first. At most one image:
    vlmq answers about one image per request. Raises PayloadError naming the field."""
    raw: list[Mapping[str, Any]] = ([{"role": "user", "content": messages}]
                                    if isinstance(messages, str) else list(messages))
    if system is not None:
        raw.insert(0, {"role": "system", "content": system})
    turns: list[dict[str, Any]] = []
    found: list[tuple[bytes, str]] = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise PayloadError(where, "must be an object with role and content")
        role = ROLE_OF.get(str(msg.get("role")))
        if role is None:
            raise PayloadError(f"{where}.role", "must be one of " + ", ".join(ROLE_OF))
        text, images = _content(msg.get("content"), f"{where}.content", role)
        found.extend(images)
        turns.append({"role": role, "content": text, **({"image": True} if images else {})})
    if image is not None:
        user = [i for i, t in enumerate(turns) if t["role"] == "user"]
        if not user:
            raise PayloadError("messages", "an image needs a user turn to go with")
        turns[user[-1]]["image"] = True
        found.append(_image_arg(image))
    if len(found) > 1:
        raise PayloadError("messages", "vlmq answers about one image per request; "
                                       f"this one has {len(found)}")
    checked = check_messages(turns)
    data, name = found[0] if found else (None, "image")
    return ChatInput(checked, data, name)


def _content(value: Any, where: str, role: str) -> tuple[str, list[tuple[bytes, str]]]:
    """A message's text (its text parts a newline apart) and its images."""
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        raise PayloadError(where, "must be a string or a list of content parts")
    texts: list[str] = []
    images: list[tuple[bytes, str]] = []
    for j, part in enumerate(value):
        here = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            if role != "user":
                raise PayloadError(here, "only a user's turn can carry the image")
            inner = part.get("image_url")
            url = inner.get("url") if isinstance(inner, Mapping) else inner
            if not isinstance(url, str):
                raise PayloadError(f"{here}.image_url.url", "must be a string")
            images.append(_image_url(url, f"{here}.image_url.url"))
        else:
            raise PayloadError(here, 'must be a {"type": "text", "text"} or {"type": '
                                     '"image_url", "image_url": {"url"}} part')
    return "\n".join(texts), images


def _image_url(url: str, where: str) -> tuple[bytes, str]:
    """An image URL's bytes: a data: URI (base64) or a local file."""
    if url.startswith("data:"):
        from vlmq.producer.openai_files import data_uri_bytes

        return data_uri_bytes(url, where)[0], "image"
    scheme = urlparse(url).scheme
    if scheme in ("http", "https"):
        raise PayloadError(where, "http(s) images are not fetched: send the image inline "
                                  "(a data: URI) or as a local path")
    if scheme == "file":
        return _read_image(unquote(urlparse(url).path))
    return _read_image(url)


def _image_arg(image: str | os.PathLike[str] | bytes) -> tuple[bytes, str]:
    if isinstance(image, bytes):
        return image, "image"
    return _read_image(os.fspath(image))


def _read_image(path: str) -> tuple[bytes, str]:
    """A local image's bytes, read here so the request owns a copy (size-checked first)."""
    try:
        size = os.stat(path).st_size
        if size > C.BLOB_MAX_BYTES:
            raise InputError(path, f"is {size} bytes, over the {C.BLOB_MAX_BYTES}-byte "
                                   "blob limit; recompress or downscale it")
        with open(path, "rb") as fh:
            return fh.read(), path
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except IsADirectoryError:
        raise InputError(path, "is a directory, not an image") from None
    except OSError as exc:
        raise InputError(path, f"cannot be read: {exc.strerror or exc}") from None


def chat_options(chat: ChatInput, *, max_tokens: int | None = None,
                 temperature: float | None = None, stop: Sequence[str] | None = None,
                 schema: Any = None, model: str | None = None, stream: bool = True,
                 result_cache: str = "off", job_id: str | None = None) -> tuple[str, JobOptions]:
    """The task and options of a chat job: on the chat queue, streamed, result cache off
    unless asked (an interactive answer may be sampled, and is asked for once)."""
    from vlmq.shared import extract_schema

    values: dict[str, Any] = {
        "queue": CHAT_QUEUE, "messages": chat.messages, "stream": stream,
        "result_cache": result_cache, "prompt": _prompt(chat.messages),
        "max_tokens": max_tokens, "temperature": temperature, "model": model,
        "job_id": job_id, "stop": tuple(stop) if stop else None}
    task = "generate"
    if schema is not None:
        task = "extract"
        values["schema"] = extract_schema.as_schema(schema)
    return task, JobOptions.build(**values)


def _prompt(messages: Sequence[Message]) -> str:
    """The job's prompt beside its messages: the last user turn, for listings and for a
    reader of the payload that knows no messages (the worker renders the messages)."""
    text = " ".join(messages[-1].content.split())
    return text[:C.MAX_PROMPT_CHARS] or "(the image)"


def prepare_chat(chat: ChatInput, spool: Path) -> Prepared:
    """The job's one item: the image (checked by content, written under `spool` for the
    upload) or a text item when the conversation has none."""
    from vlmq.producer import files
    from vlmq.producer.inputs import Prepared
    from vlmq.shared.messages import Item

    prepared = Prepared()
    if chat.image is None:
        prepared.items.append(Item(kind=C.TEXT_KIND, blob=None, source=C.TEXT_KIND))
        return prepared
    path = spool / "image"
    path.write_bytes(chat.image)
    checked = files.check_file(path, source=Path(chat.image_name).name or "image")
    if checked.kind != "image":
        raise InputError(chat.image_name, f"is a {checked.kind}: vlmq answers about one "
                                          "image per request (render the page first)")
    prepared.add(checked, [None])
    return prepared


def submit_chat(client: Client, chat: ChatInput, task: str, options: JobOptions) -> Job:
    """Enqueue the chat job, refused at once (NoWorker) when no worker would take it."""
    if client.serving(CHAT_QUEUE) == 0:
        raise NoWorker(f"no live worker serves queue {CHAT_QUEUE!r}: start one with "
                       f"`vlmq worker --model M` (it serves {CHAT_QUEUE!r} by default)")
    with tempfile.TemporaryDirectory(prefix="vlmq-chat-") as spool:
        return client.submit(task, prepare_chat(chat, Path(spool)), options)


# --- following the answer --------------------------------------------------------------


class ChatStream:
    """The answer to one chat job as it is decoded: iterate for text deltas; then `text`,
    `finish_reason` and `usage` hold the whole answer. `result()` reads it to the end.

    Closing it (or leaving its `with` block, or a KeyboardInterrupt while iterating) before
    the answer ended cancels the request, so the worker drops its row. Raises ChatError
    when the worker reports an error, the worker dies, or `timeout` seconds pass.
    """

    def __init__(self, client: Client, job: Job, *, timeout: float | None = None,
                 look_s: float = LOOK_S, unserved_grace_s: float = UNSERVED_GRACE_S) -> None:
        self.client = client
        self.job = job
        self._unserved_grace_s = unserved_grace_s
        self._unserved_since: float | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.error: str | None = None
        self._key = client.keys.job_tokens(job.id)
        self._cursor = "0-0"
        self._look_s = look_s
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._iterated = False

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def __iter__(self) -> Iterator[str]:
        if self._iterated:
            raise RuntimeError("a ChatStream is read once; use .text for the answer")
        self._iterated = True
        try:
            yield from self._deltas()
        except BaseException:
            self.close()  # ^C, a dead worker, a timeout, a caller that stopped reading
            raise

    def result(self) -> str:
        """The whole answer (reading what is left of the stream)."""
        if not self._iterated:
            for _ in self:
                pass
        return self.text

    def close(self) -> None:
        """Cancel the request when its answer has not ended (a no-op after)."""
        if self.done:
            return
        self.finish_reason = self.finish_reason or "cancelled"
        try:
            self.client.cancel(self.job.id)
        except CannotCancel:
            pass  # it ended meanwhile: nothing left to stop
        except RedisError as exc:  # the caller is leaving: its own error matters more
            self.error = f"cancel failed: {exc}"

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _deltas(self) -> Iterator[str]:
        ended_at: float | None = None
        next_look = time.monotonic() + self._look_s
        while True:
            entries = self._read()
            for fields in entries:
                entry = decode(fields)
                if isinstance(entry, Delta):
                    if entry.text:
                        self.text += entry.text
                        yield entry.text
                    continue
                self._end(entry)
                return
            if entries and time.monotonic() < next_look:
                continue  # text is flowing: the job's state is looked at once per look_s
            next_look = time.monotonic() + self._look_s
            if self._deadline is not None and time.monotonic() >= self._deadline:
                raise ChatTimeout(f"no complete answer within {self._timeout:g}s; the "
                                  "request was cancelled", self.job.id)
            status = self._status()
            if status in _ENDED:
                ended_at = ended_at if ended_at is not None else time.monotonic()
                if time.monotonic() - ended_at >= END_GRACE_S:
                    yield from self._ended_unstreamed(status)
                    return
            else:
                self._check_alive(status)

    def _read(self) -> list[Mapping[bytes | str, bytes | str]]:
        wait_s = self._look_s
        if self._deadline is not None:
            wait_s = max(0.001, min(wait_s, self._deadline - time.monotonic()))
        reply: Any = self.client.redis.xread({self._key: self._cursor}, count=READ_COUNT,
                                             block=max(1, int(wait_s * 1000)))
        out: list[Mapping[bytes | str, bytes | str]] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self._cursor = as_str(entry_id)
                out.append(fields)
        return out

    def _end(self, end: End) -> None:
        self.usage = Usage(end.prompt_tokens, end.completion_tokens)
        self.finish_reason = end.finish_reason
        if end.finish_reason == "error":
            self.error = end.error or "the worker reported an error"
            raise ChatError(f"the worker failed the request: {self.error}", self.job.id)

    def _status(self) -> str:
        raw = self.client.redis.hget(Keys.rq_job(self.job.id), "status")
        return as_str(raw) if raw is not None else "gone"

    def _ended_unstreamed(self, status: str) -> Iterator[str]:
        """The job ended and its stream holds no End: the answer from its result (a
        worker that did not stream, a result cache hit), or why there is none."""
        if status == "finished":
            results = list(self.job.results())
            if results and results[0].ok:
                item = results[0]
                self.text += item.text or ""
                self.finish_reason = item.finish_reason or "stop"
                self.usage = Usage(item.prompt_tokens, item.completion_tokens)
                if item.text:
                    yield item.text
                return
            error = results[0].error if results else "no result was written"
            raise ChatError(f"the worker failed the request: {error}", self.job.id)
        if status == "canceled":
            self.finish_reason = "cancelled"
            return
        if status == "gone":
            raise ChatError("the request's job is gone (deleted?) before it was answered",
                            self.job.id)
        raise ChatError(f"the request {status}: {self.job.error() or 'no reason recorded'}",
                        self.job.id)

    def _check_alive(self, status: str) -> None:
        """Raise ChatError when nobody will answer: queued with no live worker for the
        queue, or started by a worker that is gone."""
        if status == "queued":
            self._check_served()
            return
        if status != "started":
            return
        owner = self.client.redis.get(self.client.keys.job_owner(self.job.id))
        if owner is None:
            return  # being taken or ended this instant: the next look knows
        execution, _, worker = as_str(owner).partition(" ")
        pipe = self.client.redis.pipeline(transaction=False)
        pipe.zscore(Keys.rq_registry("started", self.job.queue), f"{self.job.id}:{execution}")
        pipe.exists(Keys.rq_worker(worker))
        pipe.time()
        lapses, registered, (now_s, _us) = pipe.execute()
        if lapses is not None and float(lapses) < now_s:
            raise ChatError(f"worker {worker} stopped answering (no heartbeat): it died "
                            "mid-answer", self.job.id)
        if not registered:
            raise ChatError(f"worker {worker} left mid-answer", self.job.id)

    def _check_served(self) -> None:
        """NoWorker once no live worker has served the queue for the grace period."""
        if self._live_server():
            self._unserved_since = None
            return
        now = time.monotonic()
        if self._unserved_since is None:
            self._unserved_since = now
        elif now - self._unserved_since >= self._unserved_grace_s:
            raise NoWorker(f"no live worker serves queue {self.job.queue!r} any more",
                           self.job.id)

    def _live_server(self) -> bool:
        """Whether a worker starting on the queue, or one registered on it that still
        publishes its stats, would take the job. RQ's set of a queue's workers keeps a
        killed worker until another one cleans it; the stats expire within seconds."""
        redis, keys, queue = self.client.redis, self.client.keys, self.job.queue
        if redis.scard(keys.queue_starting(queue)):
            return True
        members = [as_str(m) for m in redis.sscan_iter(Keys.rq_queue_workers(queue),
                                                       count=LIVE_SCAN)]
        for start in range(0, len(members), LIVE_SCAN):
            pipe = redis.pipeline(transaction=False)
            for member in members[start:start + LIVE_SCAN]:
                pipe.exists(keys.worker_stats(Keys.rq_name(member)))
            if any(pipe.execute()):
                return True
        return False


_ENDED = frozenset({"finished", "failed", "stopped", "canceled", "gone"})


def chat(client: Client, messages: MessagesIn, *,
         image: str | os.PathLike[str] | bytes | None = None, system: str | None = None,
         max_tokens: int | None = None, temperature: float | None = None,
         stop: Sequence[str] | None = None, schema: Any = None, model: str | None = None,
         timeout: float | None = None, result_cache: str = "off",
         job_id: str | None = None) -> ChatStream:
    """Client.chat's body: check, enqueue, and return the stream to follow."""
    request = chat_input(messages, image=image, system=system)
    task, options = chat_options(request, max_tokens=max_tokens, temperature=temperature,
                                 stop=stop, schema=schema, model=model,
                                 result_cache=result_cache, job_id=job_id)
    job = submit_chat(client, request, task, options)
    return ChatStream(client, job, timeout=timeout)
