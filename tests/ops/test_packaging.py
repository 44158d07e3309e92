"""The distribution as a producer host gets it: a real wheel in a fresh venv, no MLX."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_wheel_installs_the_vlmq_packages_only_and_runs_without_mlx(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True)
    (wheel,) = dist.glob("vlmq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"vlmq", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for needed in ("vlmq/cli/main.py", "vlmq/cli/demo.py", "vlmq/cli/jobs.py",
                   "vlmq/worker/loop.py", "vlmq/worker/engine/families/qwen2_vl.py",
                   "vlmq/shared/enqueue.lua", "vlmq/shared/messages.py",
                   "vlmq/media/opener.py", "vlmq/media/py.typed", "vlmq/stores/backends.py",
                   "vlmq/producer/samples/document.pdf", "vlmq/producer/samples/reader.pdf",
                   "vlmq/producer/samples/reader.json", "vlmq/worker/model/reader/train.py",
                   "vlmq/worker/model/reader/weights/model.safetensors",
                   "vlmq/worker/model/reader/weights/tokenizer.json",
                   "vlmq/producer/ops/dashboard/templates/job.html",
                   "vlmq/producer/ops/dashboard/static/style.css"):
        assert needed in names

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True,
                   capture_output=True)
    helptext = subprocess.run([str(env_dir / "bin" / "vlmq"), "--help"], check=True,
                              capture_output=True, text=True).stdout
    for command in ("enqueue", "jobs", "status", "wait", "result", "cancel", "retry", "delete",
                    "worker", "model", "demo", "dashboard"):
        assert command in helptext
    # The worker's commands are listed on a producer-only install, and say what is missing.
    worker = subprocess.run([str(env_dir / "bin" / "vlmq"), "worker", "--model", "m"],
                            capture_output=True, text=True, check=False)
    assert worker.returncode == 1
    assert "needs the worker extra" in worker.stderr and "vlmq[worker]" in worker.stderr
    assert "Traceback" not in worker.stderr
    dash = subprocess.run([str(env_dir / "bin" / "vlmq"), "dashboard"], capture_output=True,
                          text=True, check=False)
    assert dash.returncode == 2 and "needs the dashboard extra" in dash.stderr, dash.stderr
    assert "vlmq[dashboard]" in dash.stderr and "Traceback" not in dash.stderr
    probe = ("import importlib.util, sys; import vlmq.producer, vlmq.cli.jobs, "
             "vlmq.producer.client, vlmq.shared.enqueue; "
             "assert importlib.util.find_spec('mlx') is None, 'mlx is installed'; "
             "assert not any(m.startswith(('mlx', 'numpy')) for m in sys.modules), "
             "sorted(m for m in sys.modules if m.startswith(('mlx', 'numpy'))); print('ok')")
    out = subprocess.run([str(py), "-c", probe], check=True, capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.stdout.strip() == "ok"

    # With the dashboard extra (still no MLX) the dashboard serves its packaged templates.
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"{wheel}[dashboard]"], check=True,
                   capture_output=True)
    probe = ("import sys; from vlmq.producer.ops.dashboard.app import Settings, create_app; "
             "r = create_app(Settings('redis://127.0.0.1:1/0')).test_client().get('/'); "
             "assert r.status_code == 503 and b'Redis unreachable' in r.data, r.data; "
             "assert not any(m.startswith('mlx') for m in sys.modules); print('ok')")
    out = subprocess.run([str(py), "-c", probe], check=True, capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.stdout.strip() == "ok"

def test_cuda_extra_brings_the_cuda_backend_and_not_the_cpu_one() -> None:
    """mlx-cpu and mlx-cuda-12 both install mlx/lib/libmlx.so: an extra must bring one."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in requires("vlmq") or []]

    def wanted(extra: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out: set[str] = set()
        for r in reqs:
            if r.marker is None or not r.marker.evaluate({"extra": extra,
                                                          "sys_platform": "linux"}):
                continue
            if r.name == "vlmq":
                for sub in r.extras - seen:
                    out |= wanted(sub, seen | {extra})
            else:
                out |= {f"{r.name}[{e}]" for e in r.extras} or {r.name}
        return out

    cuda, cpu = wanted("cuda"), wanted("worker")
    assert "mlx[cuda12]" in cuda and "mlx[cpu]" not in cuda, cuda
    assert "mlx[cpu]" in cpu and "mlx[cuda12]" not in cpu, cpu
    assert {"mlx-vlm", "opencv-python"} <= cuda & cpu
