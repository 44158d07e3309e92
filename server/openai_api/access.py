"""API keys: who a request is. Each key owns what it uploads and creates; Redis stores a
key's digest (never the key), so a Redis reader learns no key, and records name their
owner by it.

Keys follow the dashboard's rules, from its one owner (dashboard/trust.py): a weak key is
refused at start, and wrong keys are counted per client address, which gets 429 after
too many. The Gate is what both the server's early check (server.py, before a body is
read) and the app's own check ask.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from vlmq.server.dashboard.trust import TOKEN_RULE, FailureLimit, token_strength
from vlmq.server.openai_api.errors import ApiError

log = logging.getLogger("vlmq.api")

KEYS_ENV = "VLMQ_API_KEYS"
NO_KEY = "You didn't provide an API key. Give it as 'Authorization: Bearer KEY'."
WRONG_KEY = "Incorrect API key provided."


def digest(key: str) -> str:
    """The owner name a key's records carry: 128 bits of its sha256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def check_key(key: str, where: str) -> None:
    """ValueError when `key` is too weak to guard the API (the dashboard's token rule) or
    holds a space; the message names where, never the key."""
    weak = "it holds a space" if any(c.isspace() for c in key) else token_strength(key)
    if weak is not None:
        raise ValueError(f"{where} is too weak ({weak}): {TOKEN_RULE}")


def parse_keys(lines: Iterable[str], where: str) -> list[str]:
    """Keys from a file's lines (blank lines and # comments left out) or the env form;
    ValueError names a weak key by its line, never its text."""
    keys: list[str] = []
    for number, raw in enumerate(lines, 1):
        key = raw.strip()
        if not key or key.startswith("#"):
            continue
        check_key(key, f"{where}: key {number}")
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
    """The keys a server accepts, compared in constant time; ValueError for a weak one."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests: dict[str, bytes] = {}
        for number, key in enumerate(keys, 1):
            check_key(key, f"API key {number}")
            self._digests[digest(key)] = key.encode()

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


class Gate:
    """Who may be answered, asked as soon as a request's headers are in: its key (wrong
    ones counted per client address, as the dashboard counts wrong tokens) and, for an
    upload, the key's uploads on the wire. Thread-safe: the server asks from its I/O
    thread, the app from its workers."""

    def __init__(self, keys: Iterable[str], *, uploads_per_key: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ring = KeyRing(keys)
        self.failures = FailureLimit(clock)
        self.uploads_per_key = uploads_per_key
        self._uploads: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, authorization: str | None, client: str) -> str:
        """The key's owner name; ApiError 401 for no key or a wrong one, 429 while the
        client is over its wrong keys, unchecked (so a right guess is not told so)."""
        wait = self.failures.retry_after(client)
        if wait is not None:
            raise ApiError(429, f"Too many wrong API keys from your address: try again in "
                                f"{wait} s.", code="rate_limit_exceeded", retry_after=wait)
        owner = self.ring.owner(authorization)
        if owner is not None:
            return owner
        if not authorization:
            raise ApiError(401, NO_KEY)
        count = self.failures.failed(client)
        log.warning("wrong API key from %s (%d of %d allowed per %d s)", client, count,
                    self.failures.allowed, self.failures.window_s)
        raise ApiError(401, WRONG_KEY, code="invalid_api_key")

    def start_upload(self, owner: str) -> Callable[[], None]:
        """Count an upload of `owner`'s on the wire; the function returned ends it (once,
        however often called). ApiError 429 when the key has its limit on the wire."""
        with self._lock:
            if self._uploads.get(owner, 0) >= self.uploads_per_key:
                raise ApiError(429, f"This key already has {self.uploads_per_key} uploads "
                                    "on the way; send the next when one has ended.",
                               code="rate_limit_exceeded", retry_after=1)
            self._uploads[owner] = self._uploads.get(owner, 0) + 1
        ended = threading.Event()

        def end() -> None:
            with self._lock:
                if ended.is_set():
                    return
                ended.set()
                left = self._uploads.get(owner, 1) - 1
                if left:
                    self._uploads[owner] = left
                else:
                    self._uploads.pop(owner, None)

        return end

    def uploads(self, owner: str) -> int:
        with self._lock:
            return self._uploads.get(owner, 0)
