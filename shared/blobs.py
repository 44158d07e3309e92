"""Content-addressed blob store: input bytes are uploaded once, whoever enqueues them.

Keys are `<prefix>:blob:<sha256>`, written with SET NX and a TTL, so two producers
enqueueing the same scan upload it once and a worker can trust the hash it fetched.
"""

from __future__ import annotations

import hashlib
from typing import Any

from redis import Redis
from redis.client import Pipeline

from vlmq.shared import constants as C
from vlmq.shared import lua
from vlmq.shared.errors import BlobError
from vlmq.shared.keys import SHA256_RE, Keys


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BlobStore:
    def __init__(self, redis: Redis, keys: Keys, *, ttl_s: int = C.BLOB_TTL_S,
                 max_bytes: int = C.BLOB_MAX_BYTES) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._extend = lua.script(redis, lua.BLOB_EXTEND_TTL)  # sent once, then by sha

    def put(self, data: bytes) -> tuple[str, bool]:
        """Store `data`; returns (sha256, uploaded) where uploaded is False if it was there.

        An existing blob gets its TTL refreshed so that a re-enqueued job never finds its
        input expired midway. The EXISTS check avoids sending bytes Redis already holds.
        """
        self._check(data)
        sha = sha256_hex(data)
        key = self.keys.blob(sha)
        if self.touch(sha):
            return sha, False
        created = self.redis.set(key, data, nx=True, ex=self.ttl_s)
        return sha, bool(created)

    def add(self, data: bytes, *, pipeline: Pipeline) -> str:
        """Queue a SET NX of `data` on `pipeline` (its reply: True when this call stored
        it); for blobs a `touch` just found missing, so no EXISTS round trip is spent."""
        self._check(data)
        sha = sha256_hex(data)
        pipeline.set(self.keys.blob(sha), data, nx=True, ex=self.ttl_s)
        return sha

    def _check(self, data: bytes) -> None:
        if not data:
            raise BlobError("refusing to store an empty blob")
        if len(data) > self.max_bytes:
            raise BlobError(f"blob of {len(data)} bytes is over the {self.max_bytes}-byte limit")

    def touch(self, sha: str, *, pipeline: Pipeline | None = None) -> Any:
        """Make the blob live at least ttl_s more seconds; truthy when it exists.

        Never shortens: one job's short --blob-ttl (or a worker's default touch) must not
        cut the life of a blob that another job asked to keep longer.
        """
        return self._extend(keys=[self.keys.blob(sha)], args=[self.ttl_s * 1000],
                            client=pipeline if pipeline is not None else self.redis)


    def get(self, sha: str) -> bytes:
        """Fetch a blob and check its content against its name."""
        if not SHA256_RE.fullmatch(sha):
            raise BlobError(f"malformed blob id {sha!r}")
        data = self.redis.get(self.keys.blob(sha))
        if data is None:
            raise BlobError(f"blob {sha[:12]}… is missing (expired, or never uploaded)")
        assert isinstance(data, bytes)
        if sha256_hex(data) != sha:
            raise BlobError(f"blob {sha[:12]}… content does not match its sha256")
        return data
