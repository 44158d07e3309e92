"""rq-dashboard as docker-compose.yml runs it: its own command line, with the config module
mounted the way compose mounts it, against a real Redis holding vlmq jobs in every state
and a busy worker. Every JSON endpoint its pages call answers 200, with no traceback."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from redis import Redis

from tests.support.dashboard_data import Dataset, dataset
from vlmq.worker.redis_server import free_port

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "docker-compose.yml"
BIN = Path(sys.executable).parent
REGISTRIES = ("queued", "started", "finished", "failed", "deferred", "scheduled", "canceled")
pytestmark = pytest.mark.slow


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_is_valid_and_safe() -> None:
    services = compose()["services"]
    redis, dash = services["redis"], services["rq-dashboard"]
    for service in (redis, dash):
        assert service["restart"] == "unless-stopped"
        assert all(str(p).startswith("127.0.0.1:") for p in service["ports"]), service["ports"]
    shell, flag, script = dash["command"]
    assert (shell, flag) == ("sh", "-c")
    subprocess.run(["sh", "-n", "-c", script], check=True)  # the old `>` block failed here
    assert "\n" not in script.strip()
    for needed in ("six", "--json", "-c vlmq_rq_dashboard", "rq>=3.0,<3.1", "--disable-delete"):
        assert needed in script
    source, target = dash["volumes"][0].split(":")[:2]
    assert (ROOT / source).is_file()
    assert Path(target).name == "vlmq_rq_dashboard.py"
    assert Path(target).parent.as_posix() == dash["environment"]["PYTHONPATH"]


def start(redis_url: str, tmp: Path, *, with_config: bool) -> tuple[subprocess.Popen[str], str]:
    """The compose command after its pip install, pointed at this test's Redis."""
    script = compose()["services"]["rq-dashboard"]["command"][2]
    run = script.split("&&", 1)[1].strip().removeprefix("exec ")
    port = free_port()
    run = run.replace("redis://redis:6379/0", redis_url).replace("--bind 0.0.0.0",
                                                                 "--bind 127.0.0.1")
    run = re.sub(r"--port \d+", f"--port {port}", run)
    if not with_config:
        run = run.replace("-c vlmq_rq_dashboard", "")
    mount = tmp / "etc-vlmq"
    mount.mkdir(exist_ok=True)
    shutil.copy(ROOT / "server/dashboard/rq_dashboard_config.py",
                mount / "vlmq_rq_dashboard.py")
    env = {**os.environ, "PYTHONPATH": str(mount), "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.Popen(["sh", "-c", run], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(base + "/0/data/queues.json", timeout=5).close()
            return proc, base
        except (urllib.error.URLError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"rq-dashboard did not start: {stop(proc)}") from None
            time.sleep(0.3)


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    return out


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.fixture
def data(redis_url: str, redis: Redis, tmp_path: Path) -> Iterator[Dataset]:
    with dataset(redis_url, redis, tmp_path) as d:
        yield d


def test_every_endpoint_answers_with_a_busy_worker(redis_url: str, data: Dataset,
                                                   tmp_path: Path) -> None:
    proc, base = start(redis_url, tmp_path, with_config=True)
    try:
        urls = ["/", "/0/view/workers", "/0/view/jobs", "/0/data/queues.json",
                "/0/data/workers.json"]
        urls += [f"/0/data/jobs/{q}/{r}/8/asc/1.json" for q in ("ocr", "later")
                 for r in REGISTRIES]
        for job_id in (data.finished, data.failed, data.running, data.queued):
            urls += [f"/0/data/job/{job_id}.json", f"/0/view/job/{job_id}"]
        statuses = {url: get(base + url) for url in urls}
        with urllib.request.urlopen(base + "/0/data/workers.json", timeout=30) as resp:
            workers = resp.read().decode()
        delete = urllib.request.Request(f"{base}/job/{data.finished}/delete", method="POST")
        with urllib.request.urlopen(delete, timeout=30) as resp:
            assert b"DISABLED" in resp.read()
    finally:
        log = stop(proc)
    assert {u: s for u, s in statuses.items() if s != 200} == {}, log
    assert data.life.worker.name in workers and data.running in workers
    assert Redis.from_url(redis_url).exists(f"rq:job:{data.finished}")
    assert "Traceback" not in log and "Error" not in log, log


def test_without_the_config_module_a_busy_worker_breaks_the_workers_page(
        redis_url: str, data: Dataset, tmp_path: Path) -> None:
    """Pins the upstream fault the config module exists for; if rq-dashboard fixes it,
    this fails and the module can go."""
    proc, base = start(redis_url, tmp_path, with_config=False)
    try:
        status = get(base + "/0/data/workers.json")
    finally:
        log = stop(proc)
    assert status == 500
    assert "DeserializationError" in log or "UnpicklingError" in log, log
