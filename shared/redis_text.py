"""Redis hands back bytes or str depending on how the connection was made; readers want str.

One helper so that every reader treats undecodable bytes the same way: replaced, not fatal,
since these values are shown to people (stats, stream ids, names) rather than parsed as data.
"""

from __future__ import annotations


def as_str(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
