"""Redis is checked, not trusted: eviction refused, persistence warned about, a restart
noticed. Each case runs its own redis-server (a free 127.0.0.1 port) and a real worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from tests.support.helpers import VLMQ, Spawn, finish, invoke_cli, make_images, make_pdf, wait_for
from vlmq.producer.client import Client
from vlmq.shared import redis_checks
from vlmq.shared.keys import Keys
from vlmq.shared.redis_checks import EvictionRefused
from vlmq.worker.redis_server import free_port

pytestmark = pytest.mark.slow

FIX = "CONFIG SET maxmemory-policy noeviction"
EVICTING = ("--maxmemory", "50mb", "--maxmemory-policy", "allkeys-lru")


class OwnRedis:
    """A redis-server of this test's own, empty at each start; stopped at teardown."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, *args: str) -> OwnRedis:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.folder), "--save", "", "--appendonly", "no", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        conn = Redis.from_url(self.url)

        def up() -> bool:
            try:
                return bool(conn.ping())
            except RedisConnectionError:
                return False

        wait_for(up, 120, f"redis-server on port {self.port}")
        conn.close()
        return self

    def stop(self, *, graceful: bool = False) -> None:
        """SIGKILL by default (nothing saved: an empty restart); graceful: SIGTERM, which
        flushes the AOF, as a planned Redis restart does."""
        if self.proc is not None and self.proc.poll() is None:
            if graceful:
                self.proc.terminate()
            else:
                self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path / "redis")
    yield server
    server.stop()


