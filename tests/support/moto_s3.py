"""A real S3 API for tests: moto's standalone server on 127.0.0.1, with one bucket."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import helpers
from vlmq.worker.redis_server import free_port


@dataclass
class S3:
    endpoint: str
    aws_env: dict[str, str]  # the standard AWS environment a worker or the CLI reads
    client: Any  # a boto3 client for the test's own puts


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def moto_s3(bucket: str, secret: str) -> Iterator[S3]:
    """The server running (stopped after the block), `bucket` made, key "testing-key"
    with `secret` as its secret."""
    boto3 = pytest.importorskip("boto3", reason="boto3 is a dependency of vlmq")
    server = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    assert server, "moto_server is in the dev extra (moto[server])"
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        helpers.wait_for(lambda: _listening(port), 300, "moto_server to listen")
        aws_env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing-key",
                   "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}
        client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, aws_access_key_id="testing-key",
            aws_secret_access_key=secret, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        yield S3(endpoint, aws_env, client)
    finally:
        helpers.stop_all([proc])


def store_worker(s3: S3, redis_url: str, model: Path, tmp: Path, *, stores: str,
                 name: str, queues: str) -> subprocess.Popen[str]:
    """A worker whose S3 settings come from the standard AWS environment only, with the
    stores `stores` (VLMQ_STORES) and its vision cache under `tmp`."""
    import os

    env = {**os.environ, **s3.aws_env, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1",
           "VLMQ_STORES": stores}
    return subprocess.Popen(
        [helpers.VLMQ, "worker", "--model", str(model), "--name", name,
         "--cache-dir", str(tmp / "vision-cache"), "--queues", queues],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
