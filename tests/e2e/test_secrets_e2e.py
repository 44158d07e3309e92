"""No password reaches a log: a full run against a password-protected private Redis."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from tests.support.helpers import VLMQ, finish, make_images, start_worker
from vlmq.shared.urls import redact_url
from vlmq.worker.redis_server import free_port, server_binary

PASSWORD = "Hunter2-topsecret-9f3k"



@pytest.fixture
def secret_redis(tmp_path: Path) -> Iterator[int]:
    binary = server_binary()
    if binary is None:
        pytest.skip("no redis-server binary")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1",
                             "--requirepass", PASSWORD, "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        conn = Redis(port=port, password=PASSWORD)
        deadline = time.monotonic() + 20
        while True:
            try:
                conn.ping()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("url", [
    "redis://:{pw}@127.0.0.1:{port}/0",
    "redis://default:{pw}@127.0.0.1:{port}/0",
    "redis://127.0.0.1:{port}/0?password={pw}",
])
def test_redact_url_masks_every_form(url: str) -> None:
    masked = redact_url(url.format(pw=PASSWORD, port=1))
    assert PASSWORD not in masked and "***" in masked


@pytest.mark.slow
def test_no_log_or_message_of_a_run_shows_the_password(secret_redis: int, tiny_model: Path,
                                                       tmp_path: Path) -> None:
    port = secret_redis
    userinfo = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    query = f"redis://127.0.0.1:{port}/0?password={PASSWORD}"
    outputs: list[str] = []

    def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([VLMQ, "--redis-url", url, *args], capture_output=True,
                             text=True, timeout=120, check=False)
        outputs.append(res.stdout + res.stderr)
        return res

    images = make_images(tmp_path / "imgs", 2)
    res = cli(query, "enqueue", "caption", *map(str, images), "--max-tokens", "4",
              "--max-side", "56", "--json")
    assert res.returncode == 0, res.stderr
    worker = start_worker(userinfo, tiny_model, tmp_path, "--burst")
    rc, out = finish(worker)
    outputs.append(out)
    assert rc == 0, out
    cli(query, "status")
    # Failures print the URL: a wrong port, a wrong password, a malformed URL.
    bad_port = f"redis://:{PASSWORD}@127.0.0.1:1/0"
    assert cli(bad_port, "status").returncode != 0
    assert cli(f"redis://127.0.0.1:1/0?password={PASSWORD}", "status").returncode != 0
    assert cli(f"redis://:{PASSWORD}@127.0.0.1:notaport/0", "status").returncode != 0
    env = {**os.environ, "REDIS_URL": bad_port}
    dead = subprocess.run([VLMQ, "worker", "--model", str(tiny_model), "--burst"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    outputs.append(dead.stdout + dead.stderr)
    assert dead.returncode != 0 and "cannot reach Redis at redis://:***@127.0.0.1:1/0" in \
        dead.stdout + dead.stderr

    everything = "\n".join(outputs)
    assert "***" in everything  # the URLs were printed, masked
    assert PASSWORD not in everything
