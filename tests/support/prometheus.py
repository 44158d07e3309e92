"""A real Prometheus (the Debian package: `prometheus` and `promtool`) for the metrics
tests: started on a free port with a config and data folder of the test's own."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import helpers
from vlmq.worker.redis_server import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
MISSING = ("no Prometheus here ({0}): install the Debian package `prometheus` "
           "(apt-get install -y prometheus; .ci/dev.py does, as root)")


def require(binary: str) -> None:
    """Skip the test, saying why, where the package is not installed."""
    if not Path(binary).exists():
        pytest.skip(MISSING.format(binary))


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


@dataclass
class Prometheus:
    proc: subprocess.Popen[str]
    port: int
    log: Path

    def api(self, path: str, **params: str) -> Any:
        """The `data` of a successful /api/v1 answer."""
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        code, body = get(f"http://127.0.0.1:{self.port}/api/v1/{path}{query}", timeout=30)
        assert code == 200, body
        out = json.loads(body)
        assert out["status"] == "success", out
        return out["data"]

    def scalar(self, promql: str) -> float | None:
        """The first sample's value of an instant query, None when it has none."""
        rows = self.api("query", query=promql)["result"]
        return float(rows[0]["value"][1]) if rows else None

    def alert_states(self) -> dict[str, str]:
        """Each active alert's state (pending, firing), by alert name."""
        return {a["labels"]["alertname"]: a["state"] for a in self.api("alerts")["alerts"]}

    def ready(self, timeout: float = 300) -> None:
        def answers() -> bool:
            try:
                return get(f"http://127.0.0.1:{self.port}/-/ready", timeout=10)[0] == 200
            except OSError:
                return False

        helpers.wait_for(answers, timeout, "Prometheus to be ready; its log:\n"
                         + (self.log.read_text() if self.log.exists() else ""))


def start(tmp: Path, targets: dict[str, int], *, interval: str = "2s",
          rules: Path | None = None) -> Prometheus:
    """Prometheus scraping 127.0.0.1:PORT for each job name, evaluating `rules` (a rules
    file) every `interval`. A scrape may take seconds on a busy machine, and one past its
    timeout reads as down: the timeout is the whole interval."""
    require(PROMETHEUS)
    port = free_port()
    config = tmp / "prometheus.yml"
    jobs = "".join(f"  - job_name: {name}\n    static_configs:\n"
                   f"      - targets: ['127.0.0.1:{p}']\n" for name, p in targets.items())
    files = f"rule_files:\n  - {rules}\n" if rules is not None else ""
    config.write_text(f"global:\n  scrape_interval: {interval}\n  scrape_timeout: {interval}\n"
                      f"  evaluation_interval: {interval}\n{files}scrape_configs:\n{jobs}")
    check = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True,
                           text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    log = tmp / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return Prometheus(proc, port, log)


def check_metrics(text: str) -> tuple[int, str]:
    """`promtool check metrics` on an exposition: its exit code and what it said."""
    require(PROMTOOL)
    res = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=60, check=False)
    return res.returncode, res.stdout + res.stderr


def check_rules(path: Path) -> tuple[int, str]:
    require(PROMTOOL)
    res = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60, check=False)
    return res.returncode, res.stdout + res.stderr
