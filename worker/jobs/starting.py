"""A worker's presence while it starts, before RQ knows it.

RQ registers a worker only once its model is loaded, seconds to minutes after it started:
a producer enqueueing meanwhile (the README starts a worker in the background and enqueues
at once) would warn that no worker serves the queue. So `vlmq worker`, right after its
options parse and before MLX is imported, names itself in `<prefix>:starting:<queue>` for
each queue it will serve (PROTOCOL.md), which producers count as serving. A thread keeps
the sets alive until the worker is in `rq:workers:<queue>`, then takes its name out; the
name goes too when the worker exits, whatever the exit. It is a hint for a warning only,
so a Redis that fails here is left to the worker's own start-up checks to report.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

from redis import Redis
from redis.exceptions import RedisError

from vlmq.shared import constants as C
from vlmq.shared.connection import connect
from vlmq.shared.keys import Keys

log = logging.getLogger(__name__)


class Starting:
    """Context manager: worker `name` is starting to serve `queues` until it is registered
    with RQ or the block ends. Entering returns at once: the thread does the writing."""

    def __init__(self, redis_url: str, keys: Keys, name: str, queues: Sequence[str], *,
                 ttl_s: float = C.WORKER_STARTING_TTL_S) -> None:
        self.redis_url = redis_url
        self.keys = keys
        self.name = name
        self.queues = list(dict.fromkeys(queues))
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._redis: Redis | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlmq-starting", daemon=True)

    def __enter__(self) -> Starting:
        try:  # no I/O yet: a client connects on its first command
            self._redis = connect(self.redis_url)
        except ValueError as exc:
            log.debug("starting presence: %s", exc)
        if self._redis is not None and self.queues:
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread.ident is None:
            return  # never announced
        self._thread.join(timeout=5)
        self._best_effort(self._leave)
        self._conn().close()

    def _run(self) -> None:
        # Announced first thing, then refreshed three times a TTL, so one slow round never
        # lets the sets lapse.
        while True:
            self._best_effort(self._announce)
            if self._stop.wait(self.ttl_ms / 3000):
                return
            if self._best_effort(self._registered):
                self._best_effort(self._leave)
                return

    def _conn(self) -> Redis:
        assert self._redis is not None  # the thread starts only with a client
        return self._redis

    def _announce(self) -> bool:
        pipe = self._conn().pipeline(transaction=False)
        for queue in self.queues:
            pipe.sadd(self.keys.queue_starting(queue), self.name)
            pipe.pexpire(self.keys.queue_starting(queue), self.ttl_ms)
        pipe.execute()
        return True

    def _registered(self) -> bool:
        """Whether RQ lists this worker on its first queue (it registers on all at once)."""
        return bool(self._conn().sismember(Keys.rq_queue_workers(self.queues[0]),
                                           Keys.rq_worker(self.name)))

    def _leave(self) -> bool:
        pipe = self._conn().pipeline(transaction=False)
        for queue in self.queues:
            pipe.srem(self.keys.queue_starting(queue), self.name)
        pipe.execute()
        return True

    def _best_effort(self, step: Callable[[], bool]) -> bool:
        try:
            return step()
        except (RedisError, OSError, ValueError) as exc:
            log.debug("starting presence: %s", exc)
            return False
