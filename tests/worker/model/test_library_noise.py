"""Library lines that mean nothing to a vlmq user are dropped where the library logs them.

transformers says "PyTorch was not found" when it is first imported (vlmq runs MLX). The
filter used to be added by `vlmq worker` before its imports, so anything that imported the
worker another way (`vlmq demo`, a program using the worker) printed the line first: the
worker's own import pulled transformers in through llguidance. Now that import happens
where it is needed, after the filter (worker/engine/constraints.py, mlx_adapter.load_model).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import VLMQ

NOISE = ("PyTorch", "TensorFlow", "Flax", "[transformers]")

FIRST_IMPORT = """
import sys
import vlmq.worker.loop  # the whole worker, as `vlmq demo` imports it
assert "transformers" not in sys.modules, "importing the worker imported transformers"
from vlmq.worker.engine.constraints import Structured
try:  # llguidance's tokenizer import is where the worker's first transformers import was
    Structured(None, frozenset()).tokenizer
except ValueError as exc:  # not a fast tokenizer: the import had happened
    assert "fast tokenizers" in str(exc), exc
assert "transformers" in sys.modules
"""


def noisy(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(word in line for word in NOISE)]


def test_the_worker_imports_transformers_only_behind_the_filter() -> None:
    proc = subprocess.run([sys.executable, "-c", FIRST_IMPORT], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert not noisy(proc.stdout + proc.stderr), proc.stderr


@pytest.mark.slow
def test_vlmq_demo_shows_no_library_noise(redis_url: str, tmp_path: Path) -> None:
    """The command a new user runs first; its first line was transformers' on PyTorch."""
    env = {**os.environ, "REDIS_URL": redis_url, "VLMQ_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([VLMQ, "demo", "--model", "tiny"], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not noisy(proc.stdout + proc.stderr), proc.stderr
    assert " INFO vlmq.worker: " in proc.stderr  # the worker's lines, as `vlmq worker` logs
