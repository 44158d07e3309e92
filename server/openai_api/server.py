"""`vlmq api` under waitress, with every request's key checked before its body is read.

waitress reads a request's whole body (past 512 kB into a temporary file) before it calls
the app, so a key check in the app comes after the bytes are held: anyone who can reach
the port could hold a 200 MB temporary file per connection without a key. So the
server's parser asks the Gate as soon as a request's headers end: the Host (421, as the
app's Host guard answers), the key (401, or 429 per client address), the body's announced
size (413: an upload's limit, MAX_CHAT_BYTES for a chat request, MAX_JSON_BYTES for every
other route) and the key's uploads on the wire (429). A refused body is never stored: up
to DRAIN_BYTES of it are read and dropped, so a client that sends its whole body before
reading gets the answer rather than a reset, and the connection is then closed. A client that asked
`Expect: 100-continue` is answered at once and sends nothing.

A chat request waits for its answer, and a client that leaves must cancel it: waitress
notices a closed connection only while it reads from it, so the server reads one request
ahead (channel_request_lookahead 1), which makes `waitress.client_disconnected` true as
soon as the client is gone. Streamed answers go out event by event: waitress sends each
write at once (its send_bytes, 1 since waitress 3, is checked at start).

Every answer given here, and waitress' own (a malformed request, headers too large, a
chunked body past the limit), is in OpenAI's error shape, so the SDKs raise their typed
errors.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from flask import Flask
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import create_server
from waitress.utilities import Error

from vlmq.server.dashboard.trust import REFUSED, AllowList
from vlmq.server.openai_api.access import Gate
from vlmq.server.openai_api.errors import ApiError
from vlmq.server.openai_api.limits import FORM_SLACK, MAX_CHAT_BYTES, MAX_JSON_BYTES, ApiLimits

UPLOAD_PATH = "/v1/files"
CHAT_PATH = "/v1/chat/completions"
DRAIN_BYTES = 1 << 20  # a refused body read and dropped, at most, before the answer


@dataclass(frozen=True)
class Head:
    """What the server knows of a request once its headers are in."""

    method: str
    path: str
    headers: Mapping[str, str]  # waitress' form: HOST, AUTHORIZATION, CONTENT_LENGTH...
    client: str
    length: int  # the announced body; 0 for none or a chunked one

    @property
    def upload(self) -> bool:
        return self.method == "POST" and self.path == UPLOAD_PATH

    @property
    def chat(self) -> bool:
        return self.method == "POST" and self.path == CHAT_PATH


class Misdirected(Exception):
    """A Host the allow-list does not name (DNS rebinding): 421, as the Host guard says."""


def body_cap(upload: bool, limits: ApiLimits, *, chat: bool = False) -> int:
    """The most body bytes a request may send: a file and its form, a chat request with
    its image inline, or a JSON body."""
    if upload:
        return limits.upload_bytes + FORM_SLACK
    return MAX_CHAT_BYTES if chat else MAX_JSON_BYTES


def check_head(head: Head, gate: Gate, allowed: AllowList, limits: ApiLimits
               ) -> Callable[[], None] | None:
    """Admit a request before its body: raises Misdirected or ApiError; for an upload,
    returns the function that ends its count."""
    if head.headers.get("HOST", "").strip().lower() not in allowed.hosts:
        raise Misdirected
    owner = gate.admit(head.headers.get("AUTHORIZATION"), head.client)
    cap = body_cap(head.upload, limits, chat=head.chat)
    if head.length > cap:
        what = "upload" if head.upload else "body"
        raise ApiError(413, f"the {what} is larger than {cap:,} bytes, this server's limit "
                            f"(a file may be {limits.upload_bytes:,} bytes)")
    return gate.start_upload(owner) if head.upload else None


class Answer(Error):  # type: ignore[misc]  # waitress is untyped
    """An answer the server gives itself, in waitress' form for its error task."""

    def __init__(self, status: int, content_type: str, body: bytes,
                 headers: list[tuple[str, str]]) -> None:
        super().__init__(body)
        self.code = status
        self.reason = HTTPStatus(status).phrase
        self.content_type = content_type
        self.extra = headers

    @classmethod
    def of(cls, exc: ApiError) -> Answer:
        return cls(exc.status, "application/json", json.dumps(exc.body()).encode(),
                   exc.headers())

    @classmethod
    def of_waitress(cls, error: Any) -> Answer:
        """waitress' own refusals (400, 413, 431, 501) in OpenAI's shape."""
        status = int(getattr(error, "code", 400))
        message = f"{getattr(error, 'reason', 'Bad Request')}: {getattr(error, 'body', '')}"
        return cls.of(ApiError(status, message.rstrip(": ")))

    def to_response(self, ident: str | None = None) -> tuple[str, list[tuple[str, str]],
                                                             bytes]:
        body: bytes = self.body
        return (f"{self.code} {self.reason}",
                [("Content-Type", self.content_type), *self.extra], body)


