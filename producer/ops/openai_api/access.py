"""API keys: who a request is. Each key owns what it uploads and creates; Redis stores a
key's digest (never the key), so a Redis reader learns no key, and records name their
owner by it."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

KEYS_ENV = "VLMQ_API_KEYS"
MIN_KEY_CHARS = 8


def digest(key: str) -> str:
    """The owner name a key's records carry: 128 bits of its sha256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def parse_keys(lines: Iterable[str], where: str) -> list[str]:
    """Keys from a file's lines (blank lines and # comments left out) or the env form;
    ValueError names a key too short to be one (by its line, never its text)."""
    keys: list[str] = []
    for number, raw in enumerate(lines, 1):
        key = raw.strip()
        if not key or key.startswith("#"):
            continue
        if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
            raise ValueError(f"{where}: key {number} is shorter than {MIN_KEY_CHARS} "
                             "characters or holds a space")
        keys.append(key)
    return keys


def load_keys(path: str | Path | None, env: Mapping[str, str] = os.environ) -> list[str]:
    """--api-keys FILE (one key a line), else VLMQ_API_KEYS=k1,k2; ValueError if neither
    gives a key: an API without keys would answer anyone."""
    if path is not None:
        keys = parse_keys(Path(path).read_text().splitlines(), str(path))
    else:
        keys = parse_keys(env.get(KEYS_ENV, "").split(","), KEYS_ENV)
    if not keys:
        raise ValueError(f"no API keys: give --api-keys FILE (one a line) or {KEYS_ENV}=k1,k2")
    return keys


class KeyRing:
    """The keys a server accepts, compared in constant time."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = {digest(k): k.encode() for k in keys}

    def owner(self, authorization: str | None) -> str | None:
        """The owner for an `Authorization: Bearer KEY` header; None for none or a wrong
        key."""
        if not authorization:
            return None
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        raw = given.strip().encode()
        found = None
        for name, key in self._digests.items():
            if hmac.compare_digest(raw, key):
                found = name
        return found
