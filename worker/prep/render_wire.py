"""Framing between the worker and its render processes: a JSON header and raw bytes.

Frame: 8-byte big-endian header length, 8-byte body length, the header (a JSON object),
the body. JSON and raw pixels only, so neither side ever unpickles what the other sent.

A file travels as a descriptor instead of bytes (a referenced input's verified copy, which
the child reads as its decoder needs): sent over a Unix socket beside the pipes just
before the frame whose header says `"fd": true`, so the child's copy of the descriptor
is its own and the input never passes through memory on the way.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import IO, Any

_PREFIX = struct.Struct(">QQ")
MAX_HEADER = 64 * 1024
# A render process exits with this code when its memory watchdog fires.
EXIT_OVER_MEMORY = 3


class WireError(Exception):
    """The other side sent a malformed frame or hung up mid-frame."""


def write_msg(out: IO[bytes], header: dict[str, Any], body: bytes = b"") -> None:
    head = json.dumps(header).encode("utf-8")
    out.write(_PREFIX.pack(len(head), len(body)))
    out.write(head)
    if body:
        out.write(body)
    out.flush()


def parse_prefix(prefix: bytes) -> tuple[int, int]:
    head_len, body_len = _PREFIX.unpack(prefix)
    if head_len > MAX_HEADER:
        raise WireError(f"frame header of {head_len} bytes")
    return int(head_len), int(body_len)


def parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"frame header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise WireError("frame header is not a JSON object")
    return header


PREFIX_SIZE = _PREFIX.size


def read_msg(inp: IO[bytes]) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None at a clean end of stream (between frames)."""
    prefix = inp.read(PREFIX_SIZE)
    if not prefix:
        return None
    if len(prefix) < PREFIX_SIZE:
        raise WireError("stream ended inside a frame prefix")
    head_len, body_len = parse_prefix(prefix)
    head = inp.read(head_len)
    body = inp.read(body_len) if body_len else b""
    if len(head) < head_len or len(body) < body_len:
        raise WireError("stream ended inside a frame")
    return parse_header(head), body


def send_fd(sock: socket.socket, fd: int) -> None:
    """Pass a duplicate of `fd` to the other side (SCM_RIGHTS), with one marker byte."""
    socket.send_fds(sock, [b"F"], [fd])


def recv_fd(sock: socket.socket) -> int:
    """The descriptor the other side sent (WireError when none came)."""
    msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if msg != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise WireError("a frame said a descriptor follows, and none came")
    return fds[0]
