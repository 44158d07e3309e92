"""Config module for rq-dashboard over vlmq's Redis: `rq-dashboard --json -c <this module>`.

vlmq stores jobs as JSON. `--json` makes rq-dashboard read queues and jobs with RQ's
JSONSerializer, but (0.8.x and 0.9.0) it lists workers with `Worker.all()` and no
serializer, so a busy worker's current job is read with pickle and the Workers page fails
with DeserializationError. rq-dashboard has no setting for that; this module, imported
by rq-dashboard's `-c` at start-up, makes its worker listing pass JSONSerializer too.

Standalone on purpose (only rq and rq-dashboard are imported): docker-compose.yml carries
this file whole (its `configs` entry) into the rq-dashboard container, where vlmq is not
installed. Installed with vlmq it is importable as `vlmq.server.dashboard.rq_dashboard_config`.
tests/server/dashboard/test_rq_dashboard_config.py pins the upstream fault, this fix, and
the compose file's copy being this file.
"""

from __future__ import annotations

from typing import Any

import rq_dashboard.web as _web
from rq import Worker
from rq.serializers import JSONSerializer


class JSONWorker(Worker):
    """RQ's Worker whose `all()` reads workers (and their current jobs) as JSON."""

    @classmethod
    def all(cls, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("serializer", JSONSerializer)
        return super().all(*args, **kwargs)


_web.config.serializer = JSONSerializer  # what --json does, so the module works alone too
_web.Worker = JSONWorker
