"""The scheduler loop: `vlmq scheduler`, or a thread of `vlmq worker --with-scheduler`.

A long-running process over the stored schedules (producer/ops/schedules.py), which hold
every decision: this loop only ticks them and waits out Redis trouble.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis.exceptions import RedisError

from vlmq.producer.client import Client
from vlmq.producer.ops.schedules import ScheduleStore
from vlmq.shared.keys import Keys
from vlmq.stores.backends import Stores

log = logging.getLogger("vlmq.scheduler")

TICK_S = 0.5


def run_scheduler(redis_url: str, stop: threading.Event, *, tick_s: float = TICK_S,
                  keys: Keys | None = None, stores: Stores | None = None,
                  on_warning: Callable[[str], None] | None = None) -> None:
    """The scheduler loop (`vlmq scheduler`, or a thread of `vlmq worker --with-scheduler`):
    Redis trouble is logged and waited out, never fatal. `stores` (default $VLMQ_STORES):
    this machine's, which decide what its runs enqueue by reference. `on_warning`: the
    client's (an evicting Redis allowed)."""
    with Client(redis_url, stores=stores, on_warning=on_warning) as client:
        if keys is not None:
            client.keys = keys
        store = ScheduleStore(client)
        log.info("scheduler %s running", store.who)
        while not stop.is_set():
            try:
                for run in store.tick():
                    log.info("schedule run %s: job %s, %d items, %d skipped%s", run["id"],
                             run.get("job_id"), run.get("items", 0), run.get("skipped", 0),
                             f", missing {run['missing']}" if run.get("missing") else "")
            except RedisError as exc:
                log.warning("scheduler: Redis error (%s); retrying", exc)
            stop.wait(tick_s)


def start_scheduler_thread(redis_url: str, stores: Stores | None = None,
                           on_warning: Callable[[str], None] | None = None
                           ) -> tuple[threading.Thread, threading.Event]:
    """The scheduler loop beside a worker (`vlmq worker --with-scheduler`); set the event
    to stop it."""
    stop = threading.Event()
    thread = threading.Thread(target=run_scheduler, args=(redis_url, stop), daemon=True,
                              name="vlmq-scheduler",
                              kwargs={"stores": stores, "on_warning": on_warning})
    thread.start()
    return thread, stop
