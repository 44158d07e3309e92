"""The CLI's habits, each through the real `vlmq` against real Redis: a
version, usage errors for bad choices, one exit code for an unreachable Redis at any
moment, JSON errors under --json, empty results explained, NO_COLOR, shell completion,
and the exit-code table in the docs being the code's."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
from click.testing import CliRunner
from redis import Redis

from tests.support.helpers import (
    VLMQ,
    PersistentRedis,
    following_events,
    make_images,
    pdf_bytes,
    wait_for,
)
from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_CODES, EXIT_FAILED, EXIT_UNREACHABLE
from vlmq.cli.main import main
from vlmq.producer import defaults
from vlmq.producer.client import Client
from vlmq.producer.job_sets import JOB_ITEMS
from vlmq.producer.options import JobOptions
from vlmq.producer.upload import DEFAULT_MAX_PENDING_MB
from vlmq.shared import constants as C
from vlmq.shared import job_index
from vlmq.worker.redis_server import free_port, server_binary

DOCS = Path(__file__).resolve().parents[2] / "docs"
JOB = "0" * 32  # a well-formed id no Redis holds


@pytest.fixture
def closed_url() -> str:
    """A Redis URL nothing listens at."""
    return f"redis://127.0.0.1:{free_port()}/0"


def cli(url: str, *args: str, **kw: object) -> object:
    return CliRunner().invoke(main, ["--redis-url", url, *args], catch_exceptions=False,
                              **kw)  # type: ignore[arg-type]


def one_job(url: str, folder: Path) -> str:
    """A queued one-image caption job (no worker runs)."""
    with Client(url) as client:
        return client.caption(make_images(folder, 1)).id


# --- version -----------------------------------------------------------------------------


def test_version_is_the_package_version_in_both_places(run_cli) -> None:
    res = CliRunner().invoke(main, ["--version"])
    assert res.exit_code == 0
    assert res.stdout.strip() == f"vlmq {version('vlmq')}"
    status = json.loads(run_cli("status", "--json", code=0).stdout)
    assert status["version"] == version("vlmq")


# --- bad choices ---------------------------------------------------------------------------


@pytest.mark.parametrize("args", [("jobs", "--status", "bogus"),
                                  ("result", JOB, "--format", "bogus"),
                                  ("export", JOB, "--dir", "out", "--format", "bogus"),
                                  ("jobs", "--limit", "0")])
def test_a_bad_choice_is_a_usage_error(run_cli, args: tuple[str, ...]) -> None:
    res = run_cli(*args, code=EXIT_BAD_INPUT)
    assert res.stdout == ""
    assert "bogus" in res.stderr or "0" in res.stderr


def test_jobs_status_takes_the_states_the_code_counts(run_cli) -> None:
    assert set(C.JOB_STATES) == set(job_index.TALLY_STATES) - {"other"}
    text = run_cli("jobs", "--help", code=0).stdout
    assert all(state in text for state in C.JOB_STATES)
    for state in C.JOB_STATES:
        run_cli("jobs", "--status", state, code=0)


def test_help_shows_the_defaults_the_code_uses(run_cli) -> None:
    text = " ".join(run_cli("enqueue", "caption", "--help", code=0).stdout.split())
    assert defaults.JOB_ITEMS == JOB_ITEMS
    assert defaults.DEFAULT_MAX_PENDING_MB == DEFAULT_MAX_PENDING_MB
    assert f"[default: {JOB_ITEMS};" in text
    assert f"[default: {DEFAULT_MAX_PENDING_MB};" in text
    assert f"[default: {C.DEFAULT_QUEUE['caption']}]" in text
    assert f"${C.ALLOW_EVICTION_ENV}=1" in text
    wait = " ".join(run_cli("wait", "--help", code=0).stdout.split())
    assert f"{EXIT_UNREACHABLE} if Redis is unreachable" in wait


# --- Redis unreachable: one exit code ------------------------------------------------------


@pytest.mark.parametrize("args", [("jobs",), ("status",), ("status", JOB), ("wait", JOB),
                                  ("wait", JOB, "--timeout", "5"), ("result", JOB),
                                  ("cancel", JOB), ("retry", JOB), ("delete", JOB),
                                  ("export", JOB, "--dir", "OUT"), ("reindex",),
                                  ("enqueue", "ocr", "DOC"), ("enqueue", "caption", "DOC")])
def test_an_unreachable_redis_exits_69_for_every_command(closed_url: str, tmp_path: Path,
                                                         args: tuple[str, ...]) -> None:
    (tmp_path / "doc.pdf").write_bytes(pdf_bytes(1))
    places = {"OUT": str(tmp_path / "out"), "DOC": str(tmp_path / "doc.pdf")}
    args = tuple(places.get(a, a) for a in args)
    res = cli(closed_url, *args)
    assert res.exit_code == EXIT_UNREACHABLE, (res.stdout, res.stderr)
    assert res.stderr.startswith("vlmq: error: cannot reach Redis at redis://127.0.0.1:")
    assert res.stderr.count("\n") == 1


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PersistentRedis]:
    binary = server_binary() or pytest.skip("needs redis-server for a private Redis")
    (tmp_path / "redis").mkdir()
    srv = PersistentRedis(binary, tmp_path / "redis")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_wait_exits_69_too_when_redis_goes_away_mid_wait(private_redis: PersistentRedis,
                                                         tmp_path: Path) -> None:
    job_id = one_job(private_redis.url, tmp_path / "in")
    proc = subprocess.Popen([VLMQ, "--redis-url", private_redis.url, "wait", job_id,
                             "--timeout", "6"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        with Redis.from_url(private_redis.url) as conn:
            wait_for(lambda: proc.poll() is None and following_events(conn), 300,
                     "`vlmq wait` to follow the job's events")
        private_redis.stop()
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == EXIT_UNREACHABLE, (out, err)
    assert "unreachable" in err


# --- --json errors ---------------------------------------------------------------------------


def error_of(stderr: str) -> dict[str, object]:
    body = json.loads(stderr.strip().splitlines()[-1])
    assert set(body) == {"error"}
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"code", "kind", "message"}
    return error


def test_errors_are_json_on_stderr_under_json(closed_url: str, run_cli) -> None:
    res = cli(closed_url, "jobs", "--json")
    assert res.exit_code == EXIT_UNREACHABLE and res.stdout == ""
    error = error_of(res.stderr)
    assert error["code"] == EXIT_UNREACHABLE and error["kind"] == "redis_unreachable"
    assert "cannot reach Redis" in str(error["message"])

    bad = run_cli("jobs", "--json", "--status", "bogus", code=EXIT_BAD_INPUT)
    assert error_of(bad.stderr)["kind"] == "usage"
    missing = run_cli("status", JOB, "--json", code=EXIT_FAILED)
    assert "not found" in str(error_of(missing.stderr)["message"])
    assert error_of(missing.stderr)["code"] == EXIT_FAILED
    # Without --json the same failure is one plain line.
    assert run_cli("status", JOB, code=EXIT_FAILED).stderr.startswith("vlmq: error: ")


@pytest.mark.parametrize("args", [("jobs",), ("status",), ("wait", "ID"), ("cancel", "ID"),
                                  ("retry", "ID"), ("delete", "ID"), ("reindex",),
                                  ("export", "ID", "--dir", "OUT")])
def test_every_command_that_prints_data_takes_json(run_cli, tmp_path: Path, redis_url: str,
                                                   args: tuple[str, ...]) -> None:
    job_id = one_job(redis_url, tmp_path / "in")
    args = tuple(job_id if a == "ID" else str(tmp_path / "o") if a == "OUT" else a
                 for a in args)
    if args[0] == "wait":
        args += ("--timeout", "0.1")
    res = run_cli(*args, "--json")
    if res.stdout.strip():
        json.loads(res.stdout)  # data on stdout is JSON whatever the exit code
    else:  # no data (wait timed out): the failure is JSON on stderr
        assert res.exit_code != 0
        error_of(res.stderr)


# --- empty results explained --------------------------------------------------------------


def test_export_of_a_queued_job_says_why_nothing_was_written(run_cli, redis_url: str,
                                                             tmp_path: Path) -> None:
    job_id = one_job(redis_url, tmp_path / "in")
    res = run_cli("export", job_id, "--dir", str(tmp_path / "out"), code=0)
    assert "wrote 0 file(s)" in res.stdout
    assert "no item has a result yet (1 job(s): 1 queued; run vlmq wait first" in res.stdout
    report = json.loads(run_cli("export", job_id, "--dir", str(tmp_path / "out"),
                                "--json", code=0).stdout)
    assert report["empty"].startswith("no item has a result yet")


def test_jobs_with_no_match_says_which_filter_matched_nothing(run_cli, redis_url: str,
                                                              tmp_path: Path) -> None:
    assert run_cli("jobs", code=0).stdout.startswith("no jobs: none in this Redis db")
    with Client(redis_url) as client:
        client.caption(make_images(tmp_path / "in", 1),
                       options=JobOptions.build(labels={"run": "a"}))
    assert run_cli("jobs", "--queue", "ocr", code=0).stdout.strip() == \
        "no jobs: none matches --queue ocr"
    assert run_cli("jobs", "--status", "finished", code=0).stdout.strip() == \
        "no jobs: none matches --status finished"
    assert run_cli("jobs", "--label", "run=b", code=0).stdout.strip() == \
        "no jobs: none matches --label run=b"
    with Client(redis_url) as client:
        client.ocr(make_images(tmp_path / "in2", 1))
    both = run_cli("jobs", "--queue", "ocr", "--label", "run=a", code=0).stdout.strip()
    assert both == ("no jobs: each of --queue ocr, --label run=a matches some jobs, but "
                    "none matches all")
    res = run_cli("jobs", "--queue", "extract", "--json", code=0)
    assert json.loads(res.stdout) == []
    assert "none matches --queue extract" in res.stderr


# --- colour, completion ----------------------------------------------------------------------


def test_no_color_turns_colour_off(closed_url: str) -> None:
    coloured = cli(closed_url, "jobs", color=True)
    assert "\x1b[" in coloured.stderr
    plain = cli(closed_url, "jobs", color=True, env={"NO_COLOR": "1"})
    assert plain.exit_code == EXIT_UNREACHABLE
    assert "\x1b[" not in plain.stderr and plain.stderr.startswith("vlmq: error: ")
    # An empty NO_COLOR is no request (no-color.org).
    assert "\x1b[" in cli(closed_url, "jobs", color=True, env={"NO_COLOR": ""}).stderr


def completion(env: dict[str, str]) -> str:
    return subprocess.run([VLMQ], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300, check=True).stdout


def test_shell_completion_scripts_and_words() -> None:
    for shell in ("bash", "zsh", "fish"):
        script = completion({"_VLMQ_COMPLETE": f"{shell}_source"})
        assert "_VLMQ_COMPLETE" in script, shell
    words = completion({"_VLMQ_COMPLETE": "bash_complete", "COMP_WORDS": "vlmq jo",
                        "COMP_CWORD": "1"})
    assert "plain,jobs" in words.splitlines()
    states = completion({"_VLMQ_COMPLETE": "bash_complete",
                         "COMP_WORDS": "vlmq jobs --status fa", "COMP_CWORD": "3"})
    assert "plain,failed" in states.splitlines()


# --- the documented table --------------------------------------------------------------------


def test_the_exit_code_table_in_the_docs_is_the_codes() -> None:
    text = (DOCS / "jobs.md").read_text()
    section = text[text.index("## Exit codes"):]
    rows = dict(re.findall(r"^\| (\d+) \| `(\w+)` \|", section, re.M))
    assert {int(code): kind for code, kind in rows.items()} == {
        code: kind for code, (kind, _) in EXIT_CODES.items()}
    for doc in ("jobs.md",):
        body = (DOCS / doc).read_text()
        assert "_VLMQ_COMPLETE=bash_source vlmq" in body and "NO_COLOR" in body
