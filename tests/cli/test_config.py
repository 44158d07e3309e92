"""Every option's three ways in (cli/config.py): flag > environment > config file > default,
the file's checks, and root options given after the command's name."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.support import helpers
from vlmq.cli import config
from vlmq.cli.main import main


def _invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def _settings(out: str) -> dict[str, tuple[str, str]]:
    """--print-config's lines as name -> (value, source)."""
    rows: dict[str, tuple[str, str]] = {}
    for line in out.splitlines():
        if " = " in line and not line.startswith("#"):
            name, _, rest = line.partition(" = ")
            value, _, source = rest.partition("  # ")
            rows[name] = (value, source)
    return rows


@pytest.fixture
def toml(tmp_path: Path) -> Path:
    path = tmp_path / "vlmq.toml"
    path.write_text('redis_url = "redis://127.0.0.1:6379/14"\n'
                    "[worker]\n"
                    'model = "/from/file"\n'
                    "max-batch = 12\n"
                    'queues = ["ocr", "caption"]\n')
    return path


def test_each_way_in_sets_model_a_number_and_a_list(toml: Path) -> None:
    cases = [
        # (arguments, environment, expected model, max_batch, queues, source of each)
        ([], {}, '"/from/file"', "12", '["ocr", "caption"]', "file"),
        ([], {"VLMQ_WORKER_MODEL": "/from/env", "VLMQ_WORKER_MAX_BATCH": "20",
              "VLMQ_WORKER_QUEUES": "extract"},
         '"/from/env"', "20", '["extract"]', "env"),
        (["--model", "/from/flag", "--max-batch", "4", "--queues", "generate"],
         {"VLMQ_WORKER_MODEL": "/from/env", "VLMQ_WORKER_MAX_BATCH": "20",
          "VLMQ_WORKER_QUEUES": "extract"},
         '"/from/flag"', "4", '["generate"]', "flag"),
    ]
    for args, env, model, batch, queues, source in cases:
        res = _invoke("--config", str(toml), "worker", *args, "--print-config", env=env)
        assert res.exit_code == 0, res.output
        rows = _settings(res.stdout)
        assert rows["model"][0] == model
        assert rows["max_batch"][0] == batch
        assert rows["queues"][0] == queues
        for name in ("model", "max_batch", "queues"):
            assert rows[name][1].startswith(source), (name, rows[name])
        assert rows["burst"] == ("false", "default")
    env_rows = _settings(_invoke("--config", str(toml), "worker", "--print-config",
                                 env={"VLMQ_WORKER_MAX_BATCH": "20"}).stdout)
    assert env_rows["max_batch"] == ("20", "env VLMQ_WORKER_MAX_BATCH")
    assert env_rows["model"] == ('"/from/file"', f"file {toml}")


def test_file_is_found_by_env_and_in_the_default_place(toml: Path, tmp_path: Path) -> None:
    by_env = _invoke("worker", "--print-config", env={config.CONFIG_ENV: str(toml)})
    assert _settings(by_env.stdout)["max_batch"][0] == "12"
    home = tmp_path / "xdg"
    (home / "vlmq").mkdir(parents=True)
    (home / "vlmq" / config.CONFIG_NAME).write_text(toml.read_text())
    found = _invoke("worker", "--print-config", env={"XDG_CONFIG_HOME": str(home)})
    assert _settings(found.stdout)["model"][1] == f"file {home / 'vlmq' / config.CONFIG_NAME}"
    none = _invoke("worker", "--print-config",
                   env={"XDG_CONFIG_HOME": str(tmp_path / "empty")})
    assert none.exit_code == 2 and "--model" in none.output  # required, and nowhere given


def test_root_options_work_after_the_command(toml: Path) -> None:
    rows = _settings(_invoke("worker", "--print-config", "--config", str(toml),
                             "--redis-url", "redis://127.0.0.1:6379/13").stdout)
    assert rows["redis_url"] == ('"redis://127.0.0.1:6379/13"', "flag --redis-url")
    assert rows["model"][1] == f"file {toml}"
    unreachable = _invoke("jobs", "--redis-url=redis://127.0.0.1:1/0")
    assert unreachable.exit_code == 69, unreachable.output
    assert "127.0.0.1:1" in unreachable.stderr


def test_a_nested_command_reads_its_own_variable(tmp_path: Path) -> None:
    image = helpers.make_images(tmp_path, 1)[0]
    res = _invoke("enqueue", "ocr", str(image), env={"VLMQ_ENQUEUE_OCR_MAX_TOKENS": "many"})
    assert res.exit_code == 78  # a configuration error, not a usage one
    assert "environment variable VLMQ_ENQUEUE_OCR_MAX_TOKENS" in res.stderr
    assert "--max-tokens" in res.stderr and "many" in res.stderr


