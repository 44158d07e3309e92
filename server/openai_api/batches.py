"""An API batch is one vlmq batch: created from an uploaded file, validated off the
request thread exactly as `vlmq enqueue --openai-batch` validates (openai_files), and
read back as OpenAI's Batch object, its status derived from the vlmq batch's running
counts and end (PROTOCOL.md 8b, 9), so `vlmq status`, `wait`, the dashboard and metrics
see the same batch.

The record (api_batch) keeps what the vlmq batch does not: owner, input file, window,
metadata, validation errors, and the lifecycle times vlmq has no event for (cancelling,
expired). A batch that ended has its final figures cached there, read once from the
results, so a finished batch costs one HGETALL to show.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from vlmq.producer.client import Client
from vlmq.producer.job_sets import Batch, BatchNotFound
from vlmq.producer.manifest import ManifestError, TooManyRequests
from vlmq.producer.openai_files import (
    MAX_REASON_CHARS,
    MAX_SKIPPED,
    URL,
    BatchFile,
    ModelPolicy,
    param_of,
    read_batch_file,
    submit_batch_file,
)
from vlmq.producer.options import JobOptions
from vlmq.server.openai_api import outputs
from vlmq.server.openai_api.errors import ApiError, not_found
from vlmq.server.openai_api.files import (
    ERRORS_PREFIX,
    OUTPUT_PREFIX,
    FileStore,
    page_start,
)
from vlmq.server.openai_api.images import batch_spool
from vlmq.shared import constants as C
from vlmq.shared.errors import VlmqError
from vlmq.shared.redis_text import as_str
from vlmq.stores.backends import Stores

log = logging.getLogger("vlmq.api")

# OpenAI's completion windows: "24h" is the only one its API takes.
WINDOWS: Mapping[str, int] = {"24h": 24 * 3600}
RECORD_TTL_S = 30 * 24 * 3600
MAX_METADATA = 16
MAX_META_KEY = 64
MAX_META_VALUE = 512
LABEL = "openai_batch"  # the vlmq batch's label naming its API batch
# What a GET shows in place of an ended vlmq batch's end type.
ENDED_AS = {"expired": "expired", "cancelling": "cancelled"}
TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
         "failed_at", "expired_at", "cancelling_at", "cancelled_at")
# The running counts' states of jobs that have not ended (PROTOCOL.md 8b): a cancelling
# batch with any cancels them again.
NOT_ENDED = ("queued", "started", "deferred", "scheduled")


def batch_error(code: str, message: str, *, param: str | None = None,
                line: int | None = None) -> dict[str, Any]:
    """One entry of a Batch's `errors.data`: OpenAI's BatchError."""
    return {"code": code, "message": message, "param": param, "line": line}


def new_api_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def _now() -> int:
    return int(time.time())


def check_metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs, keys of 64 and values of 512 chars."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_META_KEY
            and len(v) <= MAX_META_VALUE for k, v in value.items()):
        raise ApiError(400, f"metadata must be an object of at most {MAX_METADATA} string "
                            f"pairs, keys up to {MAX_META_KEY} and values up to "
                            f"{MAX_META_VALUE} characters", param="metadata")
    return dict(value)


def check_create(body: Mapping[str, Any]) -> tuple[str, str, dict[str, str] | None]:
    """(input_file_id, completion_window, metadata) of a create request, or 400."""
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise ApiError(400, f"Missing required parameter: '{name}'.", param=name)
    if body["endpoint"] != URL:
        raise ApiError(400, f"endpoint must be '{URL}': vlmq serves chat completions "
                            f"(got {body['endpoint'][:100]!r})", param="endpoint")
    if body["completion_window"] not in WINDOWS:
        raise ApiError(400, f"completion_window must be one of {', '.join(WINDOWS)} (got "
                            f"{body['completion_window'][:100]!r})",
                       param="completion_window")
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window",
                                  "metadata", "output_expires_after"})
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0][:100]}",
                       param=unknown[0][:100])
    return body["input_file_id"], body["completion_window"], check_metadata(body.get("metadata"))


class Batches:
    """The API's batches over one Redis: create, read, list, cancel, expire."""

    def __init__(self, client: Client, files: FileStore, *, spool: Path, stores: Stores,
                 run: Executor, models: ModelPolicy | None = None,
                 clock: Callable[[], int] = _now) -> None:
        self.client = client
        self.redis = client.redis
        self.keys = client.keys
        self.files = files
        self.spool = spool
        self.spool.mkdir(parents=True, exist_ok=True)
        self.stores = stores
        self.run = run
        self.models = models or ModelPolicy()
        self.clock = clock

    # --- create and validate ----------------------------------------------------------

    def create(self, owner: str, body: Mapping[str, Any]) -> dict[str, Any]:
        file_id, window, metadata = check_create(body)
        stored = self.files.get(file_id, owner)
        if stored.purpose != "batch":
            raise ApiError(400, f"file {file_id} has purpose {stored.purpose!r}, not "
                                "'batch'", param="input_file_id")
        batch_id = new_api_batch_id()
        now = self.clock()
        record = {"owner": owner, "input_file_id": file_id, "completion_window": window,
                  "metadata": json.dumps(metadata), "status": "validating",
                  "created_at": now, "expires_at": now + WINDOWS[window]}
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.api_batch(batch_id), mapping=record)  # type: ignore[arg-type]
        pipe.expire(self.keys.api_batch(batch_id), RECORD_TTL_S)
        pipe.zadd(self.keys.api_batches(owner), {batch_id: time.time() * 1000})
        pipe.expire(self.keys.api_batches(owner), RECORD_TTL_S)
        pipe.execute()
        self.run.submit(self.validate, batch_id, self.files.path(file_id), file_id)
        return self.get(owner, batch_id)

    def validate(self, batch_id: str, path: Path, file_id: str) -> None:
        """Read the file as --openai-batch does; enqueue it, or fail it with every bad
        line. Runs on the executor: a 200 MB file takes the time its lines take. It always
        ends `validating`: a failure no check foresaw fails the batch, and is logged."""
        try:
            self._validate(batch_id, path, file_id)
        except Exception as exc:  # a batch must never stay validating: fail it, logged
            log.exception("batch %s: validation failed unexpectedly", batch_id)
            try:
                self._fail(batch_id, [batch_error(
                    "server_error", f"validation failed unexpectedly "
                                    f"({type(exc).__name__}); the server's log says why")])
            except RedisError as again:
                log.error("batch %s: cannot record its failure: %s", batch_id, again)

    def _labels(self, batch_id: str) -> dict[str, str]:
        """The API batch's jobs' labels: the batch, and its key's owner as their tenant, so
        the key's batches take one fair turn together at the workers."""
        owner = as_str(self.redis.hget(self.keys.api_batch(batch_id), "owner") or b"")
        return {LABEL: batch_id, **({C.TENANT_LABEL: owner} if owner else {})}

    def _validate(self, batch_id: str, path: Path, file_id: str) -> None:
        key = self.keys.api_batch(batch_id)
        labels = self._labels(batch_id)
        try:
            read = read_batch_file(path, JobOptions.build(labels=labels),
                                   spool=batch_spool(self.spool, batch_id), skip_bad=True,
                                   models=self.models,
                                   paths=False)
        except (VlmqError, OSError) as exc:
            self._fail(batch_id, _read_errors(exc, str(path), file_id))
            return
        if read.skipped:
            self._fail(batch_id, [batch_error("invalid_request", s.reason, param=s.param,
                                              line=s.line) for s in read.skipped])
            return
        if self.redis.hexists(key, "cancelling_at"):  # cancelled while it was read
            self.redis.hset(key, mapping={"status": "cancelled",
                                          "cancelled_at": self.clock()})
            return
        made = self._submit(batch_id, read, path, file_id, labels)
        if made is None:
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping={"status": "enqueued", "vlmq_batch": made.id,
                                "total": len(read.lines), "in_progress_at": self.clock()})
        pipe.sadd(self.keys.api_live, batch_id)
        pipe.execute()
        if self.redis.hexists(key, "cancelling_at"):
            made.cancel()  # cancelled while it was enqueued

    def _submit(self, batch_id: str, read: BatchFile, path: Path, file_id: str,
                labels: dict[str, str]) -> Batch | None:
        """The read file enqueued, or None with the batch failed saying why."""
        try:
            return submit_batch_file(self.client, read, labels=labels,
                                     stores=self.stores)
        except (VlmqError, OSError) as exc:
            self._fail(batch_id, _read_errors(exc, str(path), file_id))
        except RedisError as exc:
            log.error("batch %s: Redis failed during enqueue: %s", batch_id, exc)
            self._fail(batch_id, [batch_error("server_error", f"Redis: {exc}")])
        return None

    def _fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        self.redis.hset(self.keys.api_batch(batch_id), mapping={
            "status": "failed", "failed_at": self.clock(), "errors": json.dumps(errors)})

    # --- read -----------------------------------------------------------------------

    def record(self, owner: str, batch_id: str) -> dict[str, str]:
        raw = {as_str(k): as_str(v) for k, v in
               self.redis.hgetall(self.keys.api_batch(batch_id)).items()}
        if raw.get("owner") != owner:
            raise not_found("batch", batch_id)
        return raw

    def get(self, owner: str, batch_id: str) -> dict[str, Any]:
        """OpenAI's Batch object of an API batch of the caller's: any other id (another
        key's, a vlmq batch's `b-...`, whoever made it) is 404."""
        rec = self.record(owner, batch_id)
        self._settle(batch_id, rec)
        return self.shape(batch_id, rec)

    def _settle(self, batch_id: str, rec: dict[str, str]) -> None:
        """Bring the record up to date: expire it past its window, finish a cancel (or an
        expiry) some job escaped (it was being taken, or enqueued, meanwhile), cache its
        end."""
        if rec.get("status") != "enqueued" or "ended_at" in rec:
            return
        vlmq_batch = rec["vlmq_batch"]
        end = self._end(vlmq_batch)
        if end is None:
            if self.clock() >= int(rec["expires_at"]) and "expired_at" not in rec:
                rec["expired_at"] = str(self.clock())
                self.redis.hset(self.keys.api_batch(batch_id), "expired_at", rec["expired_at"])
                self._cancel_vlmq(vlmq_batch)
            elif ("cancelling_at" in rec or "expired_at" in rec) \
                    and self._not_ended(vlmq_batch):
                self._cancel_vlmq(vlmq_batch)
            return
        when, ended_as = end
        figures = outputs.tally(self.client, vlmq_batch, expired="expired_at" in rec)
        fields = {**{k: str(v) for k, v in figures.items()}, "ended_at": str(when),
                  "ended_as": ended_as}
        rec.update(fields)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.api_batch(batch_id), mapping=fields)  # type: ignore[arg-type]
        pipe.srem(self.keys.api_live, batch_id)
        pipe.execute()

    def _end(self, vlmq_batch: str) -> tuple[int, str] | None:
        """When the vlmq batch ended (its events stream's first entry: Redis's clock), and
        how (finished, failed, canceled)."""
        entries: Any = self.redis.xrange(self.keys.batch_events(vlmq_batch), count=1)
        if not entries:
            return None
        fields = {as_str(k): as_str(v) for k, v in entries[0][1].items()}
        return int(as_str(entries[0][0]).split("-")[0]) // 1000, fields.get("type", "")

    def _not_ended(self, vlmq_batch: str) -> bool:
        """Whether any of the batch's jobs is counted in a state that is no end."""
        raw = self.redis.hmget(self.keys.batch_counts(vlmq_batch), NOT_ENDED)
        return any(int(n or 0) > 0 for n in raw)

    def _cancel_vlmq(self, vlmq_batch: str) -> None:
        """Cancel every job of the vlmq batch that has not ended; a job that ends
        meanwhile is left as it ended (job_admin.cancel)."""
        try:
            Batch.load(self.client, vlmq_batch).cancel()
        except BatchNotFound:
            log.warning("vlmq batch %s is gone; nothing to cancel", vlmq_batch)

    def _status(self, rec: Mapping[str, str]) -> str:
        status = rec.get("status", "failed")
        if status == "validating" and "cancelling_at" in rec:
            return "cancelling"
        if status != "enqueued":
            return status
        for field_name, shown in (("expired_at", "expired"), ("cancelling_at", "cancelled")):
            if field_name in rec:
                if "ended_at" not in rec:
                    return "cancelling" if shown == "cancelled" else "finalizing"
                # A cancel that came as the last job finished cancelled nothing.
                if shown == "cancelled" and rec.get("ended_as") == "finished":
                    return "completed"
                return shown
        return "completed" if "ended_at" in rec else "in_progress"

    def _counts(self, rec: Mapping[str, str]) -> dict[str, int]:
        total = int(rec.get("total", "0"))
        if "ended_at" in rec:
            return {"total": total, "completed": int(rec["completed"]),
                    "failed": int(rec["failed"])}
        if "vlmq_batch" not in rec:
            return {"total": total, "completed": 0, "failed": 0}
        raw = self.redis.hgetall(self.keys.batch_counts(rec["vlmq_batch"]))
        counts = {as_str(k): int(v) for k, v in raw.items()}
        done, failed = counts.get("items_done", 0), counts.get("items_failed", 0)
        return {"total": total, "completed": done - failed, "failed": failed}

    def shape(self, batch_id: str, rec: Mapping[str, str]) -> dict[str, Any]:
        status = self._status(rec)
        ended = rec.get("ended_at")
        times: dict[str, int | None] = {t: int(rec[t]) if t in rec else None for t in TIMES}
        if ended is not None:  # the end: when results were final, and what it ended as
            at = {"completed": ("finalizing_at", "completed_at"),
                  "cancelled": ("cancelled_at",), "expired": ("finalizing_at",)}
            times.update(dict.fromkeys(at.get(status, ()), int(ended)))
        errors = json.loads(rec["errors"]) if "errors" in rec else None
        has_errors = ended is not None and int(rec.get("err_bytes", "0")) > 0
        return {"id": batch_id, "object": "batch", "endpoint": URL,
                "errors": {"object": "list", "data": errors} if errors else None,
                "input_file_id": rec.get("input_file_id", ""),
                "completion_window": rec.get("completion_window", "24h"),
                "status": status,
                "output_file_id": OUTPUT_PREFIX + batch_id if ended is not None else None,
                "error_file_id": ERRORS_PREFIX + batch_id if has_errors else None,
                **times, "request_counts": self._counts(rec),
                "metadata": json.loads(rec.get("metadata") or "null")}

    def list(self, owner: str, *, after: str | None, limit: int
             ) -> tuple[list[dict[str, Any]], bool]:
        """The caller's batches, newest first, after `after`."""
        index = self.keys.api_batches(owner)
        start = page_start(self.redis, index, after, "batch")
        members: Any = self.redis.zrevrange(index, start, start + limit)
        ids = [as_str(m) for m in members]
        page: list[dict[str, Any]] = []
        for batch_id in ids[:limit]:
            try:
                page.append(self.get(owner, batch_id))
            except ApiError:
                continue  # its record expired
        return page, len(ids) > limit

    # --- cancel and expire ------------------------------------------------------------

    def cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        rec = self.record(owner, batch_id)
        self._settle(batch_id, rec)
        status = self._status(rec)
        if status not in ("validating", "in_progress", "cancelling"):
            raise ApiError(409, f"Cannot cancel a batch with status '{status}'.")
        key = self.keys.api_batch(batch_id)
        self.redis.hsetnx(key, "cancelling_at", self.clock())
        # Read after the write: validation writes vlmq_batch, then reads cancelling_at, so
        # one of the two sees the other and the jobs are cancelled either way.
        vlmq_batch = self.redis.hget(key, "vlmq_batch")
        if vlmq_batch is not None:
            self._cancel_vlmq(as_str(vlmq_batch))
        return self.get(owner, batch_id)

    def sweep(self) -> int:
        """Settle every live batch (expire those past their window, cache the ends);
        returns how many are still live."""
        live = [as_str(m) for m in self.redis.smembers(self.keys.api_live)]
        for batch_id in live:
            rec = {as_str(k): as_str(v) for k, v in
                   self.redis.hgetall(self.keys.api_batch(batch_id)).items()}
            if not rec:
                self.redis.srem(self.keys.api_live, batch_id)
                continue
            self._settle(batch_id, rec)
        return int(self.redis.scard(self.keys.api_live))

    def file_source(self, owner: str, file_id: str) -> tuple[str, str, bool, int, int]:
        """A virtual file: (the vlmq batch, API batch id, whether errors, bytes, when)."""
        errors = file_id.startswith(ERRORS_PREFIX)
        batch_id = file_id[len(ERRORS_PREFIX if errors else OUTPUT_PREFIX):]
        try:
            shown = self.get(owner, batch_id)
        except ApiError:
            raise not_found("file", file_id) from None
        if shown[("error" if errors else "output") + "_file_id"] != file_id:
            raise not_found("file", file_id)
        rec = self.record(owner, batch_id)
        size = int(rec["err_bytes" if errors else "out_bytes"])
        when = shown["finalizing_at"] or shown["cancelled_at"] or 0
        return rec["vlmq_batch"], batch_id, errors, size, int(when)

    def expired(self, owner: str, batch_id: str) -> bool:
        return "expired_at" in self.record(owner, batch_id)


def _read_errors(exc: VlmqError | OSError, path: str, file_id: str) -> list[dict[str, Any]]:
    """A file refused whole as a Batch's errors: OpenAI's codes where it has one (too many
    requests, an empty file), each bad line of a file with no good one, else the reason
    (naming the file by its id, not the server's path)."""
    if isinstance(exc, TooManyRequests):
        return [batch_error("too_many_tasks", exc.problem, line=exc.line)]
    if isinstance(exc, ManifestError):
        return [batch_error("empty_file", "the file has no requests") if n == 0 else
                batch_error("invalid_request", why[:MAX_REASON_CHARS], param=param_of(why),
                            line=n)
                for n, why in exc.errors[:MAX_SKIPPED]]
    return [batch_error("invalid_file", str(exc).replace(path, file_id))]

