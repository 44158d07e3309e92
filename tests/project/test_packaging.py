"""The distribution as a user gets it: `python -m build` as a release makes it, a real wheel in
fresh venvs (a producer host with no MLX; a worker host with the worker extra), outside the
checkout."""

from __future__ import annotations

import email
import os
import re
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tests.support.helpers import make_pdf
from vlmq.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).parent / "uv"
pytestmark = pytest.mark.slow
# A path that exists only in a checkout: what help text and logs must never send a user to.
CHECKOUT_PATH = re.compile(r"(?<![\w/.-])(?:docs|benchmarks|tests|\.ci|cli|producer|worker|shared|"
                           r"media|stores)/[\w./-]*\w|\b[\w-]+\.md\b(?!\|)")


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel, built by `python -m build` (the wheel from the sdist)."""
    out = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run([sys.executable, "-m", "build", "--installer", "uv", "-o", str(out),
                           str(ROOT)], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    warnings = [line for line in (done.stdout + done.stderr).splitlines()
                if re.search(r"warn|ignored|deprecat", line, re.I)]
    assert warnings == [], warnings
    (wheel,) = out.glob("vlmq-*.whl")
    (sdist,) = out.glob("vlmq-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_the_distributions_carry_the_license_and_the_metadata(dists: dict[str, Path]) -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License")
    with zipfile.ZipFile(dists["wheel"]) as whl:
        names = whl.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(whl.read(meta_name))
        (lic,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert whl.read(lic).decode() == license_text
    assert meta["License-Expression"] == "MIT"
    assert meta["License-File"] == "LICENSE"
    assert meta["Author-email"] and meta["Keywords"] and "ocr" in meta["Keywords"]
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert meta["Requires-Python"] == ">=3.11"
    with tarfile.open(dists["sdist"]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
        assert sdist.extractfile(f"{dists['sdist'].name[:-7]}/LICENSE").read().decode() \
            == license_text  # type: ignore[union-attr]
    # The sdist holds what the suite needs: the lock, the set-up script, the tests.
    for needed in ("LICENSE", "uv.lock", ".ci/dev.py", ".ci/run", "tests/conftest.py",
                   "tests/project/test_lock.py", "benchmarks/run.py", "docs/jobs.md",
                   "docker-compose.yml", "shared/enqueue.lua", "shared/PROTOCOL.md"):
        assert needed in members, needed
    assert not [m for m in members if "__pycache__" in m or m.endswith(".pyc")]


def test_help_text_names_no_path_that_only_a_checkout_has() -> None:
    """`vlmq --help` and every subcommand's, down the tree: a page is `vlmq help TOPIC`."""
    runner = CliRunner()
    seen: list[str] = []

    def walk(args: list[str], command: click.Command) -> None:
        result = runner.invoke(main, [*args, "--help"], terminal_width=200)
        assert result.exit_code == 0, (args, result.output)
        seen.append(" ".join(args))
        assert not CHECKOUT_PATH.findall(result.output), (args, CHECKOUT_PATH.findall(
            result.output))
        for topic in re.findall(r"vlmq help ([\w-]+)", result.output):
            assert runner.invoke(main, ["help", topic]).exit_code == 0, (args, topic)
        if isinstance(command, click.Group):
            with click.Context(command) as ctx:
                for name in command.list_commands(ctx):
                    sub = command.get_command(ctx, name)
                    assert sub is not None
                    walk([*args, name], sub)

    walk([], main)
    assert {"", "enqueue", "enqueue ocr", "worker", "model make-tiny", "demo", "help"} \
        <= set(seen)
    assert len(seen) > 30


