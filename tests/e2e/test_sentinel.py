"""Redis Sentinel URLs, and a failover in the middle of a job.

The end-to-end test runs Debian's real redis-sentinel beside a master and a replica on free
127.0.0.1 ports; `SENTINEL FAILOVER` promotes the replica while a real worker runs a job.
Every item must have exactly one result and the job must finish, on the new master.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.support.helpers import VLMQ, Spawn, finish, make_pdf, wait_for
from vlmq.producer.client import Client, check_redis_url
from vlmq.shared.connection import parse_sentinel_url
from vlmq.shared.keys import Keys
from vlmq.shared.urls import redact_url
from vlmq.worker.redis_server import answers, free_port

SERVICE = "vmaster"


def test_sentinel_urls_are_parsed_with_hosts_service_db_and_credentials() -> None:
    s = parse_sentinel_url("redis+sentinel://app:p%40ss@h1:26380,h2,[::1]:5/svc/3"
                           "?sentinel_password=sp")
    assert s is not None
    assert s.hosts == (("h1", 26380), ("h2", 26379), ("::1", 5))
    assert (s.service, s.db, s.username, s.password, s.tls) == ("svc", 3, "app", "p@ss", False)
    assert s.params == {"sentinel_password": "sp"}
    tls = parse_sentinel_url("rediss+sentinel://h:1/svc")
    assert tls is not None and tls.tls and tls.db == 0
    assert parse_sentinel_url("redis://h:1/0") is None


@pytest.mark.parametrize("url", ["redis+sentinel://h:1", "redis+sentinel:///svc",
                                 "redis+sentinel://h:x/svc", "redis+sentinel://h:1/svc/x",
                                 "redis+sentinel://h:1/svc?bogus=1"])
def test_malformed_sentinel_urls_are_refused_with_secrets_masked(url: str) -> None:
    with pytest.raises(ValueError, match="invalid Redis URL"):
        check_redis_url(url.replace("//", "//u:secret@", 1))
    with pytest.raises(ValueError) as err:
        check_redis_url(url.replace("//", "//u:secret@", 1))
    assert "secret" not in str(err.value)


def test_sentinel_urls_are_redacted() -> None:
    url = "rediss+sentinel://u:pw@h1:1,h2:2/svc/1?sentinel_password=spw"
    assert redact_url(url) == "rediss+sentinel://u:***@h1:1,h2:2/svc/1?sentinel_password=***"
    assert check_redis_url(url) == url  # accepted by the CLI root, Client and dashboard


@dataclass
class Trio:
    """A master, its replica and one sentinel watching them."""

    master: int
    replica: int
    sentinel: int
    procs: list[subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel}/{SERVICE}/0"

    def master_port(self) -> int:
        return int(_ask(self.sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)[1])


def _ask(port: int, *command: str) -> Any:
    with Redis(port=port, decode_responses=True) as conn:
        return conn.execute_command(*command)


def _synced(replica: int, sentinel: int) -> bool:
    """The replica holds the master's data, and the sentinel knows the replica."""
    with Redis(port=replica) as r, Redis(port=sentinel) as s:
        return bool(r.info("replication")["master_link_status"] == "up"
                    and s.sentinel_slaves(SERVICE))


def _server(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[Trio]:
    binary = shutil.which("redis-sentinel")
    if binary is None or shutil.which("redis-server") is None:
        pytest.skip("needs Debian's redis-sentinel (apt-get install -y redis-sentinel)")
    master, replica, sentinel = free_port(), free_port(), free_port()
    # No diskless-sync delay: the replica must hold the data before the test goes on.
    base = ["redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--repl-diskless-sync-delay", "0"]
    (tmp_path / "master").mkdir()
    (tmp_path / "replica").mkdir()
    # Replication writes an RDB even with --save "": keep it out of the working tree.
    procs = [_server(*base, "--port", str(master), "--dir", str(tmp_path / "master"))]
    procs.append(_server(*base, "--port", str(replica), "--dir", str(tmp_path / "replica"),
                         "--replicaof", "127.0.0.1", str(master)))
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {sentinel}\nbind 127.0.0.1\ndir {tmp_path}\n"
                    f"sentinel monitor {SERVICE} 127.0.0.1 {master} 1\n"
                    f"sentinel down-after-milliseconds {SERVICE} 2000\n"
                    f"sentinel failover-timeout {SERVICE} 10000\n")
    procs.append(_server(binary, str(conf)))
    t = Trio(master, replica, sentinel, procs)
    try:
        for port in (master, replica, sentinel):
            wait_for(lambda p=port: answers(f"redis://127.0.0.1:{p}", 0.2), 120, f"port {port}")
        wait_for(lambda: _synced(replica, sentinel), 120, "the replica to be synced and known")
        yield t
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_failover_mid_job_loses_and_duplicates_nothing(
        trio: Trio, tiny_model: Path, tmp_path: Path, start_worker: Spawn,
        procs: list[subprocess.Popen[str]]) -> None:
    with ExitStack() as stack:
        pages = 24
        client = stack.enter_context(Client(trio.url))
        new = stack.enter_context(Redis(port=trio.replica))
        job = client.ocr([make_pdf(tmp_path / "doc.pdf", pages)], max_side=112, max_tokens=64)
        worker = start_worker(trio.url, tiny_model, tmp_path, "--max-batch", "2",
                              "--heartbeat-ttl", "6")
        waiter = subprocess.Popen([VLMQ, "--redis-url", trio.url, "wait", job.id, "--timeout",
                                   "150"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        procs.append(waiter)  # killed at teardown like the worker
        wait_for(lambda: job.progress()[0] >= 2, 300, "the job's first items")
        assert job.progress()[0] < pages, "the job ended before the failover: make it longer"
        _ask(trio.sentinel, "SENTINEL", "FAILOVER", SERVICE)
        wait_for(lambda: trio.master_port() == trio.replica, 300, "the replica to be promoted")
        wait_for(lambda: new.hget(f"rq:job:{job.id}", "status") == b"finished", 120,
                 "the job to finish on the new master")
        w_out, w_err = waiter.communicate(timeout=300)
        assert waiter.returncode == 0, (w_out, w_err)
        os.kill(worker.pid, signal.SIGTERM)
        rc, out = finish(worker, timeout=300)
        assert rc == 0, out
        assert "Redis master of vmaster moved" in out, out  # followed it, not by luck

        events = list(new.xrange(Keys().job_events(job.id)))
        assert new.hlen(Keys().job_items(job.id)) == pages
        per_item = Counter(int(f[b"index"]) for _, f in events if f[b"type"] == b"item")
        assert per_item == Counter(range(pages)), per_item  # one result per item, none twice
        ends = [f[b"type"] for _, f in events if f[b"type"] in (b"finished", b"failed")]
        assert ends == [b"finished"], ends
        assert client.job(job.id).summary()["ok"] == pages
