"""Reading compressed and JSON fields from Redis with hard bounds.

A job hash is written by any producer, so its fields are hostile until checked: 0.97 MB
of zlib can unpack to 1 GB, JSON nested a million levels deep exhausts the parser, and an
integer of 4,301 digits makes Python's int() raise. Everything here fails fast with
BoundError (a message naming the limit) instead.
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
    """json.loads with caps on size, nesting depth and number length.

    Text that is not JSON raises json.JSONDecodeError, bytes that are not UTF-8
    UnicodeDecodeError (both ValueError subclasses, for callers that tell "not JSON" from
    "over a limit"); every other failure is a BoundError. Numbers are capped so that
    whatever passes here also passes RQ's own unbounded json.loads of the same field.
    """
    if len(raw) > cap:
        raise BoundError(f"{what} is {len(raw)} bytes, over the {_mib(cap)} limit")
    number = _NumberCap(what)
    try:
        value = json.loads(raw, parse_int=number.integer, parse_float=number.real)
    except RecursionError:
        raise BoundError(f"{what} nests JSON deeper than {max_depth} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except ValueError as exc:  # any other refusal by the parser is a limit, not bad JSON
        raise BoundError(f"{what} cannot be read: {exc}") from None
    check_depth(value, max_depth, what)
    return value


class _NumberCap:
    """json.loads' number hooks, refusing a literal longer than MAX_JSON_NUMBER_CHARS before
    it is converted: int() of 4,301 digits raises, and float() of 400 digits overflows in
    whoever reads the value next."""

    def __init__(self, what: str, limit: int = C.MAX_JSON_NUMBER_CHARS) -> None:
        self.what = what
        self.limit = limit

    def _check(self, literal: str) -> None:
        if len(literal) > self.limit:
            raise BoundError(f"{self.what} holds a number of {len(literal)} characters "
                             f"({literal[:12]}...), over the {self.limit}-character limit")

    def integer(self, literal: str) -> int:
        self._check(literal)
        return int(literal)

    def real(self, literal: str) -> float:
        self._check(literal)
        return float(literal)


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
