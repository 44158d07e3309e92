"""Content-addressed blob store: input bytes are uploaded once, whoever enqueues them.

Keys are `<prefix>:blob:<sha256>`, written with SET NX and a TTL, so two producers
enqueueing the same scan upload it once and a worker can trust the hash it fetched.

A blob's life follows the jobs that use it (PROTOCOL.md section 2). It is uploaded with a
short TTL (UPLOAD_TTL_S), so an upload that never becomes a job (Ctrl-C, a crash, Redis out
of memory) leaves nothing that lasts. Enqueueing a job holds its blobs, in the same MULTI:
`<prefix>:blob-jobs:<sha>` (zset of job ids) and `<prefix>:job:<id>:inputs` (hash of the
job's blobs), and the blob then lives the job's blob_ttl. When a job ends, end_job.lua lets
go; a deleted job lets go through `release` (blob_release.lua: the same Lua). A blob no
live job holds expires after the last holder's keep_inputs, or with a failed holder's
failure record if that is later.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from typing import Any

from redis import Redis
from redis.client import Pipeline

from vlmq.shared import constants as C
from vlmq.shared import lua
from vlmq.shared.errors import BlobError
from vlmq.shared.keys import SHA256_RE, Keys

# Lifetime of an upload no job holds yet: long enough to upload one chunk and enqueue it,
# short enough that an enqueue that failed or was interrupted leaves nothing that stays.
UPLOAD_TTL_S = 600

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
        self._release = lua.script(redis, lua.BLOB_RELEASE)

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
        return self._extend(keys=[self.keys.blob(sha), self.keys.blob_jobs(sha)],
                            args=[self.ttl_s * 1000],
                            client=pipeline if pipeline is not None else self.redis)

    def hold(self, job_id: str, shas: Iterable[str], *, keep_s: int,
             pipeline: Pipeline) -> None:
        """Queue on `pipeline` (the MULTI that enqueues the job) the job's hold on its
        blobs: each lives at least ttl_s (the job's blob_ttl) while the job does.

        keep_s is the job's keep_inputs, kept per blob so that end_job.lua, which sees only
        keys, knows how long the blob stays once this job lets go of it.
        """
        wanted = sorted(set(shas))
        if not wanted:
            return
        inputs = self.keys.job_inputs(job_id)
        for sha in wanted:
            pipeline.zadd(self.keys.blob_jobs(sha), {job_id: math.inf})
        pipeline.hset(inputs, mapping=dict.fromkeys(wanted, keep_s))
        for sha in wanted:
            self.touch(sha, pipeline=pipeline)
        pipeline.pexpire(inputs, self.ttl_s * 1000)

    def release(self, job_id: str) -> int:
        """Let go of a deleted job's blobs; returns how many it held.

        blob_release.lua runs the very Lua end_job.lua runs for a job that finishes (the
        shared BLOBS block), atomically: expired holds go first, a blob that another live
        job holds keeps its TTL, otherwise it expires after this job's keep_inputs or when
        the latest failed holder's record does.
        """
        held = self._release(keys=[self.keys.job_inputs(job_id)], args=[job_id])
        return int(held)

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
