"""Shared fixtures: a real Redis db per test, and the tiny model built once per session."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from vlmq.shared.keys import Keys

REDIS_BASE = os.environ.get("VLMQ_TEST_REDIS", "redis://127.0.0.1:6379")
# Tests own these db indexes outright: each is flushed before and after use.
TEST_DBS = tuple(range(9, 16))
_next_db = itertools.cycle(TEST_DBS)


@pytest.fixture
def redis_url() -> Iterator[str]:
    """URL of an empty Redis db that this test alone uses; flushed afterwards."""
    db = next(_next_db)
    url = f"{REDIS_BASE}/{db}"
    conn = Redis.from_url(url)
    try:
        conn.ping()
    except OSError as exc:  # redis raises ConnectionError, a subclass of OSError
        pytest.fail(f"Redis is not reachable at {REDIS_BASE}: {exc}")
    conn.flushdb()
    yield url
    conn.flushdb()
    conn.close()


@pytest.fixture
def redis(redis_url: str) -> Iterator[Redis]:
    conn = Redis.from_url(redis_url)
    yield conn
    conn.close()


@pytest.fixture
def keys() -> Keys:
    return Keys()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen2_vl tiny random-weight model, built once per session."""
    from vlmq.worker.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2_vl"), arch="qwen2_vl", seed=0)
