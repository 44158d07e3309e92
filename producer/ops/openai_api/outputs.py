"""A batch's output and error files, made from its results when read (nothing is written
twice): the `openai-batch` format's lines (producer/ops/output_formats.py), in input
order, split as OpenAI splits them. An expired batch's lines that never ran carry
OpenAI's `batch_expired` rather than the `batch_cancelled` of a cancel."""

from __future__ import annotations

import json
from collections.abc import Iterator

from vlmq.producer.client import Client
from vlmq.producer.job_sets import Batch
from vlmq.producer.ops.output_formats import JobResults, openai_output

EXPIRED_MESSAGE = ("This request could not be executed before the completion window "
                   "expired.")


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
