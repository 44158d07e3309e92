"""Content-addressed blob store: input bytes are uploaded once, whoever enqueues them.

Keys are `<prefix>:blob:<sha256>`, written with SET NX and a TTL, so two producers
enqueueing the same scan upload it once and a worker can trust the hash it fetched.

A blob's life follows the jobs that use it (PROTOCOL.md section 2). It is uploaded with a
short TTL (UPLOAD_TTL_S), so an upload that never becomes a job (Ctrl-C, a crash, Redis out
of memory) leaves nothing that lasts. Enqueueing a job holds its blobs, in the same MULTI:
`<prefix>:blob-jobs:<sha>` (zset of job ids) and `<prefix>:job:<id>:inputs` (hash of the
job's blobs), and the blob then lives the job's blob_ttl. When a job ends, end_job.lua lets
go; a deleted job lets go through `release`. A blob no live job holds expires after the
last holder's keep_inputs, or with a failed holder's failure record if that is later.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from typing import Any

from redis import Redis, WatchError
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

        The rule of end_job.lua's inputs block (a finished job), in one WATCH transaction:
        a blob that another live job holds keeps its TTL; otherwise it expires after this
        job's keep_inputs, or when the latest failed holder's record does.
        """
        inputs = self.keys.job_inputs(job_id)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(inputs)  # type: ignore[no-untyped-call]
                    held = {_text(k): int(v) for k, v in pipe.hgetall(inputs).items()}
                    holders = [self.keys.blob_jobs(sha) for sha in held]
                    if holders:
                        pipe.watch(*holders)  # type: ignore[no-untyped-call]
                    self._queue_release(pipe, job_id, held)
                    pipe.execute()
                    return len(held)
                except WatchError:
                    continue

    def _queue_release(self, pipe: Pipeline, job_id: str, held: dict[str, int]) -> None:
        secs, micros = self.redis.time()
        now_ms = secs * 1000 + micros // 1000
        reads = self.redis.pipeline(transaction=False)
        for sha in held:  # the two latest holds: one of them may be this job's own
            reads.zrevrangebyscore(self.keys.blob_jobs(sha), "+inf", now_ms, start=0, num=2,
                                   withscores=True)
        tops = reads.execute() if held else []
        pipe.multi()
        for (sha, keep_s), top in zip(held.items(), tops, strict=True):
            others = [score for member, score in top if _text(member) != job_id]
            holders = self.keys.blob_jobs(sha)
            pipe.zrem(holders, job_id)
            if others and math.isinf(others[0]):
                continue  # a live job holds it: never shortened
            ms = max(keep_s * 1000, int(others[0]) - now_ms if others else 0)
            pipe.pexpire(self.keys.blob(sha), ms)
            pipe.pexpire(holders, ms)
        pipe.delete(self.keys.job_inputs(job_id))


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


def _text(raw: bytes | str) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
