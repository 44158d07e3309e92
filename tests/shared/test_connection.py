"""Every vlmq Redis client can tell a dead connection from a slow one."""

from __future__ import annotations

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from vlmq.producer.client import Client
from vlmq.shared.connection import connect, transient


def _options(conn: Redis) -> dict[str, object]:
    return dict(conn.connection_pool.connection_kwargs)


def test_worker_and_producer_clients_have_timeouts_keepalive_and_health_checks(
        redis_url: str) -> None:
    for conn in (connect(redis_url), Client(redis_url).redis):
        opts = _options(conn)
        assert opts["socket_timeout"] and opts["socket_connect_timeout"]
        assert opts["socket_keepalive"] is True
        assert opts["health_check_interval"]
        assert conn.ping()
        conn.close()


def test_transient_errors_are_outages_not_bad_keys() -> None:
    assert transient(RedisConnectionError("gone"))
    assert not transient(ResponseError("WRONGTYPE Operation against a key"))