def _enqueue_cli(url: str, image: Path, *args: str,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VLMQ, "--redis-url", url, "enqueue", "caption", str(image), *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


# --- eviction ---------------------------------------------------------------------------


def test_worker_refuses_an_evicting_redis_naming_the_policy_and_the_fix(
        own_redis: OwnRedis, tiny_model: Path, tmp_path: Path, start_worker: Spawn) -> None:
    own_redis.start(*EVICTING)
    rc, out = finish(start_worker(own_redis.url, tiny_model, tmp_path, "--burst"))
    assert rc == 78, out  # EX_CONFIG: a service does not restart it
    assert "maxmemory-policy is allkeys-lru" in out and FIX in out, out
    assert "--allow-eviction" in out and "loading model" not in out, out

    rc, out = finish(start_worker(own_redis.url, tiny_model, tmp_path, "--burst",
                                  "--allow-eviction", name="w2"))
    assert rc == 0, out
    assert "maxmemory-policy is allkeys-lru" in out and "running anyway" in out, out
    # This Redis has no AOF and no save points either: the worker says what that costs.
    assert "persistence is off" in out and "a Redis restart loses every queued" in out, out


def test_enqueue_and_status_refuse_an_evicting_redis_unless_allowed(
        own_redis: OwnRedis, tmp_path: Path) -> None:
    own_redis.start(*EVICTING)
    image = make_images(tmp_path / "in", 1)[0]
    conn = Redis.from_url(own_redis.url)
    res = invoke_cli(own_redis.url, "enqueue", "caption", str(image))
    assert res.exit_code == 1, (res.stdout, res.stderr)
    assert "allkeys-lru" in res.stderr and FIX in res.stderr
    assert "nothing was enqueued" in res.stderr
    assert conn.dbsize() == 0  # refused before the first upload
    with Client(own_redis.url) as client, pytest.raises(EvictionRefused, match=FIX):
        client.caption([image])

    allowed = _enqueue_cli(own_redis.url, image, "--allow-eviction")
    assert allowed.returncode == 0, allowed.stderr
    assert "warning" in allowed.stderr and "allkeys-lru" in allowed.stderr
    by_env = _enqueue_cli(own_redis.url, image, env={"VLMQ_ALLOW_EVICTION": "1"})
    assert by_env.returncode == 0, by_env.stderr
    assert "allkeys-lru" in by_env.stderr and "running anyway" in by_env.stderr

    res = invoke_cli(own_redis.url, "status")
    assert res.exit_code == 1, (res.stdout, res.stderr)
    assert "redis: maxmemory-policy allkeys-lru, persistence off" in res.stdout
    assert "allkeys-lru" in res.stderr and FIX in res.stderr
    res = invoke_cli(own_redis.url, "status", "--allow-eviction", "--json")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    health = json.loads(res.stdout)["redis"]
    assert health["maxmemory_policy"] == "allkeys-lru" and health["persistence"] == "off"
    assert health["error"] is None and "allkeys-lru" in health["warning"]


def test_persistence_warning_only_without_aof_and_save_points(own_redis: OwnRedis) -> None:
    own_redis.start("--appendonly", "yes", "--appendfsync", "everysec")
    conn = Redis.from_url(own_redis.url)
    assert redis_checks.persistence_warning(conn) is None
    assert redis_checks.health(conn).persistence == "aof"
    conn.config_set("appendonly", "no")
    conn.config_set("save", "3600 1")
    assert redis_checks.persistence_warning(conn) is None
    assert redis_checks.health(conn).persistence == "rdb"
    conn.config_set("save", "")
    assert "persistence is off" in (redis_checks.persistence_warning(conn) or "")
    conn.close()


def test_a_queue_entry_whose_hash_is_gone_is_logged_and_dead_lettered(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    client = Client(redis_url)
    images = make_images(tmp_path / "in", 2)
    evicted = client.caption([images[0]], max_tokens=4)
    kept = client.caption([images[1]], max_tokens=4)
    redis.delete(Keys.rq_job(evicted.id))  # what an evicting Redis does under pressure
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst"))
    assert rc == 0, out
    assert kept.status() == "finished", out
    assert f"entry {evicted.id} dead-lettered: its job hash is gone" in out, out
    dead = [json.loads(x) for x in redis.lrange(Keys().dead, 0, -1)]
    assert [(d["entry"], d["queue"]) for d in dead] == [(evicted.id, "caption")]
    assert "evicted" in dead[0]["reason"]
    assert not redis.lrange("rq:queue:caption:intermediate", 0, -1)


# --- restart --------------------------------------------------------------------------------


def test_a_redis_restart_is_noticed_and_the_worker_registers_again(
        own_redis: OwnRedis, tiny_model: Path, tmp_path: Path, start_worker: Spawn) -> None:
    own_redis.start()
    url = own_redis.url
    client = Client(url)
    job = client.ocr([make_pdf(tmp_path / "long.pdf", 24)], max_side=112, max_tokens=24)
    proc = start_worker(url, tiny_model, tmp_path, "--max-batch", "2", name="survivor")
    wait_for(lambda: job.progress()[0] >= 1, 300, "an item done")
    seen = redis_checks.run_id(client.redis)

    own_redis.stop()
    own_redis.start()  # the same port, an empty dataset, a new run_id
    conn = Redis.from_url(url)
    wait_for(lambda: bool(conn.scard("rq:workers:ocr"))
             and conn.sismember(Keys().workers, "survivor") == 1, 60,
             "the worker to register again")

    status = invoke_cli(url, "status")
    assert status.exit_code == 0, (status.stdout, status.stderr)
    row = next(line for line in status.stdout.splitlines() if line.startswith("survivor"))
    assert "idle" in row and "ocr,caption,generate" in row, status.stdout
    enq = invoke_cli(url, "enqueue", "caption", str(make_images(tmp_path / "in", 1)[0]))
    assert enq.exit_code == 0 and "no live worker" not in enq.stderr, enq.stderr
    wait = invoke_cli(url, "wait", job.id, "--timeout", "5")
    assert wait.exit_code == 1, (wait.stdout, wait.stderr)
    assert f"job {job.id} was lost when Redis restarted empty" in wait.stderr, wait.stderr
    # A waiter that saw the old Redis says so for a job no worker held, too.
    other = redis_checks.lost_with_restart(conn, Keys(), "never-held", seen)
    assert other is not None and "Redis restarted while waiting" in other

    os.killpg(proc.pid, signal.SIGTERM)
    rc, out = finish(proc, timeout=300)
    assert rc == 0, out
    assert "Redis restarted (run_id" in out, out
    assert f"job {job.id} lost with the Redis restart" in out, out
    assert "registered again after the Redis restart" in out, out
    assert "dropped (deleted)" not in out, out
    conn.close()
    client.close()


def test_a_redis_restored_from_aof_keeps_its_jobs_running(
        own_redis: OwnRedis, tiny_model: Path, tmp_path: Path, start_worker: Spawn) -> None:
    aof = ("--appendonly", "yes", "--appendfsync", "always")
    own_redis.start(*aof)
    client = Client(own_redis.url)
    job = client.ocr([make_pdf(tmp_path / "long.pdf", 12)], max_side=112, max_tokens=24)
    proc = start_worker(own_redis.url, tiny_model, tmp_path, "--max-batch", "2", name="aof")
    wait_for(lambda: job.progress()[0] >= 1, 300, "an item done")
    own_redis.stop(graceful=True)
    own_redis.start(*aof)  # a new run_id, the same data
    wait_for(lambda: job.status() == "finished", 120, "the job to finish")
    os.killpg(proc.pid, signal.SIGTERM)
    rc, out = finish(proc, timeout=300)
    assert rc == 0, out
    assert "0 of 1 job(s) in flight here were lost" in out, out
    assert "lost with the Redis restart (its hash" not in out, out
    assert [r.index for r in job.results()] == list(range(12))
    client.close()
