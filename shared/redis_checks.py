"""What vlmq checks about the Redis it is given, rather than trusting it.

An evicting Redis (maxmemory with any policy but noeviction, common on managed Redis)
drops job hashes, blobs and queue entries under memory pressure without an error to
anyone; a Redis without persistence loses everything on a restart; a Redis that came back
empty leaves workers holding jobs that no longer exist. Each check reads `INFO` (allowed
where `CONFIG` is blocked) so producers, workers and `vlmq wait` see the same facts.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError

from vlmq.shared import constants as C
from vlmq.shared.errors import VlmqError
from vlmq.shared.keys import Keys
from vlmq.shared.redis_text import as_str

ALLOW_EVICTION_ENV = C.ALLOW_EVICTION_ENV
NO_EVICTION = "noeviction"
FIX = "CONFIG SET maxmemory-policy noeviction"
# How long `vlmq wait` can still name a job lost with a Redis restart.
RESTART_RECORD_TTL_S = 7 * 24 * 3600


class EvictionRefused(VlmqError):
    """Redis may evict vlmq's keys; the message names the policy and the fix."""


def eviction_policy(conn: Redis) -> str:
    """Redis's maxmemory-policy, from INFO memory."""
    info: dict[str, Any] = conn.info("memory")
    return str(info.get("maxmemory_policy", NO_EVICTION))


def allow_eviction_env() -> bool:
    return os.environ.get(ALLOW_EVICTION_ENV, "").strip().lower() in {"1", "true", "yes"}


def eviction_message(policy: str) -> str:
    return (f"Redis maxmemory-policy is {policy}: under memory pressure Redis deletes "
            f"vlmq's job hashes, queue entries, uploaded inputs and results without telling "
            f"anyone. Fix: {FIX} (and in redis.conf: maxmemory-policy noeviction)")


def check_eviction(conn: Redis, allow: bool | None = None) -> str | None:
    """None when Redis never evicts; a warning when it may and eviction is allowed
    (`allow`, default $VLMQ_ALLOW_EVICTION); raises EvictionRefused otherwise."""
    policy = eviction_policy(conn)
    if policy == NO_EVICTION:
        return None
    allowed = allow_eviction_env() if allow is None else (allow or allow_eviction_env())
    if not allowed:
        raise EvictionRefused(f"{eviction_message(policy)}; or pass --allow-eviction "
                              f"(or set {ALLOW_EVICTION_ENV}=1) to run anyway")
    return f"{eviction_message(policy)}; running anyway (eviction allowed)"


def save_points(conn: Redis) -> str | None:
    """`CONFIG GET save` ("" means no RDB snapshots), or None where CONFIG is blocked."""
    try:
        reply: Any = conn.config_get("save")
    except ResponseError:
        return None  # managed Redis: CONFIG disabled or renamed
    value = reply.get("save") if isinstance(reply, dict) else None
    return None if value is None else as_str(value)


def persistence_warning(conn: Redis) -> str | None:
    """A warning when neither AOF nor RDB save points are on (None when either is, or
    when the save points cannot be read and AOF is off: nothing certain to say)."""
    info: dict[str, Any] = conn.info("persistence")
    if int(info.get("aof_enabled", 0)):
        return None
    if save_points(conn) != "":
        return None
    return ("Redis persistence is off (no AOF, no RDB save points): a Redis restart loses "
            "every queued and running job, every result not yet fetched, every uploaded "
            "input and the schedules. Turn on AOF: CONFIG SET appendonly yes (appendfsync "
            "everysec loses at most about a second of writes)")


def run_id(conn: Redis) -> str:
    """The server's run_id (INFO server): it changes on every restart."""
    info: dict[str, Any] = conn.info("server")
    return str(info.get("run_id", ""))


@dataclass
class Health:
    """What `vlmq status` shows about Redis."""

    maxmemory_policy: str
    persistence: str  # "aof", "rdb", "off" or "unknown" (CONFIG blocked, AOF off)
    run_id: str

    def to_dict(self) -> dict[str, str]:
        return {"maxmemory_policy": self.maxmemory_policy, "persistence": self.persistence,
                "run_id": self.run_id}


def health(conn: Redis) -> Health:
    info: dict[str, Any] = conn.info("persistence")
    if int(info.get("aof_enabled", 0)):
        persistence = "aof"
    else:
        save = save_points(conn)
        persistence = "unknown" if save is None else ("rdb" if save else "off")
    return Health(eviction_policy(conn), persistence, run_id(conn))


class RestartWatch:
    """Notices a Redis restart: the run_id seen now differs from the one seen before."""

    def __init__(self, conn: Redis) -> None:
        self.conn = conn
        self.run_id = run_id(conn)

    def changed(self) -> str | None:
        """The previous run_id when Redis restarted since the last call, else None."""
        current = run_id(self.conn)
        if current == self.run_id:
            return None
        old, self.run_id = self.run_id, current
        return old


def record_restart(conn: Redis, keys: Keys, old: str, new: str, worker: str,
                   lost: list[str]) -> None:
    """Leave a note in the restarted Redis, so `vlmq wait` can say why a job is gone."""
    key = keys.redis_restart
    note = json.dumps({"old_run_id": old, "new_run_id": new, "worker": worker,
                       "at": time.time()})
    with conn.pipeline() as pipe:
        pipe.hset(key, "last", note)
        for job_id in lost:
            pipe.hset(key, f"job:{job_id}", note)
        pipe.expire(key, RESTART_RECORD_TTL_S)
        pipe.execute()


def lost_with_restart(conn: Redis, keys: Keys, job_id: str,
                      seen_run_id: str | None = None) -> str | None:
    """Why `job_id` is gone when a Redis restart explains it, else None.

    `seen_run_id`: the run_id the caller saw while the job existed; a different one now
    means Redis restarted under it even if no worker left a note.
    """
    raw: list[Any] = conn.hmget(keys.redis_restart, [f"job:{job_id}", "last"])
    mine, last = raw
    if mine is not None:
        note = json.loads(mine)
        return (f"job {job_id} was lost when Redis restarted empty (run_id "
                f"{note['old_run_id'][:8]} -> {note['new_run_id'][:8]}, noticed by worker "
                f"{note['worker']} while running it); enqueue it again")
    now_id = run_id(conn)
    if seen_run_id is not None and seen_run_id != now_id:
        return (f"job {job_id} is gone: Redis restarted while waiting (run_id "
                f"{seen_run_id[:8]} -> {now_id[:8]}) and came back without it; enqueue "
                "it again")
    if last is not None:
        note = json.loads(last)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(note["at"])))
        return (f"job {job_id} not found; note that Redis restarted empty around {when} "
                f"(run_id {note['old_run_id'][:8]} -> {note['new_run_id'][:8]}), losing "
                "every job enqueued before then")
    return None