def test_variables_follow_the_long_flag(redis_url: str) -> None:
    """`--status` (whose parameter is named state) reads VLMQ_JOBS_STATUS; flags that
    share one value read none; values from the file that the flags would refuse are a
    configuration error naming the file and the key."""
    res = _invoke("--redis-url", redis_url, "jobs", env={"VLMQ_JOBS_STATUS": "bogus"})
    assert res.exit_code == 78 and "VLMQ_JOBS_STATUS" in res.stderr, res.output
    rows = _settings(_invoke("worker", "--print-config",
                             env={"VLMQ_WORKER_MODEL": "/m",
                                  "VLMQ_WORKER_STORE": "pics=file:///srv/pics"}).stdout)
    assert rows["stores"] == ('["pics=file:///srv/pics"]', "env VLMQ_WORKER_STORE")
    image = helpers.make_images(Path(tempfile.mkdtemp()), 1)[0]
    res = _invoke("--redis-url", redis_url, "enqueue", "ocr", str(image),
                  env={"VLMQ_ENQUEUE_OCR_RESULT_CACHE": "off"})
    assert res.exit_code == 0, res.output  # no flag of a shared value reads it


def test_a_file_that_cannot_be_used_exits_78_naming_the_problem(tmp_path: Path) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text("[worker]\nmax_bacth = 3\n")
    res = _invoke("--config", str(typo), "worker", "--print-config")
    assert res.exit_code == 78
    assert "'worker.max_bacth' is not an option of `vlmq worker`" in res.stderr
    assert res.stderr.startswith("vlmq: error:")
    broken = tmp_path / "broken.toml"
    broken.write_text("[worker\nmodel = 1\n")
    res = _invoke("--config", str(broken), "jobs")
    assert res.exit_code == 78 and "is not valid TOML" in res.stderr
    res = _invoke("--config", str(tmp_path / "absent.toml"), "jobs")
    assert res.exit_code == 78 and "does not exist" in res.stderr
    bad_table = tmp_path / "table.toml"
    bad_table.write_text("[nosuchcommand]\nx = 1\n")
    assert _invoke("--config", str(bad_table), "jobs").exit_code == 78


def test_a_flag_name_is_a_key_too(tmp_path: Path, redis_url: str) -> None:
    path = tmp_path / "jobs.toml"
    path.write_text("[jobs]\njson = true\nlimit = 1\n")
    plain = _invoke("--redis-url", redis_url, "jobs")
    res = _invoke("--config", str(path), "--redis-url", redis_url, "jobs")
    assert res.exit_code == plain.exit_code == 0, res.output
    assert not plain.stdout.lstrip().startswith(("[", "{"))
    json.loads(res.stdout)  # --json, from the file


def test_the_unit_reads_the_same_file(toml: Path) -> None:
    res = _invoke("service", "print", "systemd", "--config", str(toml), "--", "--burst",
                  env={"XDG_CONFIG_HOME": str(toml.parent / "cfg")})
    assert res.exit_code == 0, res.output
    exec_start = next(line for line in res.stdout.splitlines() if line.startswith("ExecStart="))
    words = exec_start.split()
    assert words[1:5] == ["--config", str(toml), "worker", "--burst"]
    assert "REDIS_URL=" not in res.stdout  # the file's URL: a variable would outrank it


def test_enqueue_options_from_the_file_are_not_typed_before_the_task(
        tmp_path: Path, redis_url: str) -> None:
    path = tmp_path / "enqueue.toml"
    path.write_text("[enqueue]\nskip-bad = true\n[enqueue.ocr]\nmax-tokens = 5\n")
    image = helpers.make_images(tmp_path, 1)[0]
    res = _invoke("--config", str(path), "--redis-url", redis_url, "enqueue", "ocr",
                  str(image))
    assert res.exit_code == 0, res.output
    typed = _invoke("--redis-url", redis_url, "enqueue", "--skip-bad", "ocr", str(image))
    assert typed.exit_code == 2 and "put them after the task" in typed.stderr


def test_hoist_moves_root_options_only() -> None:
    with main.make_context("vlmq", ["--help"], resilient_parsing=True) as ctx:
        def hoist(*args: str) -> list[str]:
            return config.hoist(list(args), main, ctx)

        assert hoist("worker", "--redis-url", "U", "--", "--config", "x") == [
            "--redis-url", "U", "worker", "--", "--config", "x"]
        assert hoist("jobs", "--config=f.toml") == ["--config=f.toml", "jobs"]
        # The value of another option stays that option's.
        assert hoist("enqueue", "generate", "--prompt", "--config", "a.png") == [
            "enqueue", "generate", "--prompt", "--config", "a.png"]


def test_a_worker_takes_its_model_from_the_environment(tiny_model: Path, redis_url: str,
                                                       tmp_path: Path) -> None:
    env = {"VLMQ_WORKER_MODEL": str(tiny_model), "VLMQ_WORKER_BURST": "1",
           "VLMQ_WORKER_QUEUES": "cfg-test", "VLMQ_WORKER_CACHE_DIR": str(tmp_path / "c"),
           "VLMQ_REDIS_URL": redis_url, "VLMQ_CACHE": str(tmp_path / "cache"),
           "XDG_CONFIG_HOME": str(tmp_path / "none"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "vlmq.cli.main", "worker"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert str(tiny_model) in proc.stdout + proc.stderr
