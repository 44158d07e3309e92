"""Exit codes, states and prefixes that tell the truth: a missing worker extra is a
configuration error (78, which the service units do not restart), every failure reads
`vlmq: error:`, a batch nobody has started is queued, and a worker that is still loading
its model counts as serving its queues."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from redis import Redis

from tests.support.helpers import VLMQ, make_images, wait_for, worker_lifecycle
from vlmq.cli.common import EXIT_BAD_INPUT, EXIT_CONFIG
from vlmq.cli.units import NO_RESTART
from vlmq.producer import Client
from vlmq.shared.keys import Keys
from vlmq.worker.jobs.starting import Starting

NO_EXTRA = Path(__file__).resolve().parents[1] / "support" / "no_worker_extra"
KEYS = Keys()


def producer_only(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`vlmq ARGS` as a producer-only install runs it: mlx and mlx_vlm are not there."""
    env = {**os.environ, "REDIS_URL": redis_url,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(NO_EXTRA),
                                                       os.environ.get("PYTHONPATH")]))}
    return subprocess.run([VLMQ, *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


# --- a missing worker extra -----------------------------------------------------------------


@pytest.mark.parametrize("args", [("worker", "--model", "some/model"),
                                  ("model", "make-tiny", "OUT"), ("demo",)])
def test_a_producer_only_install_exits_78_for_worker_commands(redis_url: str, tmp_path: Path,
                                                              args: tuple[str, ...]) -> None:
    res = producer_only(redis_url, *(str(tmp_path / "out") if a == "OUT" else a for a in args))
    assert res.returncode == EXIT_CONFIG, (res.stdout, res.stderr)
    assert EXIT_CONFIG in NO_RESTART  # the systemd unit's RestartPreventExitStatus=
    assert res.stderr.startswith("vlmq: error: this command needs the worker extra "
                                 "(mlx, mlx_vlm not installed)"), res.stderr
    assert res.stderr.count("\n") == 1 and res.stdout == ""
    # The producer's commands still run there.
    assert producer_only(redis_url, "jobs").returncode == 0


def test_a_missing_worker_extra_is_a_config_error_in_json_too(redis_url: str) -> None:
    res = producer_only(redis_url, "model", "check", "some/model", "--json")
    assert res.returncode == EXIT_CONFIG
    error = json.loads(res.stderr)["error"]
    assert error["code"] == EXIT_CONFIG and error["kind"] == "config"
    assert error["message"].startswith("this command needs the worker extra")


# --- one prefix ---------------------------------------------------------------------------


def test_click_usage_errors_say_vlmq_error_with_their_usage(run_cli) -> None:
    res = run_cli("jobs", "--status", "bogus", code=EXIT_BAD_INPUT)
    lines = res.stderr.splitlines()
    assert lines[0] == "Usage: main jobs [OPTIONS]" and "Try 'main jobs --help'" in lines[1]
    assert lines[-1].startswith("vlmq: error: Invalid value for '--status': 'bogus'")
    assert not any(line.startswith("Error:") for line in lines)
    # A command's own usage error and an unknown command read the same.
    own = run_cli("status", "0" * 32, "--label", "a=b", code=EXIT_BAD_INPUT)
    assert own.stderr.splitlines()[-1] == "vlmq: error: give a JOB_ID or --label, not both"
    unknown = run_cli("bogus", code=EXIT_BAD_INPUT)
    assert unknown.stderr.splitlines()[-1].startswith("vlmq: error: No such command 'bogus'")


def test_a_worker_store_that_cannot_be_parsed_is_a_config_error(run_cli) -> None:
    res = run_cli("worker", "--model", "x", "--store", "nonsense", code=EXIT_CONFIG)
    assert res.stderr.startswith("vlmq: error: invalid value for --store: store 'nonsense'")
    # Elsewhere a bad --store is bad input, as any option's bad value.
    other = run_cli("enqueue", "caption", "x.png", "--store", "nonsense", code=EXIT_BAD_INPUT)
    assert other.stderr.splitlines()[-1].startswith("vlmq: error: Invalid value for --store")


def test_a_missing_model_folder_exits_78(redis_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "REDIS_URL": redis_url}
    res = subprocess.run([VLMQ, "worker", "--model", str(tmp_path / "nothing"), "--burst",
                          "--queues", "nobody"], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == EXIT_CONFIG, res.stderr
    assert "does not exist" in res.stderr
    # It never served, so it is not left counted as starting either.
    assert not Redis.from_url(redis_url).exists(KEYS.queue_starting("nobody"))


def test_options_before_a_task_that_it_would_ignore_are_refused(run_cli, tmp_path: Path) -> None:
    img = make_images(tmp_path, 2)
    res = run_cli("enqueue", "--job-size", "1", "caption", *map(str, img),
                  code=EXIT_BAD_INPUT)
    assert "put them after the task" in res.stderr and res.stdout == ""


# --- states -------------------------------------------------------------------------------


def test_a_batch_says_queued_until_a_worker_starts_one_of_its_jobs(
        run_cli, redis: Redis, tmp_path: Path) -> None:
    img = make_images(tmp_path, 3)
    batch = run_cli("enqueue", "caption", *map(str, img), "--job-size", "1", "--queue", "q",
                    code=0).stdout.strip()
    assert batch.startswith("b-")
    assert "status: queued" in run_cli("status", batch, code=0).stdout.splitlines()
    status = json.loads(run_cli("status", batch, "--json", code=0).stdout)
    assert status["status"] == "queued" and status["by_status"] == {"queued": 3}
    job_ids = [row["id"] for row in json.loads(run_cli("jobs", "--json", code=0).stdout)]
    assert len(job_ids) == 3
    for job_id in job_ids:
        assert json.loads(run_cli("status", job_id, "--json", code=0).stdout)["status"] \
            == "queued"

    with worker_lifecycle(redis, ["q"]) as life:
        running = life.take()
        assert running is not None and not isinstance(running, str)
        status = json.loads(run_cli("status", batch, "--json", code=0).stdout)
        assert status["status"] == "running" and status["by_status"]["started"] == 1
        assert json.loads(run_cli("status", running.job_id, "--json",
                                  code=0).stdout)["status"] == "started"
        # A job ended while the others wait: the batch is under way, not queued again.
        assert life.succeed(running, {"items": 1, "ok": 1, "failed": 0}) is None
        status = json.loads(run_cli("status", batch, "--json", code=0).stdout)
        assert status["status"] == "running" and status["by_status"]["queued"] == 2


# --- a starting worker serves its queues --------------------------------------------------


def test_a_starting_presence_lasts_until_rq_registration_or_the_end(redis_url: str,
                                                                    redis: Redis) -> None:
    client = Client(redis_url)
    assert client.serving("a") == 0
    with Starting(redis_url, KEYS, "w-start", ["a", "b", "a"], ttl_s=0.6):
        wait_for(lambda: client.serving("a") == 1 and client.serving("b") == 1, 10,
                 "the starting worker to name itself")
        # It expires unless refreshed, so a worker killed while starting is soon forgotten.
        assert 0 < redis.pttl(KEYS.queue_starting("a")) <= 600
        wait_for(lambda: redis.pttl(KEYS.queue_starting("a")) > 450, 10, "a refresh")
        # Registered with RQ: it leaves, and RQ's set counts it instead.
        redis.sadd(Keys.rq_queue_workers("a"), Keys.rq_worker("w-start"))
        wait_for(lambda: not redis.exists(KEYS.queue_starting("a")), 10, "it to leave")
        assert client.serving("a") == 1 and client.serving("b") == 0
        redis.srem(Keys.rq_queue_workers("a"), Keys.rq_worker("w-start"))
    with Starting(redis_url, KEYS, "w-end", ["c"]):
        wait_for(lambda: client.serving("c") == 1, 10, "the starting worker")
    assert client.serving("c") == 0  # the block ended (the worker exited): gone at once
    client.close()


def test_enqueue_right_after_starting_a_worker_does_not_warn(
        run_cli, redis_url: str, redis: Redis, tmp_path: Path, tiny_model: Path,
        start_worker) -> None:
    img = make_images(tmp_path / "in", 1)[0]
    assert "no live worker serves queue 'fresh'" in run_cli(
        "enqueue", "caption", str(img), "--queue", "fresh", code=0).stderr
    proc = start_worker(redis_url, tiny_model, tmp_path, "--queues", "fresh", name="fresh-1")
    # Named as starting long before its model is loaded and RQ knows it.
    wait_for(lambda: redis.sismember(KEYS.queue_starting("fresh"), "fresh-1"), 30,
             "the worker to say it is starting")
    res = run_cli("enqueue", "caption", str(img), "--queue", "fresh", code=0)
    assert "warning" not in res.stderr, res.stderr
    wait_for(lambda: redis.scard(Keys.rq_queue_workers("fresh")) == 1, 120,
             "the worker to register with RQ")
    wait_for(lambda: not redis.exists(KEYS.queue_starting("fresh")), 30,
             "the starting name to go once registered")
    assert "warning" not in run_cli("enqueue", "caption", str(img), "--queue", "fresh",
                                    code=0).stderr
    os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert "no live worker serves queue 'fresh'" in run_cli(
        "enqueue", "caption", str(img), "--queue", "fresh", code=0).stderr
