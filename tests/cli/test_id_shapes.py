"""Every id is checked by its shape before it reaches Redis.

`vlmq status b-...:jobs` used to reach Redis and come back as "Redis refused a command:
WRONGTYPE": the id named another key. Now each command that takes a job or batch id, a
queue name, a schedule name or a label refuses a malformed one with exit 2 and a message
naming it and its shape, and the Client's id-taking methods raise PayloadError; in both
cases INFO commandstats of a private Redis shows that no command was sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redis import Redis

from tests.support import helpers
from vlmq.cli.common import EXIT_BAD_INPUT
from vlmq.producer.client import Client
from vlmq.shared.errors import PayloadError

# Commands the probe runs besides the ones this test suite sends itself.
_OWN = {"config|resetstat", "info"}


def _url(redis: Redis) -> str:
    kw = redis.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


def _sent(redis: Redis) -> set[str]:
    """The commands Redis ran since the last reset, less this probe's own."""
    stats = redis.info("commandstats")
    return {name.removeprefix("cmdstat_") for name in stats} - _OWN


@pytest.fixture
def quiet(own_redis: Redis) -> Iterator[Redis]:
    """A private Redis with its command counts reset: what a test sends shows in _sent."""
    own_redis.config_resetstat()
    yield own_redis


BAD_CLI = [
    (("status", "b-x:jobs"), "b-x:jobs", "job or batch id"),
    (("result", "abc\n"), "abc\\n", "job or batch id"),
    (("cancel", "../x"), "../x", "job or batch id"),
    (("cancel", "good-id", "bad id"), "bad id", "job or batch id"),
    (("wait", "x*"), "x*", "job or batch id"),
    (("retry", "b-x:jobs"), "b-x:jobs", "job or batch id"),
    (("delete", "ok", "rq:job:ok"), "rq:job:ok", "job or batch id"),
    (("export", "--dir", "out", "a" * 129), "a" * 129, "job or batch id"),
    (("jobs", "--queue", "a:b"), "a:b", "queue name"),
    (("schedule", "run", "../x"), "../x", "schedule name"),
    (("schedule", "remove", "a:b"), "a:b", "schedule name"),
    (("schedule", "pause", "a b"), "a b", "schedule name"),
    (("schedule", "resume", ""), "''", "schedule name"),
    (("status", "--label", "k=\udcff"), "k=", "label"),
]


@pytest.mark.parametrize(("args", "named", "kind"), BAD_CLI,
                         ids=[" ".join(a)[:40] for a, _, _ in BAD_CLI])
def test_cli_refuses_a_malformed_id_before_redis(quiet: Redis, tmp_path: Any,
                                                 args: tuple[str, ...], named: str,
                                                 kind: str) -> None:
    args = tuple(str(tmp_path / a) if a == "out" else a for a in args)
    res = helpers.invoke_cli(_url(quiet), *args)
    assert res.exit_code == EXIT_BAD_INPUT, (res.stdout, res.stderr)
    assert named in res.stderr and kind in res.stderr, res.stderr
    assert "expected" in res.stderr, res.stderr
    assert "WRONGTYPE" not in res.stderr
    assert _sent(quiet) == set(), _sent(quiet)


BAD_CLIENT: list[tuple[Callable[[Client], Any], str]] = [
    (lambda c: c.job("b-x:jobs"), "b-x:jobs"),
    (lambda c: c.batch("b-x:jobs"), "b-x:jobs"),
    (lambda c: c.cancel("../x"), "../x"),
    (lambda c: c.delete(["fine", "abc\n"]), "abc"),
    (lambda c: c.jobs(queue="a:b"), "a:b"),
    (lambda c: c.jobs(labels={"k": "\udcff"}), "label"),
    (lambda c: c.group_status({"": "v"}), "label"),
    (lambda c: c.serving("a b"), "a b"),
]


@pytest.mark.parametrize(("call", "named"), BAD_CLIENT, ids=[n for _, n in BAD_CLIENT])
def test_client_refuses_a_malformed_id_before_redis(quiet: Redis, call: Callable[[Client], Any],
                                                    named: str) -> None:
    with Client(_url(quiet), prefix="vlmq") as client:
        quiet.config_resetstat()
        with pytest.raises(PayloadError) as info:
            call(client)
    assert named in str(info.value) and "expected" in str(info.value), str(info.value)
    assert _sent(quiet) == set(), _sent(quiet)


def test_well_formed_ids_still_reach_redis(quiet: Redis) -> None:
    """The check refuses shapes only: a well-formed unknown id is looked up as before."""
    res = helpers.invoke_cli(_url(quiet), "status", "b-0123456789abcdef0123456789abcdef")
    assert res.exit_code == 1, (res.stdout, res.stderr)
    assert "not found" in res.stderr
    assert _sent(quiet) != set()