MISDIRECTED = Answer(421, "text/plain; charset=utf-8", REFUSED,
                     [("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff")])


class GatedParser(HTTPRequestParser):  # type: ignore[misc]  # waitress is untyped
    """waitress' request parser, asking check_head once the headers are in."""

    # waitress' own attributes, as this class uses them.
    adj: Any
    command: str
    path: str
    headers: dict[str, str]
    completed: bool
    chunked: bool
    content_length: int
    expect_continue: bool
    headers_finished: bool
    header_bytes_received: int
    body_bytes_received: int
    body_rcv: Any
    error: Any

    def __init__(self, adj: Any, *, check: Callable[[Head], Callable[[], None] | None],
                 cap: Callable[..., int], client: str) -> None:
        super().__init__(adj)
        self._check = check
        self._cap = cap
        self._client = client
        self._drain = 0  # refused body bytes still to read and drop
        self._refused = False
        self._limit = MAX_JSON_BYTES
        self._end: weakref.finalize[Any, Any] | None = None  # an upload's count, ended once

    def parse_header(self, header_plus: bytes) -> None:
        super().parse_header(header_plus)
        if self.header_bytes_received >= self.adj.max_request_header_size:
            return  # waitress' stand-in request for headers too large: it answers 431
        head = Head(self.command, self.path, self.headers, self._client,
                    0 if self.chunked else self.content_length)
        self._limit = self._cap(head.upload, chat=head.chat)
        try:
            end = self._check(head)
        except Misdirected:
            self._refuse(MISDIRECTED)
        except ApiError as exc:
            self._refuse(Answer.of(exc))
        else:
            if end is not None:  # at close, or when a dropped connection frees the parser
                self._end = weakref.finalize(self, end)

    def _refuse(self, answer: Answer) -> None:
        """Answer without the body: what is announced is dropped as it comes, up to
        DRAIN_BYTES, unless the client waits for a 100 Continue it will not get (or the
        body is chunked: its end is not known without parsing it)."""
        self._drain = 0 if self.expect_continue or self.chunked else min(
            self.content_length, DRAIN_BYTES)
        if self.body_rcv is not None:
            self.body_rcv.getbuf().close()
        self.error = answer
        self.body_rcv = None
        self.content_length = 0
        self.chunked = False
        self.expect_continue = False
        self._refused = True

    def received(self, data: bytes) -> int:
        if self._refused:
            return self._dropped(data)
        consumed: int = super().received(data)
        if self._refused:  # at its headers, just now
            self.completed = self._drain <= 0
            return consumed if self._drain > 0 else len(data)
        if self.body_bytes_received > self._limit and not self.completed:
            self._refuse(Answer.of(ApiError(413, f"the body is larger than {self._limit:,} "
                                                 "bytes, this server's limit")))
            self.completed = True
            return len(data)
        if self.error is not None and not isinstance(self.error, Answer):
            self.error = Answer.of_waitress(self.error)
        return consumed

    def _dropped(self, data: bytes) -> int:
        """Read and drop a refused body; once enough is gone, the answer goes out (the
        rest of what came is never parsed as a request)."""
        take = min(len(data), self._drain)
        self._drain -= take
        if self._drain > 0:
            return take
        self.completed = True
        return len(data)

    def close(self) -> None:
        super().close()
        if self._end is not None:
            self._end()


def _channel(server: Any, sock: Any, addr: Any, adj: Any, map: Any = None, *,
             parser: Callable[..., GatedParser]) -> HTTPChannel:
    """waitress' channel, its requests read by GatedParser knowing the client."""
    channel = HTTPChannel(server, sock, addr, adj, map=map)
    client = str(addr[0]) if isinstance(addr, tuple) and addr else "local"
    channel.parser_class = functools.partial(parser, client=client)
    return channel


def make_server(app: Flask, gate: Gate, allowed: AllowList, limits: ApiLimits, *,
                host: str, port: int, **adjustments: Any) -> Any:
    """A waitress server for `app`, listening, whose requests pass check_head first."""
    largest = max(body_cap(True, limits), body_cap(False, limits, chat=True))
    adjustments.setdefault("channel_request_lookahead", 1)
    server = create_server(app, host=host, port=port, max_request_body_size=largest + 1,
                           **adjustments)
    if server.adj.send_bytes != 1:  # a streamed event would wait for more to send
        server.close()
        raise RuntimeError(f"waitress buffers {server.adj.send_bytes} bytes before it "
                           "sends; `vlmq api` streams chat answers and needs 1")
    parser = functools.partial(
        GatedParser, check=functools.partial(check_head, gate=gate, allowed=allowed,
                                             limits=limits),
        cap=functools.partial(body_cap, limits=limits))
    server.channel_class = functools.partial(_channel, parser=parser)
    return server
