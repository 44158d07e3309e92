"""Logs as operators read them (cli/logs.py, shared/logs.py): every long-running command
takes the same --log-level, -v, -q and --log-format; text lines carry the level, JSON lines
parse one by one and name the job and item they are about, and no line is a library's
noise (transformers on PyTorch)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from tests.support.helpers import VLMQ, Output, make_images
from vlmq.cli.api import api_cmd
from vlmq.cli.dashboard import dashboard_cmd
from vlmq.cli.logs import JsonFormatter, LogSettings
from vlmq.cli.metrics import metrics_cmd
from vlmq.cli.schedules import scheduler_cmd
from vlmq.cli.worker import worker_cmd
from vlmq.producer.client import Client
from vlmq.shared import logs
from vlmq.worker.redis_server import free_port

QUEUE = "logs-q"
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
                       r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: \S")
JSON_KEYS = {"time", "level", "logger", "message"}
NOISE = ("PyTorch", "TensorFlow", "Flax", "[transformers]")


def log_params(command: click.Command) -> dict[str, Any]:
    names = {option.name for option in logs.OPTIONS}
    return {p.name: (p.opts, p.help, getattr(p.type, "choices", None), p.default,
                     p.show_default, getattr(p, "is_flag", False))
            for p in command.params if p.name in names}


def test_the_long_running_commands_take_the_same_log_options() -> None:
    worker = log_params(worker_cmd)
    assert list(worker) == [option.name for option in logs.OPTIONS]
    assert tuple(worker["log_level"][2]) == logs.LEVELS  # the choices, as --help shows them
    assert worker["verbose"][0] == ["-v"] and worker["quiet"][0] == ["-q"]
    for command in (api_cmd, dashboard_cmd, metrics_cmd, scheduler_cmd):
        assert log_params(command) == worker, command.name


def test_v_and_q_are_shorthands_and_contradict_each_other() -> None:
    base = {"log_level": "error", "verbose": False, "quiet": False, "log_format": "json"}
    assert LogSettings.from_values(base) == LogSettings("error", "json")
    assert LogSettings.from_values({**base, "verbose": True}).level == "debug"
    assert LogSettings.from_values({**base, "quiet": True}).level == "warning"
    with pytest.raises(click.UsageError, match="contradict"):
        LogSettings.from_values({**base, "verbose": True, "quiet": True})


def test_a_json_line_carries_the_fields_and_the_traceback() -> None:
    try:
        raise ValueError("bad\npage")
    except ValueError:
        record = logging.LogRecord("vlmq.worker", logging.ERROR, __file__, 1,
                                   "job %s item %d: %s", ("j1", 3, "two\nlines"),
                                   sys.exc_info())
    record.__dict__.update(logs.job_fields("j1", 3))
    line = JsonFormatter().format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert out["level"] == "error" and out["logger"] == "vlmq.worker"
    assert out["message"] == "job j1 item 3: two\nlines"
    assert (out["job_id"], out["item"]) == ("j1", 3)
    assert out["time"].endswith("+00:00") and "ValueError: bad" in out["exception"]


# --- the real worker ---------------------------------------------------------------------


def run_worker(redis_url: str, model: Path, tmp: Path, *args: str,
               jobs: int = 1) -> subprocess.CompletedProcess[str]:
    """`vlmq worker --burst` over `jobs` one-image caption jobs; stderr apart from stdout."""
    images = make_images(tmp / "images", jobs)
    with Client(redis_url) as client:
        for image in images:
            client.caption([image], queue=QUEUE)
    env = {**os.environ, "REDIS_URL": redis_url, "VLMQ_CACHE": str(tmp / "cache")}
    proc = subprocess.run([VLMQ, "worker", "--model", str(model), "--burst", "--queues", QUEUE,
                           "--cache-dir", str(tmp / "vision"), *args], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc


def no_noise(text: str) -> None:
    noisy = [line for line in text.splitlines() if any(word in line for word in NOISE)]
    assert not noisy, noisy


@pytest.mark.slow
def test_the_worker_logs_text_lines_with_their_level(redis_url: str, tiny_model: Path,
                                                     tmp_path: Path) -> None:
    proc = run_worker(redis_url, tiny_model, tmp_path)
    lines = proc.stderr.splitlines()
    assert lines and all(TEXT_LINE.match(line) for line in lines), proc.stderr
    assert any(" INFO vlmq.worker: job " in line and " started: " in line for line in lines)
    assert not any(" DEBUG " in line for line in lines)
    no_noise(proc.stdout + proc.stderr)


@pytest.mark.slow
def test_the_worker_logs_json_lines_with_job_and_item(redis_url: str, tiny_model: Path,
                                                      tmp_path: Path) -> None:
    proc = run_worker(redis_url, tiny_model, tmp_path, "--log-format", "json",
                      "--log-level", "debug")
    lines = [json.loads(line) for line in proc.stderr.splitlines()]  # each one parses
    assert lines and all(set(line) >= JSON_KEYS for line in lines), lines
    started = [line for line in lines if " started: " in line["message"]]
    assert len(started) == 1 and started[0]["level"] == "info"
    job_id = started[0]["job_id"]
    assert job_id in started[0]["message"] and started[0]["logger"] == "vlmq.worker"
    written = [line for line in lines if line["level"] == "debug" and "item" in line]
    assert [(line["job_id"], line["item"]) for line in written] == [(job_id, 0)], lines
    no_noise(proc.stdout + proc.stderr)


@pytest.mark.slow
def test_q_keeps_warnings_only_and_v_adds_debug(redis_url: str, tiny_model: Path,
                                                tmp_path: Path) -> None:
    quiet = run_worker(redis_url, tiny_model, tmp_path / "q", "-q")
    levels = {m["level"] for line in quiet.stderr.splitlines()
              if (m := TEXT_LINE.match(line))}
    assert levels <= {"WARNING", "ERROR", "CRITICAL"}, quiet.stderr
    loud = run_worker(redis_url, tiny_model, tmp_path / "v", "-v")
    assert re.search(r" DEBUG vlmq\.worker: job \S+ item 0 written: ", loud.stderr), loud.stderr
    no_noise(quiet.stderr + loud.stderr)


def test_v_with_q_is_a_usage_error(redis_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "REDIS_URL": redis_url}
    proc = subprocess.run([VLMQ, "worker", "--model", str(tmp_path), "-v", "-q"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "-v and -q contradict" in proc.stderr, proc.stderr


# --- the servers ---------------------------------------------------------------------------


@pytest.fixture
def server_env(redis_url: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    yield {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1",
           "VLMQ_API_KEYS": "sk-logs-test-key-0123456789", "VLMQ_DATA": str(tmp_path)}


@pytest.mark.parametrize(("args", "ready"), [
    (("metrics", "--port", "PORT"), "fleet metrics at"),
    (("scheduler", "--tick", "0.1"), "running"),
    (("dashboard", "--port", "PORT"), "vlmq dashboard on"),
    (("api", "--port", "PORT"), "vlmq api on"),
])
def test_each_server_logs_json_lines(server_env: dict[str, str], args: tuple[str, ...],
                                     ready: str, procs: list[subprocess.Popen[str]]) -> None:
    port = str(free_port())
    proc = subprocess.Popen([VLMQ, *(port if a == "PORT" else a for a in args),
                             "--log-format", "json"], env=server_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    procs.append(proc)
    out = Output(proc)
    line = json.loads(out.wait_for(ready, timeout=120))
    assert line["level"] == "info" and line["logger"].startswith("vlmq."), line
    proc.send_signal(signal.SIGTERM)  # SIGINT before a server's loop is click's "Aborted!"
    _, text = out.finish(timeout=60)
    lines = [json.loads(raw) for raw in text.splitlines()]  # every line, not only ours
    assert all(set(entry) >= JSON_KEYS for entry in lines), lines
    no_noise(text)


def test_the_command_line_outranks_the_environment_and_the_file() -> None:
    """-q typed beats verbose from a variable; --log-level typed beats quiet from the file;
    -v and -q typed together still contradict."""
    from click.testing import CliRunner

    from vlmq.cli.logs import log_options

    @click.command("probe")
    @log_options
    def probe(log_setup: LogSettings) -> None:
        click.echo(log_setup.level)

    def level(args: list[str], env: dict[str, str] | None = None,
              default_map: dict[str, Any] | None = None) -> str:
        res = CliRunner().invoke(probe, args, env=env, auto_envvar_prefix="VLMQ_PROBE",
                                 default_map=default_map)
        return res.output.strip() if res.exit_code == 0 else f"exit {res.exit_code}"

    assert level([], env={"VLMQ_PROBE_VERBOSE": "1"}) == "debug"
    assert level(["-q"], env={"VLMQ_PROBE_VERBOSE": "1"}) == "warning"
    assert level(["--log-level", "debug"], default_map={"quiet": True}) == "debug"
    assert level([], default_map={"quiet": True}) == "warning"
    assert level(["-v", "-q"]) == "exit 2"