def test_wheel_installs_the_vlmq_packages_only_and_runs_without_mlx(
        tmp_path: Path, dists: dict[str, Path]) -> None:
    wheel = dists["wheel"]
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"vlmq", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for needed in ("vlmq/cli/main.py", "vlmq/cli/demo.py", "vlmq/cli/jobs.py",
                   "vlmq/worker/loop.py", "vlmq/worker/model/families/qwen2_vl.py",
                   "vlmq/shared/enqueue.lua", "vlmq/shared/messages.py",
                   "vlmq/media/opener.py", "vlmq/media/py.typed", "vlmq/stores/backends.py",
                   "vlmq/producer/samples/document.pdf", "vlmq/producer/samples/reader.pdf",
                   "vlmq/producer/samples/reader.json", "vlmq/worker/model/reader/train.py",
                   "vlmq/worker/model/reader/weights/model.safetensors",
                   "vlmq/worker/model/reader/weights/tokenizer.json",
                   "vlmq/server/dashboard/templates/job.html",
                   "vlmq/server/dashboard/static/style.css",
                   "vlmq/server/scheduler.py", "vlmq/server/metrics_exporter.py",
                   "vlmq/server/openai_api/app.py", "vlmq/producer/fleet.py",
                   "vlmq/docs/jobs.md", "vlmq/docs/install.md", "vlmq/shared/PROTOCOL.md"):
        assert needed in names

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True,
                   capture_output=True)
    helptext = subprocess.run([str(env_dir / "bin" / "vlmq"), "--help"], check=True,
                              capture_output=True, text=True).stdout
    for command in ("enqueue", "jobs", "status", "wait", "result", "cancel", "retry", "delete",
                    "worker", "model", "demo", "dashboard", "help"):
        assert command in helptext
    # The documentation ships: `vlmq help` lists the pages, `vlmq help jobs` prints one.
    topics = subprocess.run([str(env_dir / "bin" / "vlmq"), "help"], check=True,
                            capture_output=True, text=True, cwd=tmp_path).stdout
    assert "jobs" in topics and "PROTOCOL" in topics and "Jobs: enqueue" in topics, topics
    page = subprocess.run([str(env_dir / "bin" / "vlmq"), "help", "jobs"], check=True,
                          capture_output=True, text=True, cwd=tmp_path).stdout
    assert page == (ROOT / "docs" / "jobs.md").read_text()
    # The worker's commands are listed on a producer-only install, and say what is missing.
    worker = subprocess.run([str(env_dir / "bin" / "vlmq"), "worker", "--model", "m"],
                            capture_output=True, text=True, check=False)
    assert worker.returncode == 78  # EX_CONFIG: the service units do not restart it
    assert worker.stderr.startswith("vlmq: error: this command needs the worker extra")
    assert "vlmq[worker]" in worker.stderr
    assert "Traceback" not in worker.stderr
    dash = subprocess.run([str(env_dir / "bin" / "vlmq"), "dashboard"], capture_output=True,
                          text=True, check=False)
    assert dash.returncode == 78 and "needs the dashboard extra" in dash.stderr, dash.stderr
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
    probe = ("import sys; from vlmq.server.dashboard.app import Settings, create_app; "
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


def test_wheel_with_the_worker_extra_serves_a_users_pdf_outside_the_checkout(
        tmp_path: Path, dists: dict[str, Path], redis_url: str, tiny_model: Path) -> None:
    """A worker host as `pip install 'vlmq[worker]'` makes it (at the lock's versions): the
    version, the demo, and a burst worker on a PDF in the user's own folder."""
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(subprocess.run(
        [str(UV), "export", "--frozen", "--no-hashes", "--no-emit-project", "--no-header",
         "--extra", "worker"], cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    env_dir = tmp_path / "venv"
    subprocess.run([str(UV), "venv", "-q", "--python", sys.executable, str(env_dir)],
                   check=True, capture_output=True)
    subprocess.run([str(UV), "pip", "install", "-q", "--python", str(env_dir / "bin" / "python"),
                    "-c", str(constraints), f"{dists['wheel']}[worker]"], check=True,
                   capture_output=True, cwd=tmp_path)
    vlmq = str(env_dir / "bin" / "vlmq")
    home = tmp_path / "home"  # the user's folder, far from the checkout
    home.mkdir()
    env = {**os.environ, "REDIS_URL": redis_url, "VLMQ_CACHE": str(tmp_path / "cache"),
           "PYTHONUNBUFFERED": "1"}

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([vlmq, *args], cwd=home, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)

    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == "vlmq 0.1.0", version
    demo = run("demo", timeout=600)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert re.search(r"CER", demo.stdout), demo.stdout
    (home / "scans").mkdir()
    pdf = make_pdf(home / "scans" / "letter.pdf", 2)
    job = run("enqueue", "ocr", str(pdf), "--max-side", "112", "--max-tokens", "8")
    assert job.returncode == 0, job.stderr
    worker = run("worker", "--model", str(tiny_model), "--burst", "--name", "wheel",
                 "--cache-dir", str(tmp_path / "vision-cache"))
    assert worker.returncode == 0, worker.stdout + worker.stderr
    log = worker.stdout + worker.stderr
    assert f"job {job.stdout.strip()} finished" in log, log
    assert not CHECKOUT_PATH.findall(log), CHECKOUT_PATH.findall(log)
    result = run("result", job.stdout.strip(), "--format", "jsonl")
    assert result.returncode == 0 and result.stdout.count("\n") == 2, result
