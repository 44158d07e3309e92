"""The function name every vlmq RQ job carries (`vlmq.worker.task.run`).

vlmq jobs are executed by `vlmq worker`, which batches items from many jobs; the worker
never calls this function. A plain `rq worker` that picks up a vlmq job by mistake calls
it, and the job then fails with a message that says what to run instead.
"""

from __future__ import annotations

from typing import Any

from vlmq.shared.errors import VlmqError


class WrongWorkerError(VlmqError):
    pass


def run(payload: dict[str, Any]) -> None:
    raise WrongWorkerError(
        "vlmq jobs must be run by `vlmq worker --model ...` (a batching worker with the model "
        "loaded), not by a plain `rq worker`; this job was not processed")
