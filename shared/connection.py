"""Redis connections for long-lived producers and workers, and which Redis errors pass.

A connection without a socket timeout can hang forever on a half-open TCP connection (a
peer that vanished without a FIN: a failover, a NAT timeout, a paused VM). Every vlmq
connection therefore has a socket timeout, TCP keepalive and a health check before
reuse of an idle connection, so such a hang becomes a ConnectionError/TimeoutError that
the worker waits out like any other outage.

`redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/DB]` (and
`rediss+sentinel://` for TLS) asks the sentinels for SERVICE's master. redis-py has no URL
scheme for Sentinel, so vlmq parses it here. The client's pool asks the sentinels again on
every new connection, and a connection that meets ReadOnlyError (the master it talks to was
demoted) is dropped and raised as a ConnectionError: each caller's transient-error retry
then lands on the new master after a failover.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from redis import ConnectionPool, Redis
from redis.exceptions import (
    BusyLoadingError,
    ExecAbortError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool

from vlmq.shared.urls import redact_url

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
# Longest a single command may take on the wire. Blocking reads (XREAD BLOCK) must block
# for less; vlmq's own block for at most a few seconds.
SOCKET_TIMEOUT_S = 60.0
HEALTH_CHECK_S = 30
# A sentinel answers one small command; a dead one must not hold up asking the next.
SENTINEL_TIMEOUT_S = 5.0
SENTINEL_PORT = 26379
# How often a Sentinel client asks where the master is, even while its connections work.
MASTER_CHECK_S = 1.0
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme: TLS
# Query parameters a Sentinel URL may carry (the sentinels' own credentials, TLS files).
_SENTINEL_PARAMS = frozenset({"sentinel_username", "sentinel_password", "ssl_ca_certs",
                              "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile"})


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `redis+sentinel://` URL: where the sentinels are and which master to ask for.

    The userinfo is the data nodes' (master and replicas) login; the sentinels' own, where
    they have one, goes in `?sentinel_username=&sentinel_password=`.
    """

    hosts: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    params: dict[str, str] = field(default_factory=dict)


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not sep:
        host, port = text, str(SENTINEL_PORT)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad sentinel address {text!r} in {redact_url(url)!r}")
    return host, int(port)


def parse_sentinel_url(url: str) -> SentinelURL | None:
    """The Sentinel URL's parts; None for any other scheme; ValueError when malformed."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        return None
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, _, hostlist = netloc.rpartition("@")
    hosts = tuple(_host_port(h, url) for h in hostlist.split(",") if h)
    if not hosts:
        raise ValueError(f"no sentinel host:port in {redact_url(url)!r}")
    path = [p for p in parts.path.split("/") if p]
    if not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"expected /SERVICE or /SERVICE/DB after the sentinels in "
                         f"{redact_url(url)!r}")
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(params) - _SENTINEL_PARAMS)
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} in {redact_url(url)!r} "
                         f"(known: {', '.join(sorted(_SENTINEL_PARAMS))})")
    user, has_pw, password = userinfo.partition(":")
    return SentinelURL(hosts=hosts, service=unquote(path[0]),
                       db=int(path[1]) if len(path) == 2 else 0,
                       username=unquote(user) or None,
                       password=unquote(password) if has_pw else None,
                       tls=SENTINEL_SCHEMES[scheme.lower()], params=params)


def check_url(url: str) -> str:
    """`url`, or ValueError naming it (secrets masked): redis-py's message names no URL."""
    try:
        if parse_sentinel_url(url) is None:
            ConnectionPool.from_url(url).disconnect()
    except ValueError as exc:
        raise ValueError(f"invalid Redis URL {redact_url(url)!r}: {exc}") from exc
    return url


def _common() -> dict[str, Any]:
    return {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": SOCKET_TIMEOUT_S,
            "socket_keepalive": True, "health_check_interval": HEALTH_CHECK_S}


def _tls(s: SentinelURL) -> dict[str, Any]:
    if not s.tls:
        return {}
    return {"ssl": True, **{k: v for k, v in s.params.items() if k.startswith("ssl_")}}


