"""rq-dashboard as docker-compose.yml runs it: its own command line, with the config module
the compose file carries placed where compose places it, against a real Redis holding vlmq
jobs in every state and a busy worker. Every JSON endpoint its pages call answers 200, with
no traceback. The image it builds pins every package to uv.lock's version."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import tomllib
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


def locked_versions() -> dict[str, str]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text(encoding="utf-8"))
    return {p["name"]: p["version"] for p in lock["package"]}


def test_compose_file_is_valid_and_safe() -> None:
    spec = compose()
    services = spec["services"]
    redis, dash = services["redis"], services["rq-dashboard"]
    for service in (redis, dash):
        assert service["restart"] == "unless-stopped"
        assert all(str(p).startswith("127.0.0.1:") for p in service["ports"]), service["ports"]
    command = dash["command"]
    assert command[0] == "rq-dashboard"
    for needed in ("--json", "--disable-delete"):
        assert needed in command
    assert command[command.index("-c") + 1] == "vlmq_rq_dashboard"
    # Nothing from a checkout: no bind mount, no build context, the module carried whole.
    assert "volumes" not in dash and set(dash["build"]) == {"dockerfile_inline"}
    (config,) = dash["configs"]
    assert Path(config["target"]).name == "vlmq_rq_dashboard.py"
    assert Path(config["target"]).parent.as_posix() == dash["environment"]["PYTHONPATH"]
    assert spec["configs"][config["source"]]["content"] == \
        (ROOT / "server/dashboard/rq_dashboard_config.py").read_text(encoding="utf-8")


def test_the_dashboard_image_pins_what_it_installs_to_the_lock() -> None:
    dockerfile = compose()["services"]["rq-dashboard"]["build"]["dockerfile_inline"]
    assert "$" not in dockerfile  # compose would interpolate it
    run = " ".join(dockerfile.replace("\\\n", " ").split("RUN ", 1)[1].split())
    words = run.split()
    assert words[:3] == ["pip", "install", "--no-cache-dir"], words
    pins = dict(w.split("==", 1) for w in words[3:])
    assert all("==" in w for w in words[3:]), words
    locked = locked_versions()
    assert {"rq-dashboard", "rq", "six"} <= set(pins)
    assert {n: v for n, v in pins.items() if locked.get(n, v) != v} == {}
    # The whole set, so no dependency floats: what rq-dashboard and six need, here.
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    needed, todo = set(), ["rq-dashboard", "six"]
    while todo:
        dist = distribution(todo.pop())
        name = dist.metadata["Name"].lower()
        if name not in needed:
            needed.add(name)
            todo += [r.name for r in map(Requirement, dist.requires or [])
                     if r.marker is None or r.marker.evaluate({"extra": ""})]
    assert {n.lower() for n in pins} == needed


def start(redis_url: str, tmp: Path, *, with_config: bool) -> tuple[subprocess.Popen[str], str]:
    """The compose command, pointed at this test's Redis, with the module compose carries
    where compose puts it."""
    spec = compose()
    dash = spec["services"]["rq-dashboard"]
    port = free_port()
    run = " ".join(dash["command"]).replace("redis://redis:6379/0", redis_url)
    run = re.sub(r"--port \d+", f"--port {port}", run.replace("--bind 0.0.0.0",
                                                               "--bind 127.0.0.1"))
    if not with_config:
        run = run.replace("-c vlmq_rq_dashboard", "")
    (config,) = dash["configs"]
    mount = tmp / "etc-vlmq"
    mount.mkdir(exist_ok=True)
    (mount / Path(config["target"]).name).write_text(
        spec["configs"][config["source"]]["content"], encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(mount), "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.Popen(run.split(), env=env, stdout=subprocess.PIPE,
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
