"""Producer-side errors that several producer modules raise."""

from __future__ import annotations

from vlmq.shared.errors import VlmqError


class JobNotFound(VlmqError):
    """No RQ job with this id: never enqueued here, or expired (result/failure TTL)."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id} not found (wrong id or Redis db, or it expired)")


class NotAJob(JobNotFound):
    """rq:job:<id> exists but is not a hash: something written by hand, not a job, so
    there is nothing to show, wait for or retry (every hash command on it would fail)."""

    def __init__(self, job_id: str, found: str) -> None:
        super().__init__(job_id)
        self.found = found
        self.args = (f"job {job_id} cannot be read: its key rq:job:{job_id} is a Redis "
                     f"{found}, not a job hash (written by hand, not by a producer)",)