class FollowingPool(SentinelConnectionPool):
    """A Sentinel pool that asks the sentinels for the master at least every MASTER_CHECK_S.

    redis-py's own pool asks only when it opens a connection. After a failover the demoted
    master keeps accepting writes until Sentinel reconfigures it (about 10 s here), and then
    discards them in its resync with the new master: writes on pooled connections in that
    window would be lost. When the master has moved, every connection is closed, so the next
    command goes to the new one.
    """

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self._next_check = 0.0

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        at = time.monotonic()
        if at >= self._next_check:
            self._next_check = at + MASTER_CHECK_S
            self.follow_master()
        return super().get_connection(*args, **kwargs)

    def follow_master(self) -> bool:
        """True when the master moved (and every connection to the old one was closed)."""
        before = self.proxy.master_address
        try:
            self.get_master_address()  # type: ignore[no-untyped-call]  # closes idle ones if moved
        except (MasterNotFoundError, RedisConnectionError, RedisTimeoutError) as exc:
            # No answer now: keep the master we have; opening a connection asks again.
            log.debug("sentinels not answering (%s); keeping master %s", exc, before)
            return False
        moved = before is not None and self.proxy.master_address != before
        if moved:
            log.warning("Redis master of %s moved from %s to %s", self.service_name, before,
                        self.proxy.master_address)
            self.disconnect(inuse_connections=True)
        return moved


def connect_sentinel(s: SentinelURL) -> Redis:
    """A client for the master of `s.service`, found through the sentinels."""
    tls = _tls(s)
    sentinel_kwargs: dict[str, Any] = {
        "socket_connect_timeout": SENTINEL_TIMEOUT_S, "socket_timeout": SENTINEL_TIMEOUT_S,
        "username": s.params.get("sentinel_username"),
        "password": s.params.get("sentinel_password"), **tls}
    # redis-py's sentinel module is typed in some releases and not in others: called through
    # typed names, the same code checks against both.
    make_sentinel: Callable[..., Sentinel] = Sentinel
    sentinel = make_sentinel(list(s.hosts), sentinel_kwargs=sentinel_kwargs, **_common(), **tls)
    master_for: Callable[..., Redis] = sentinel.master_for
    master = master_for(
        s.service, redis_class=Redis, connection_pool_class=FollowingPool, db=s.db,
        username=s.username, password=s.password)
    return master


def connect(url: str) -> Redis:
    """A client for `url` with timeouts, keepalive and health checks; a Sentinel URL gives
    one that follows its service's master across failovers."""
    sentinel = parse_sentinel_url(url)
    if sentinel is not None:
        return connect_sentinel(sentinel)
    return Redis.from_url(url, **_common())


def transient(exc: RedisError) -> bool:
    """Redis errors that pass: unreachable, timed out, out of memory, a replica in failover.

    The worker waits them out with its results held in memory; any other Redis error is
    a real problem with one job's keys or a bug.
    """
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OutOfMemoryError,
                        ReadOnlyError, BusyLoadingError)):
        return True
    return isinstance(exc, ExecAbortError) and "OOM" in str(exc)


class RedisClock:
    """Time as Redis tells it (`TIME`), shared by every worker whatever its own clock says.

    Registry scores, heartbeat expiries and takeover decisions compare times written by
    different machines; a worker whose clock runs ahead would otherwise see every other
    worker's live jobs as expired. `offset` (Redis minus this machine) is measured at each
    `measure()` and corrects times that must be computed inside a transaction.
    """

    def __init__(self, conn: Redis) -> None:
        self.conn = conn
        self.offset = 0.0

    def measure(self, conn: Any = None) -> float:
        """Redis's time now (one round trip); updates `offset`."""
        before = time.time()
        secs, micros = (conn if conn is not None else self.conn).time()
        server = int(secs) + int(micros) / 1e6
        self.offset = server - (before + time.time()) / 2
        return server

    def now(self) -> float:
        """Redis's time by the last measured offset (no round trip)."""
        return time.time() + self.offset
