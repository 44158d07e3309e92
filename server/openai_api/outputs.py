"""A batch's output and error files, made from its results when read (nothing is written
twice): the `openai-batch` format's lines (producer/ops/output_formats.py), in input
order, split as OpenAI splits them. An expired batch's lines that never ran carry
OpenAI's `batch_expired` rather than the `batch_cancelled` of a cancel.

Results live for their jobs' result_ttl (7 days unless set), API records 30 days: a file
asked for once its results are gone, or some of them, must not go out short. So a file
is made whole before its first byte is sent (in a spooled temporary file), and it goes
out only when it has the bytes its batch ended with; otherwise the answer is an error
saying the results expired, and the batch says so from then on (its `errors`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from redis import Redis

from vlmq.producer.client import Client
from vlmq.producer.errors import JobNotFound
from vlmq.producer.job_sets import Batch
from vlmq.producer.ops.output_formats import JobResults, openai_output
from vlmq.shared.keys import Keys
from vlmq.shared.redis_text import as_str

EXPIRED_MESSAGE = ("This request could not be executed before the completion window "
                   "expired.")
IN_MEMORY = 8 << 20  # a file this size is made in memory; a larger one on disk
GONE_CODE = "results_expired"


def batch_lines(client: Client, batch_id: str, *, expired: bool = False
                ) -> Iterator[tuple[bool, str]]:
    """(ok, line) for every line of a vlmq batch, in input order."""
    views = [JobResults.read(job) for job in Batch.load(client, batch_id).jobs()]
    for ok, line in openai_output(views):
        if expired and not ok and '"batch_cancelled"' in line:
            entry = json.loads(line)
            if entry.get("error", {}).get("code") == "batch_cancelled":
                entry["error"] = {"code": "batch_expired", "message": EXPIRED_MESSAGE}
                line = json.dumps(entry) + "\n"
        yield ok, line


def file_lines(client: Client, batch_id: str, *, errors: bool,
               expired: bool = False) -> Iterator[bytes]:
    """The output file's lines (errors=False) or the error file's, encoded."""
    for ok, line in batch_lines(client, batch_id, expired=expired):
        if ok != errors:
            yield line.encode()


def tally(client: Client, batch_id: str, *, expired: bool = False) -> dict[str, int]:
    """An ended batch's final figures, read once: lines and bytes of each file."""
    out = {"completed": 0, "failed": 0, "out_bytes": 0, "err_bytes": 0}
    for ok, line in batch_lines(client, batch_id, expired=expired):
        size = len(line.encode())
        if ok:
            out["completed"] += 1
            out["out_bytes"] += size
        else:
            out["failed"] += 1
            out["err_bytes"] += size
    return out


class ResultsGone(Exception):
    """The results a batch's file is made from are gone (expired, or deleted)."""


def whole_file(client: Client, batch_id: str, *, errors: bool, expired: bool,
               size: int) -> IO[bytes]:
    """The output (or error) file, made whole and rewound: ResultsGone unless it has the
    `size` bytes figured when the batch ended (a job gone leaves its lines out)."""
    out = tempfile.SpooledTemporaryFile(max_size=IN_MEMORY)  # noqa: SIM115  # the caller's
    whole = False
    try:
        for line in file_lines(client, batch_id, errors=errors, expired=expired):
            out.write(line)
            if out.tell() > size:
                break
        whole = out.tell() == size
    except JobNotFound:
        pass  # whole stays False: the batch (or a job) expired with its results
    finally:
        if not whole:
            out.close()
    if not whole:
        raise ResultsGone(batch_id)
    out.seek(0)
    return out


def gone_error(batch_id: str) -> dict[str, Any]:
    """The BatchError a batch whose results expired shows."""
    return {"code": GONE_CODE, "param": None, "line": None, "message": (
        f"The results of batch {batch_id} have expired: vlmq keeps a job's results for its "
        "result_ttl (7 days unless the job set another) and an API batch's record for 30 "
        "days, so its output and error files can no longer be made.")}


def mark_gone(redis: Redis, keys: Keys, batch_id: str) -> None:
    """The batch says its results expired (as its `errors`), from now on; a record that
    expired meanwhile is not made again (it would have no TTL)."""
    key = keys.api_batch(batch_id)
    if redis.hexists(key, "owner"):
        redis.hset(key, "errors", json.dumps([gone_error(batch_id)]))


def note_gone(client: Client, shown: list[dict[str, Any]]) -> None:
    """Ended batches whose vlmq batch is gone (its record expires with its results) say
    their results expired: two pipelined round trips for a page, none for a batch that
    has not ended or already says so."""
    ended = [b for b in shown if b.get("output_file_id") and not b.get("errors")]
    if not ended:
        return
    redis, keys = client.redis, client.keys
    pipe = redis.pipeline(transaction=False)
    for batch in ended:
        pipe.hget(keys.api_batch(batch["id"]), "vlmq_batch")
    vlmq_ids = pipe.execute()
    pipe = redis.pipeline(transaction=False)
    for vlmq_batch in vlmq_ids:
        pipe.exists(keys.batch(as_str(vlmq_batch or b"")))
    for batch, present in zip(ended, pipe.execute(), strict=True):
        if not present:
            mark_gone(redis, keys, batch["id"])
            batch["errors"] = {"object": "list", "data": [gone_error(batch["id"])]}
