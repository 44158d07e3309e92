"""Error types that cross the producer/worker boundary.

Every error a user can cause carries the name of what was wrong, so the message alone
is enough to fix the input.
"""

from __future__ import annotations


class VlmqError(Exception):
    """Base class for errors vlmq raises on purpose (never for bugs)."""


class PayloadError(VlmqError):
    """A job payload does not follow protocol v1; `field` names the offending path."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}" if field else problem)


class InputError(VlmqError):
    """A local input file cannot be enqueued (empty, corrupt, wrong type, bad range, too big)."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class BlobError(VlmqError):
    """A blob is missing, expired or over the size limit."""
