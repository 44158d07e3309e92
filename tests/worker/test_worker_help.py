"""`vlmq worker --help` says the defaults the code uses: each figure in a help text comes
from the constant the code reads, and the docs say the BLAS thread rule the worker runs."""

from __future__ import annotations

import os
import re
from pathlib import Path

from click.testing import CliRunner
from redis import Redis

from vlmq.cli.worker import worker_cmd
from vlmq.shared import constants as C
from vlmq.shared.chat import CHAT_QUEUE
from vlmq.worker import options
from vlmq.worker.engine.batch_size import DEFAULT_CAP, FLOOR
from vlmq.worker.jobs.running import BatchWorker
from vlmq.worker.model import blas

ROOT = Path(__file__).resolve().parents[2]


def worker_help() -> str:
    out = CliRunner().invoke(worker_cmd, ["--help"], terminal_width=10_000).output
    return re.sub(r"\s+", " ", out)


def test_help_lists_every_default_queue() -> None:
    text = worker_help()
    assert f"default: {CHAT_QUEUE},{','.join(C.DEFAULT_QUEUE[t] for t in C.TASKS)})" in text
    assert options.DEFAULT_QUEUES[0] == CHAT_QUEUE  # interactive requests first


def test_help_figures_come_from_the_code() -> None:
    text = worker_help()
    assert f"starts at {FLOOR} and grows" in text and f"[default: {DEFAULT_CAP};" in text
    assert f"at most {options.MAX_DEFAULT_PREP_THREADS})" in text
    assert options.config_default("prep_threads") == min(options.MAX_DEFAULT_PREP_THREADS,
                                                         os.cpu_count() or 2)
    assert f"(default {options.DEFAULT_HEARTBEAT_TTL_S})" in text
    assert f"BLAS threads: {options.WORKER_THREADS_RULE}." in text


def test_heartbeat_default_is_the_workers(redis: Redis) -> None:
    worker = BatchWorker(["q"], connection=redis, name="help-check")
    assert worker.heartbeat_ttl == options.DEFAULT_HEARTBEAT_TTL_S


def test_blas_rule_is_what_the_worker_does_and_what_docs_say() -> None:
    assert options.WORKER_THREADS_RULE == blas.WORKER_THREADS_RULE
    assert blas.worker_threads(1) == max(1, blas.cores() - 1)
    assert blas.worker_threads(blas.cores() + 5) == 1
    install = re.sub(r"\s+", " ", (ROOT / "docs" / "install.md").read_text())
    assert blas.WORKER_THREADS_RULE in install
    assert "default: all cores" not in install
