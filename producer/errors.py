"""Producer-side errors that several producer modules raise."""

from __future__ import annotations

from vlmq.shared.errors import VlmqError


class JobNotFound(VlmqError):
    """No RQ job with this id: never enqueued here, or expired (result/failure TTL)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id} not found (wrong id or Redis db, or it expired)")
