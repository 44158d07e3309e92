"""Redis connections for long-lived producers and workers, and which Redis errors pass.

A connection without a socket timeout can hang forever on a half-open TCP connection (a
peer that vanished without a FIN: a failover, a NAT timeout, a paused VM). Every vlmq
connection therefore has a socket timeout, TCP keepalive and a health check before
reuse of an idle connection, so such a hang becomes a ConnectionError/TimeoutError that
the worker waits out like any other outage.
"""

from __future__ import annotations

from redis import Redis
from redis.exceptions import (
    BusyLoadingError,
    ExecAbortError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

CONNECT_TIMEOUT_S = 10.0
# Longest a single command may take on the wire. Blocking reads (XREAD BLOCK) must block
# for less; vlmq's own block for at most a few seconds.
SOCKET_TIMEOUT_S = 60.0
HEALTH_CHECK_S = 30


def connect(url: str) -> Redis:
    """A client for `url` with timeouts, keepalive and health checks."""
    return Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                          socket_timeout=SOCKET_TIMEOUT_S, socket_keepalive=True,
                          health_check_interval=HEALTH_CHECK_S)


def transient(exc: RedisError) -> bool:
    """Redis errors that pass: unreachable, timed out, out of memory, a replica in failover.

    The worker waits them out with its results held in memory; any other Redis error is
    a real problem with one job's keys or a bug.
    """
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OutOfMemoryError,
                        ReadOnlyError, BusyLoadingError)):
        return True
    return isinstance(exc, ExecAbortError) and "OOM" in str(exc)
