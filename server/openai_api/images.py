"""Decoded images: the data: URIs of a batch's file, written by its validation under
--files-dir/images/<batch id> and read by the workers as store vlmq-api.

They live exactly as long as the batch that needs them: one folder a batch (never shared
with another, so removing it cannot take an image another batch still reads), removed
when its validation fails or it ends, whichever read or sweep sees that first; a folder
whose batch record is gone (a server stopped mid-validation, a record expired) goes at
the next sweep. Deleting the input file leaves a running batch's images alone: its jobs
still read them.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from redis import Redis

from vlmq.shared.keys import Keys
from vlmq.shared.redis_text import as_str

log = logging.getLogger("vlmq.api")

ENDED = ("completed", "failed", "cancelled", "expired")  # statuses that need no image
LIVE = ("validating", "enqueued")  # a record's own statuses while its images are read
_BATCH_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")


def batch_spool(root: Path, batch_id: str) -> Path:
    """The folder a batch's validation decodes its images into, made empty-or-existing."""
    folder = root / batch_id
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


class BatchImages:
    """The batches' image folders under `root`, and when each may go."""

    def __init__(self, root: Path, redis: Redis, keys: Keys) -> None:
        self.root = root
        self.redis = redis
        self.keys = keys

    def drop(self, batch_id: str) -> None:
        """Remove a batch's images (nothing when it has none)."""
        if not set(batch_id) <= _BATCH_ID_CHARS or not batch_id:
            return  # an id from a request: never a path out of the folder
        folder = self.root / batch_id
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            pass  # none, or another sweep's
        except OSError as exc:
            log.warning("cannot remove the images of %s: %s", batch_id, exc)

    def ended(self, shown: dict[str, Any]) -> None:
        """After a Batch object was shown: its images go once it needs none."""
        if shown.get("status") in ENDED:
            self.drop(str(shown["id"]))

    def sweep(self) -> int:
        """Remove the folders of batches that ended, failed or are gone; returns how many
        folders are left. One HMGET a folder, pipelined: folders are live batches."""
        folders = sorted(p.name for p in self.root.iterdir() if p.is_dir()) \
            if self.root.is_dir() else []
        pipe = self.redis.pipeline(transaction=False)
        for name in folders:
            pipe.hmget(self.keys.api_batch(name), ("status", "ended_at"))
        left = 0
        for name, (status, ended_at) in zip(folders, pipe.execute(), strict=True):
            if as_str(status or b"") not in LIVE or ended_at is not None:
                self.drop(name)
            else:
                left += 1
        return left

