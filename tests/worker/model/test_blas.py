"""The BLAS a worker runs MLX on: MKL by default where the worker extra installs it (Linux
x86_64), else OpenBLAS; the reference on request.

Read from the running worker's own /proc/<pid>/maps and its stats hash, not from what
the code meant to do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.helpers import finish, wait_for
from vlmq.shared.keys import Keys
from vlmq.worker.model import blas

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="BLAS choice is Linux only")]


def _fast_files(pid: int) -> set[str]:
    return {p for p in blas.mapped_libraries(pid)
            if Path(p).name.startswith(("libopenblas", "libmkl_rt"))}


def test_default_worker_runs_a_fast_blas_and_reference_does_not(
        redis_url: str, tiny_model: Path, tmp_path: Path, keys: Keys, procs: list) -> None:
    default = helpers.start_worker(redis_url, tiny_model, tmp_path / "a", name="wdef")
    ref = helpers.start_worker(redis_url, tiny_model, tmp_path / "b", "--blas", "reference",
                               name="wref")
    procs += [default, ref]
    redis = Redis.from_url(redis_url, decode_responses=True)
    for name in ("wdef", "wref"):
        wait_for(lambda n=name: redis.hexists(keys.worker_stats(n), "blas"), 120,
                 f"stats of {name}")
    got = redis.hgetall(keys.worker_stats("wdef"))
    library = got["blas_library"]
    mkl = blas.mkl_candidates()
    kind, prefix = ("mkl", "libmkl_rt") if mkl else ("openblas", "libopenblas")
    assert got["blas"].startswith(f"{kind} "), got["blas"]
    assert Path(library).name.startswith(prefix) and Path(library).is_file()
    assert library in _fast_files(default.pid)

    got_ref = redis.hgetall(keys.worker_stats("wref"))
    assert got_ref["blas"].startswith("reference"), got_ref["blas"]
    assert got_ref["blas_library"] == ""
    assert _fast_files(ref.pid) == set()
    assert any("mlx_cpu.libs/libblas" in p for p in blas.mapped_libraries(ref.pid))

    logs = []
    for proc in (default, ref):
        proc.terminate()
        rc, out = finish(proc, timeout=300)
        assert rc == 0, out
        logs.append(out)
    sources = ("(wheel mkl",) if mkl else ("(wheel opencv-python", "(system")
    assert any(f"BLAS: {kind} {library} {s}" in logs[0] for s in sources), logs[0]
    assert "BLAS: reference (requested)" in logs[1], logs[1]


@pytest.mark.parametrize(("value", "via_env"), [("/nonexistent/libblas.so", False),
                                                ("fastest", True)])
def test_unusable_blas_choice_is_refused_before_loading(
        redis_url: str, tiny_model: Path, tmp_path: Path, value: str, via_env: bool,
        procs: list, monkeypatch: pytest.MonkeyPatch) -> None:
    if via_env:
        monkeypatch.setenv("VLMQ_BLAS", value)
    args = () if via_env else ("--blas", value)
    proc = helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst", *args)
    procs.append(proc)
    rc, out = finish(proc, timeout=300)
    assert rc == 78  # EX_CONFIG: a service does not restart it
    assert f"{value!r} is neither auto, reference nor an existing library file" in out
    assert "loading model" not in out
