"""Uploaded files: the bytes in the server's folder (hashed while written), the metadata
in Redis (api_file, api_files). OpenAI's FileObject is what every route answers. What a
key may keep (files, bytes, one file's size) is its ApiLimits (limits.py)."""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from redis import Redis

from vlmq.server.openai_api.errors import ApiError, not_found
from vlmq.server.openai_api.limits import ApiLimits
from vlmq.shared.keys import Keys
from vlmq.shared.redis_text import as_str

CHUNK = 1 << 20
PURPOSES = ("batch",)
MAX_FILENAME = 255
# Virtual files: a batch's output and errors, made from its results when read.
OUTPUT_PREFIX = "file-out-"
ERRORS_PREFIX = "file-err-"


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    sha256: str

    def object(self) -> dict[str, Any]:
        """OpenAI's FileObject."""
        return file_object(self.id, self.bytes, self.created_at, self.filename, self.purpose)


def file_object(file_id: str, size: int, created_at: int, filename: str,
                purpose: str) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at,
            "filename": filename, "purpose": purpose, "status": "processed",
            "status_details": None, "expires_at": None}


def page_start(redis: Redis, index: str, after: str | None, kind: str) -> int:
    """Where a newest-first page of an owner's index starts: just past `after` (OpenAI's
    cursor), 0 without one; an `after` not in the index is a 404 of that kind."""
    if not after:
        return 0
    rank: Any = redis.zrevrank(index, after)
    if rank is None:
        raise not_found(kind, after)
    return int(rank) + 1


class FileStore:
    """The folder and the metadata, together: one upload is one file and one hash."""

    def __init__(self, redis: Redis, keys: Keys, folder: Path,
                 limits: ApiLimits | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.limits = limits or ApiLimits()
        self.uploads = folder / "uploads"
        self.uploads.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.uploads / file_id

    def check_room(self, owner: str, incoming: int) -> None:
        """400 when `owner` keeps its limit of files, or `incoming` more bytes would take it
        past its limit of bytes: asked before an upload's form is read. Two uploads at once
        may each fit and together pass it, by an upload each at most (the key's uploads
        at once are bounded)."""
        limits = self.limits
        members: Any = self.redis.zrange(self.keys.api_files(owner), 0, -1)
        if len(members) >= limits.files_per_key:
            raise ApiError(400, f"This key keeps {len(members)} files, this server's limit "
                                f"({limits.files_per_key}): delete one to upload another.",
                           code="quota_exceeded")
        pipe = self.redis.pipeline(transaction=False)
        for member in members:
            pipe.hget(self.keys.api_file(as_str(member)), "bytes")
        kept = sum(int(b) for b in pipe.execute() if b is not None and as_str(b).isdigit())
        if kept + incoming > limits.stored_bytes_per_key:
            raise ApiError(400, f"This key keeps {kept:,} bytes of files; {incoming:,} more "
                                f"would pass this server's limit of "
                                f"{limits.stored_bytes_per_key:,} bytes a key: delete some "
                                "files first.", code="quota_exceeded")

    def save(self, stream: IO[bytes], filename: str, purpose: str, owner: str) -> StoredFile:
        """Copy an upload into the folder in chunks, hashing it; 413 past the limit."""
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose must be one of {', '.join(PURPOSES)}: vlmq serves "
                                f"the Batch API (got {purpose!r})", param="purpose")
        file_id = new_file_id()
        final = self.path(file_id)
        temp = final.with_name(f".{file_id}.part")
        sha = hashlib.sha256()
        size = 0
        try:
            with temp.open("wb") as out:
                while chunk := stream.read(CHUNK):
                    size += len(chunk)
                    if size > self.limits.upload_bytes:
                        raise ApiError(413, f"the file is larger than "
                                            f"{self.limits.upload_bytes:,} bytes, this "
                                            "server's limit for an upload", param="file")
                    sha.update(chunk)
                    out.write(chunk)
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        stored = StoredFile(file_id, owner, filename[:MAX_FILENAME] or "upload.jsonl",
                            purpose, size, int(time.time()), sha.hexdigest())
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.api_file(file_id), mapping={
            "owner": owner, "filename": stored.filename, "purpose": purpose, "bytes": size,
            "created_at": stored.created_at, "sha256": stored.sha256})
        pipe.zadd(self.keys.api_files(owner), {file_id: time.time() * 1000})
        pipe.execute()
        return stored

    def get(self, file_id: str, owner: str) -> StoredFile:
        """The caller's file; 404 for another key's as for none."""
        raw = {as_str(k): as_str(v) for k, v in
               self.redis.hgetall(self.keys.api_file(file_id)).items()}
        if raw.get("owner") != owner:
            raise not_found("file", file_id)
        return StoredFile(file_id, owner, raw["filename"], raw["purpose"], int(raw["bytes"]),
                          int(raw["created_at"]), raw["sha256"])

    def list(self, owner: str, *, after: str | None, limit: int,
             purpose: str | None) -> tuple[list[StoredFile], bool]:
        """The caller's files, newest first, after `after`; (page, more after it)."""
        index = self.keys.api_files(owner)
        start = page_start(self.redis, index, after, "file")
        found: list[StoredFile] = []
        more = False
        members: Any = self.redis.zrevrange(index, start, -1)
        for member in members:
            stored = self._quiet_get(as_str(member), owner)
            if stored is None or (purpose and stored.purpose != purpose):
                continue
            if len(found) == limit:
                more = True
                break
            found.append(stored)
        return found, more

    def _quiet_get(self, file_id: str, owner: str) -> StoredFile | None:
        try:
            return self.get(file_id, owner)
        except ApiError:
            return None

    def delete(self, file_id: str, owner: str) -> None:
        self.get(file_id, owner)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.api_file(file_id))
        pipe.zrem(self.keys.api_files(owner), file_id)
        pipe.execute()
        self.path(file_id).unlink(missing_ok=True)
