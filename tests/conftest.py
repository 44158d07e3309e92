"""Shared fixtures: a real Redis db per test, the tiny model built once per session, worker
and other subprocesses killed at teardown, and the in-process CLI."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import Result
from redis import Redis

from tests.support import helpers
from vlmq.shared.keys import Keys
from vlmq.worker.model import blas
from vlmq.worker.redis_server import start_private

# Before any test imports MLX: the same BLAS a default worker picks ($VLMQ_BLAS, else auto).
blas.select()

# pytest-xdist's worker processes start with SIGINT ignored, and an ignored signal stays
# ignored across exec: every process a test starts would then ignore Ctrl-C, and Python
# would not even install its KeyboardInterrupt handler. Caught here, it is default again
# in children, as in a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A config file or VLMQ_<COMMAND>_<OPTION> variable of the person running the suite must not
# change what the commands under test do (cli/config.py).
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="vlmq-test-config-")
for _name in [n for n in os.environ if n.startswith(("VLMQ_WORKER_", "VLMQ_ENQUEUE_"))
              or n in ("VLMQ_CONFIG", "VLMQ_REDIS_URL")]:
    del os.environ[_name]

REDIS_BASE = os.environ.get("VLMQ_TEST_REDIS", "redis://127.0.0.1:6379")
# Tests own these db indexes: a test claims a free one (so two test runs on one Redis
# never share a db), empties it, and empties it again afterwards.
TEST_DBS = tuple(range(9, 16))
CLAIM_KEY = "__vlmq_test_claim__"
_order = itertools.count()


def _clear(conn: Redis, *, keep_claim: bool) -> None:
    for key in conn.scan_iter(count=1000):
        if not (keep_claim and key == CLAIM_KEY.encode()):
            conn.delete(key)


@contextmanager
def _claimed_db() -> Iterator[str]:
    """URL of an empty Redis db claimed for the caller alone; emptied afterwards."""
    start = next(_order)
    deadline = time.monotonic() + 120
    while True:
        for k in range(len(TEST_DBS)):
            db = TEST_DBS[(start + k) % len(TEST_DBS)]
            conn = Redis.from_url(f"{REDIS_BASE}/{db}")
            try:
                claimed = conn.set(CLAIM_KEY, str(os.getpid()), nx=True, ex=900)
            except OSError as exc:  # redis' ConnectionError is an OSError
                pytest.fail(f"Redis is not reachable at {REDIS_BASE}: {exc}")
            if claimed:
                break
            conn.close()
        else:
            if time.monotonic() > deadline:
                pytest.fail(f"no free test db among {TEST_DBS} on {REDIS_BASE}")
            time.sleep(0.5)
            continue
        break
    _clear(conn, keep_claim=True)
    try:
        yield f"{REDIS_BASE}/{db}"
    finally:
        _clear(conn, keep_claim=False)
        conn.close()


@pytest.fixture
def redis_url() -> Iterator[str]:
    """URL of an empty Redis db that this test alone uses; emptied afterwards."""
    with _claimed_db() as url:
        yield url


@pytest.fixture(scope="module")
def module_redis_url() -> Iterator[str]:
    """The same, shared by one module's tests (e.g. with one worker serving them all)."""
    with _claimed_db() as url:
        yield url


@pytest.fixture
def redis(redis_url: str) -> Iterator[Redis]:
    conn = Redis.from_url(redis_url)
    yield conn
    conn.close()


@pytest.fixture
def own_redis() -> Iterator[Redis]:
    """A redis-server of this test's own, on a free port: for figures that are server-wide
    (used_memory, command counts) or settings the shared server must not get."""
    try:
        server = start_private()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    conn = Redis.from_url(server.url)
    try:
        yield conn
    finally:
        conn.close()
        server.stop()


@pytest.fixture
def keys() -> Keys:
    return Keys()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen2_vl tiny random-weight model, built once per session."""
    from vlmq.worker.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2_vl"), arch="qwen2_vl", seed=0)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Subprocesses the test starts (append them): killed at teardown, whatever happened."""
    started: list[subprocess.Popen[str]] = []
    yield started
    helpers.stop_all(started)


@pytest.fixture
def start_worker(procs: list[subprocess.Popen[str]]) -> helpers.Spawn:
    """helpers.start_worker, with the worker killed at teardown."""

    def start(*args: object, **kw: str) -> subprocess.Popen[str]:
        proc = helpers.start_worker(*args, **kw)  # type: ignore[arg-type]
        procs.append(proc)
        return proc

    return start


@pytest.fixture
def run_cli(redis_url: str) -> Callable[..., Result]:
    """`vlmq ARGS...` in process against this test's Redis db; `code=N` also checks the exit
    code (the output is in the assertion message)."""

    def run(*args: str, code: int | None = None) -> Result:
        res = helpers.invoke_cli(redis_url, *args)
        if code is not None:
            assert res.exit_code == code, (res.stdout, res.stderr)
        return res

    return run
