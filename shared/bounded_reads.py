"""Reading compressed and JSON fields from Redis with hard bounds.

A job hash is written by any producer, so its fields are hostile until checked: 0.97 MB
of zlib can unpack to 1 GB, and JSON nested a million levels deep exhausts the parser.
Everything here fails fast with BoundError (a message naming the limit) instead.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from vlmq.shared import constants as C
from vlmq.shared.errors import VlmqError


class BoundError(VlmqError):
    """A field is over a size or nesting limit; the message names the limit."""


def inflate(raw: bytes, *, cap: int = C.MAX_FIELD_BYTES, what: str = "field") -> bytes:
    """zlib-inflate `raw` to at most `cap` bytes; raw bytes that are not a complete zlib
    stream come back unchanged (RQ's own fallback for plain-JSON producers)."""
    if len(raw) > cap:
        raise BoundError(f"{what} is {len(raw)} bytes, over the {_mib(cap)} limit")
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(raw, cap + 1)
    except zlib.error:
        return raw
    if len(out) > cap or inflater.unconsumed_tail:
        raise BoundError(f"{what} inflates to more than {_mib(cap)} "
                         f"({len(raw)} compressed bytes): refused as a decompression bomb")
    if not inflater.eof:
        return raw  # a truncated stream: RQ falls back to the raw bytes too
    return out


def loads(raw: bytes | str, *, cap: int = C.MAX_FIELD_BYTES, max_depth: int = C.MAX_JSON_DEPTH,
          what: str = "field") -> Any:
    """json.loads with a size cap and a nesting-depth cap (ValueError subclasses for bad JSON)."""
    if len(raw) > cap:
        raise BoundError(f"{what} is {len(raw)} bytes, over the {_mib(cap)} limit")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BoundError(f"{what} nests JSON deeper than {max_depth} levels") from None
    check_depth(value, max_depth, what)
    return value


def check_depth(value: Any, max_depth: int, what: str = "field") -> None:
    """Raise BoundError if `value` nests lists/objects deeper than max_depth (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            raise BoundError(f"{what} nests JSON deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):g} MiB"
