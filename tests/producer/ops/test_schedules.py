"""Schedules: exactly once per due time, incremental runs, exports when a run's job ends."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.helpers import VLMQ, Output, finish, page_image, wait_for
from vlmq.producer.ops.schedules import Schedule, ScheduleError
from vlmq.shared.keys import Keys


def _vlmq(redis_url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VLMQ, "--redis-url", redis_url, *args], capture_output=True,
                          text=True, check=check)


def _runs(redis_url: str, name: str) -> list[dict[str, Any]]:
    listed = json.loads(_vlmq(redis_url, "schedule", "list", "--json").stdout)
    return next(s["runs"] for s in listed if s["name"] == name)


def _images(folder: Path, first: int, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(first, first + n):
        page_image(i, (96, 96)).save(folder / f"img{i}.png")


def test_two_schedulers_fire_each_due_time_once_and_runs_are_incremental(
        redis_url: str, redis: Redis, tmp_path: Path,
        procs: list[subprocess.Popen[str]]) -> None:
    photos = tmp_path / "photos"
    _images(photos, 0, 3)
    _vlmq(redis_url, "schedule", "add", "pics", "caption", str(photos), "--every", "2",
          "--max-tokens", "4")
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    procs.extend(subprocess.Popen([VLMQ, "scheduler", "--tick", "0.1"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True) for _ in range(2))
    watched = [Output(proc) for proc in procs]
    for out in watched:  # both in their loop, competing for each due time
        out.wait_for("running")
    wait_for(lambda: sum(not r["manual"] for r in _runs(redis_url, "pics")) >= 3, 300,
             "three due times fired")
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    outs = [out.finish() for out in watched]
    assert all(rc == 0 for rc, _ in outs), outs

    runs = [r for r in _runs(redis_url, "pics") if not r["manual"]]
    dues = [r["due_ms"] for r in runs]
    assert len(runs) >= 2 and len(set(dues)) == len(dues), runs  # each due time once
    assert all((b - a) % 2000 in (0, 1, 1999) for a, b in itertools.pairwise(dues))
    assert runs[0]["items"] == 3 and runs[0]["job_id"] is not None, runs
    assert all(r["job_id"] is None and r["items"] == 0 for r in runs[1:]), runs
    assert redis.llen("rq:queue:caption") == 1  # no job for "nothing new"
    # Both processes were running the loop; a due time went to whichever claimed it.
    assert all("scheduler" in out and "running" in out for _, out in outs), outs

    _images(photos, 3, 2)  # two new photos
    page_image(7, (96, 96)).save(photos / "img0.png")  # one edited in place
    run = json.loads(_vlmq(redis_url, "schedule", "run", "pics", "--json").stdout)
    assert run["items"] == 3 and run["job_id"] is not None, run
    again = json.loads(_vlmq(redis_url, "schedule", "run", "pics", "--json").stdout)
    assert again == {"job_id": None, "items": 0, "skipped": 5, "missing": [], "bad": [],
                     "not_media": {}}
    # Unchanged files (size and mtime) are not read again: only the 3 new/edited were.
    reads = [r["read"] for r in _runs(redis_url, "pics") if r["manual"]]
    assert reads == [3, 0], reads
    assert redis.llen("rq:queue:caption") == 2


def test_prompt_change_vanished_path_pause_and_remove(redis_url: str, redis: Redis,
                                                       tmp_path: Path) -> None:
    keep, gone = tmp_path / "keep", tmp_path / "gone"
    _images(keep, 0, 2)
    _images(gone, 2, 1)
    _vlmq(redis_url, "schedule", "add", "s", "caption", str(keep), str(gone),
          "--cron", "0 3 * * *", "--prompt", "Describe.")
    shutil.rmtree(gone)
    first = json.loads(_vlmq(redis_url, "schedule", "run", "s", "--json").stdout)
    assert first["items"] == 2 and first["missing"] == [str(gone)]
    # Only the run's own job was enqueued; its items are in flight, so nothing is new.
    assert json.loads(_vlmq(redis_url, "schedule", "run", "s", "--json").stdout)["items"] == 0
    redis.delete(*redis.keys("rq:job:*"))  # the job vanished (deleted): its items are due
    assert json.loads(_vlmq(redis_url, "schedule", "run", "s", "--json").stdout)["items"] == 2
    res = _vlmq(redis_url, "schedule", "add", "s", "caption", str(keep), "--cron",
                "0 3 * * *", check=False)
    assert res.returncode == 2 and "--replace" in res.stderr
    _vlmq(redis_url, "schedule", "add", "s", "caption", str(keep), "--cron", "0 3 * * *",
          "--prompt", "Name the colours.", "--replace")
    changed = json.loads(_vlmq(redis_url, "schedule", "run", "s", "--json").stdout)
    assert changed["items"] == 2  # new settings: all due again
    _vlmq(redis_url, "schedule", "pause", "s")
    listed = json.loads(_vlmq(redis_url, "schedule", "list", "--json").stdout)
    assert listed[0]["paused"] and listed[0]["next_due"].endswith("T03:00:00.000Z")
    assert listed[0]["runs"][0]["missing"] == [str(gone)]
    _vlmq(redis_url, "schedule", "remove", "s")
    assert _vlmq(redis_url, "schedule", "list").stdout.strip() == "no schedules"
    assert not redis.keys(f"{Keys().prefix}:schedule:*")


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ScheduleError, match="cron"):
        Schedule(name="x", task="caption", paths=("/p",), cron="61 * * * *")
    with pytest.raises(ScheduleError, match="exactly one"):
        Schedule(name="x", task="caption", paths=("/p",), cron="0 3 * * *", every=5)
    with pytest.raises(ScheduleError, match="name"):
        Schedule(name="a b", task="caption", paths=("/p",), every=5)
    s = Schedule(name="x", task="caption", paths=("/p",), every=10, created_at=1000.0)
    assert (s.next_after(1000.0), s.next_after(1015.0), s.latest_due(1035.0)) == \
        (1010.0, 1020.0, 1030.0)
    c = Schedule(name="x", task="ocr", paths=("/p",), cron="0 3 * * *")
    day = 24 * 3600
    assert c.next_after(5 * day) == 5 * day + 3 * 3600
    assert c.latest_due(5 * day + 3 * 3600) == 5 * day + 3 * 3600  # on the slot itself
    assert c.latest_due(5 * day + 2 * 3600) == 4 * day + 3 * 3600


@pytest.mark.slow
def test_sidecars_written_when_runs_finish_and_failed_items_stay_due(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        procs: list[subprocess.Popen[str]]) -> None:
    photos = tmp_path / "photos"
    _images(photos / "day1", 0, 2)
    _images(photos / "day2", 2, 1)
    _vlmq(redis_url, "schedule", "add", "night", "caption", str(photos), "-r", "--every",
          "3600", "--max-tokens", "4", "--max-side", "112", "--sidecar")
    run = json.loads(_vlmq(redis_url, "schedule", "run", "night", "--json").stdout)
    assert run["items"] == 3
    # One input is lost before the worker gets to it: that item fails.
    lost = Keys().blob(hashlib.sha256(
        (photos / "day2" / "img2.png").read_bytes()).hexdigest())
    assert redis.delete(lost) == 1
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst"))
    rc, out = finish(procs[-1])
    assert rc == 0, out

    # The next run first finishes the last one: sidecars for the two that succeeded...
    again = json.loads(_vlmq(redis_url, "schedule", "run", "night", "--json").stdout)
    assert (photos / "day1" / "img0.png.txt").is_file()
    assert (photos / "day1" / "img1.png.txt").is_file()
    assert not (photos / "day2" / "img2.png.txt").exists()
    # ...and the failed one is due again (its blob is uploaded again by this run).
    assert again["items"] == 1 and again["skipped"] == 2, again
    first = next(r for r in _runs(redis_url, "night") if r["job_id"] == run["job_id"])
    assert (first["ok"], first["failed"], first["exported"]) == (2, 1, 2)

    # A worker with the scheduler inside finishes the loop: the last sidecar appears.
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--with-scheduler",
                                      name="w2"))
    wait_for(lambda: (photos / "day2" / "img2.png.txt").is_file(), 120,
             "the scheduler inside the worker to write the last sidecar")
    procs[-1].send_signal(signal.SIGTERM)
    rc, out = finish(procs[-1])
    assert rc == 0, out
    # Our own sidecars are never taken for inputs; nothing is left to do.
    last = json.loads(_vlmq(redis_url, "schedule", "run", "night", "--json").stdout)
    assert last == {"job_id": None, "items": 0, "skipped": 3, "missing": [], "bad": [],
                    "not_media": {}}
