"""End to end: real Redis, a real `vlmq worker` subprocess, the real tiny model."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis import Redis

from tests.support.helpers import (
    VLMQ,
    Spawn,
    Tripwire,
    abandoned,
    finish,
    make_images,
    make_pdf,
    wait_for,
)
from vlmq.producer.client import Client
from vlmq.shared import constants as C
from vlmq.shared.blobs import BlobStore
from vlmq.shared.enqueue import enqueue, fetch_job
from vlmq.shared.keys import Keys
from vlmq.shared.messages import Item, JobPayload

pytestmark = pytest.mark.slow


def stats(redis: Redis, name: str) -> dict[str, str]:
    raw = redis.hgetall(Keys().worker_stats(name))
    return {k.decode(): v.decode() for k, v in raw.items()}


def test_pdf_and_caption_jobs_end_to_end(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    client = Client(redis_url)
    pdf = make_pdf(tmp_path / "doc.pdf", 3)
    images = make_images(tmp_path / "imgs", 5)
    ocr = client.ocr([pdf], max_side=112, max_tokens=8)
    cap = client.caption(images, max_side=112, max_tokens=8)

    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", "--max-batch", "4"))
    assert rc == 0, out
    assert "job " + ocr.id + " started" in out and "job " + cap.id + " finished" in out

    for job, n in ((ocr, 3), (cap, 5)):
        assert job.status() == "finished"
        results = list(job.results())
        assert [r.index for r in results] == list(range(n))
        assert all(r.error is None and r.text for r in results), results
        assert job.summary() == {**job.summary(), "items": n, "ok": n, "failed": 0}
    assert [r.page for r in ocr.results()] == [1, 2, 3]
    # Different inputs give different outputs: rows were not mixed up or duplicated.
    assert len({r.text for r in cap.results()}) == 5

    info = subprocess.run([str(Path(VLMQ).parent / "rq"), "info", "--url", redis_url],
                          capture_output=True, text=True, check=True).stdout
    assert re.search(r"^ocr\s+\|.*\b1 finished", info, re.M), info
    assert re.search(r"^caption\s+\|.*\b1 finished", info, re.M), info


def test_restarted_worker_serves_every_item_from_the_disk_cache(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    client = Client(redis_url)
    pdf = make_pdf(tmp_path / "doc.pdf", 3)
    images = make_images(tmp_path / "imgs", 2)
    inputs = [pdf, *images]

    first = client.ocr(inputs, max_side=112, max_tokens=8)
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", name="cold"))
    assert rc == 0, out
    cold = stats(redis, "cold")
    assert int(cold["tower_calls"]) == 5 and int(cold["pdf_renders"]) == 3
    assert int(cold["cache_misses"]) == 5

    # result_cache off: this is about the vision cache, which the result cache would bypass.
    second = client.ocr(inputs, max_side=112, max_tokens=8, result_cache="off")
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", name="warm"))
    assert rc == 0, out
    warm = stats(redis, "warm")
    assert int(warm["tower_calls"]) == 0
    assert int(warm["pdf_renders"]) == 0 and int(warm["image_decodes"]) == 0
    assert int(warm["cache_hits"]) == 5 and int(warm["cache_misses"]) == 0

    # A partial hit: only the new image goes through decode and the tower.
    extra = make_images(tmp_path / "more", 3)[2]
    third = client.ocr([*inputs, extra], max_side=112, max_tokens=8, result_cache="off")
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", name="partial"))
    assert rc == 0, out
    partial = stats(redis, "partial")
    assert (partial["tower_calls"], partial["image_decodes"], partial["pdf_renders"]) == \
        ("1", "1", "0")
    assert [r.vision_cache_hit for r in third.results()] == [True] * 5 + [False]

    a, b = list(first.results()), list(second.results())
    assert not any(r.vision_cache_hit for r in a)
    assert all(r.vision_cache_hit for r in b)
    assert second.summary()["cache_hits"] == 5
    # Cached features give exactly the uncached output.
    assert [r.text for r in a] == [r.text for r in b]


def test_the_same_image_twice_in_flight_runs_the_tower_once(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    (img,) = make_images(tmp_path / "a", 1)
    twin = tmp_path / "b" / "copy.png"
    twin.parent.mkdir()
    twin.write_bytes(img.read_bytes())
    job = Client(redis_url).caption([img, twin], max_side=112, max_tokens=8)
    assert job.blobs == 1
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst",
                                  "--prep-threads", "2", name="dedup"))
    assert rc == 0, out
    s = stats(redis, "dedup")
    assert (s["tower_calls"], s["image_decodes"]) == ("1", "1")
    a, b = job.results()
    assert sorted([a.vision_cache_hit, b.vision_cache_hit]) == [False, True]
    assert a.text == b.text


def test_sigterm_requeues_and_a_new_worker_finishes_each_item_once(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    client = Client(redis_url)
    pages = 24
    job = client.ocr([make_pdf(tmp_path / "long.pdf", pages)], max_side=112, max_tokens=24)
    proc = start_worker(redis_url, tiny_model, tmp_path, "--max-batch", "2", "--grace", "20",
                        name="first")
    wait_for(lambda: job.progress()[0] >= 2, 300, "two items done")
    first_items_at = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    rc, out = finish(proc, timeout=300)
    assert rc == 0, out
    done_at_stop = job.progress()[0]
    assert 2 <= done_at_stop < pages, out
    assert job.status() == "queued"

    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", name="second"))
    assert rc == 0, out
    assert f"({done_at_stop} already done, resuming)" in out
    assert job.status() == "finished"
    results = list(job.results())
    assert [r.index for r in results] == list(range(pages))
    assert all(r.text for r in results)
    events = redis.xrange(Keys().job_events(job.id))
    item_events = [int(f[b"index"]) for _, f in events if f[b"type"] == b"item"]
    assert sorted(item_events) == list(range(pages)), "an item was computed twice or lost"
    # The summary covers the whole job: both workers' time (the gap between them, a model
    # load included, too) and every item's cache hit, not only the last worker's share.
    summary = job.summary()
    assert summary is not None
    ended = fetch_job(redis, job.id).ended_at
    assert ended is not None
    assert summary["wall_s"] >= ended.timestamp() - first_items_at - 0.5, summary
    assert summary["cache_hits"] == sum(r.vision_cache_hit for r in results)


def test_a_killed_worker_s_job_is_reclaimed_and_resumed_at_item_level(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    client = Client(redis_url)
    pages = 20
    job = client.ocr([make_pdf(tmp_path / "long.pdf", pages)], max_side=112, max_tokens=24)
    proc = start_worker(redis_url, tiny_model, tmp_path, "--max-batch", "2",
                        "--heartbeat-ttl", "2", name="doomed")
    wait_for(lambda: job.progress()[0] >= 2, 300, "two items done")
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to requeue anything
    proc.communicate()
    done_at_kill = job.progress()[0]
    assert job.status() == "started" and done_at_kill < pages

    wait_for(lambda: abandoned(redis, "ocr", job.id), 120,
             "the dead worker's execution to expire (its heartbeat TTL)")
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", name="heir"))
    assert rc == 0, out
    assert f"({done_at_kill} already done, resuming)" in out
    assert job.status() == "finished" and job.summary()["ok"] == pages
    # One retry is spent either way: charged, if the kill landed while one of its items was
    # in risky work (its kill count says so), or by RQ's own accounting when no job was
    # (nobody else was charged for the death, so no retry is given back).
    kills = int(redis.hget(Keys().job_kills(job.id), "count") or 0)
    assert kills in (0, 1)
    assert fetch_job(redis, job.id).retries_left == C.CRASH_RETRIES - 1
    events = redis.xrange(Keys().job_events(job.id))
    items = sorted(int(f[b"index"]) for _, f in events if f[b"type"] == b"item")
    assert items == list(range(pages)), "an item was lost or computed twice"


def test_an_undecodable_item_fails_alone(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    blobs = BlobStore(redis, Keys())
    good = [blobs.put(p.read_bytes())[0] for p in make_images(tmp_path / "imgs", 2)]
    bad, _ = blobs.put(b"this is not an image at all")
    payload = JobPayload(task="caption", settings={"max_tokens": 8, "max_side": 112},
                         items=(Item("image", good[0], "a.png"), Item("image", bad, "b.png"),
                                Item("image", good[1], "c.png")))
    job_id = enqueue(redis, payload, queue="caption")

    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst"))
    assert rc == 0, out
    job = Client(redis_url).job(job_id)
    assert job.status() == "finished"
    r0, r1, r2 = job.results()
    assert r0.text and r2.text and r0.error is None and r2.error is None
    assert r1.text is None and r1.error and "not an image" in r1.error
    assert job.summary()["failed"] == 1 and job.summary()["ok"] == 2


def test_job_for_another_model_fails_naming_both(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    blob, _ = BlobStore(redis, Keys()).put(make_images(tmp_path / "i", 1)[0].read_bytes())
    payload = JobPayload(task="caption", settings={"model": "mlx-community/Some-Other-VLM-4bit"},
                         items=(Item("image", blob, "a.png"),))
    job_id = enqueue(redis, payload, queue="caption")
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst"))
    assert rc == 0, out
    job = fetch_job(redis, job_id)
    assert job.get_status() == "failed"
    result = job.latest_result()
    assert result is not None and result.exc_string is not None
    assert "mlx-community/Some-Other-VLM-4bit" in result.exc_string
    assert str(tiny_model) in result.exc_string


def test_backpressure_keeps_a_window_and_a_small_job_overtakes_a_big_one(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    client = Client(redis_url)
    big = client.ocr([make_pdf(tmp_path / "big.pdf", 200)], max_side=56, max_tokens=4)
    proc = start_worker(redis_url, tiny_model, tmp_path, "--burst", "--max-batch", "4",
                        name="bp")
    peak_seen = 0
    # The window (2 x max batch), and a small job's allowance past it (max batch).
    bound = 8 + 4

    def progressed() -> bool:
        nonlocal peak_seen
        s = stats(redis, "bp")
        if s:
            peak_seen = max(peak_seen, int(s["waiting"]))
            assert int(s["window"]) == 8 and int(s["waiting"]) <= bound
        return big.progress()[0] >= 10

    wait_for(progressed, 300, "the big job to get going")
    rss_early = _rss_mb(proc.pid)
    small = client.caption(make_images(tmp_path / "imgs", 3), max_side=56, max_tokens=4)
    wait_for(lambda: big.progress()[0] >= 180, 120, "the big job to near its end")
    rss_late = _rss_mb(proc.pid)
    rc, out = finish(proc, timeout=300)
    assert rc == 0, out
    # Memory stays flat over 170 more pages (the bounded vision cache grows a little).
    assert rss_late - rss_early < 48, (rss_early, rss_late)
    assert big.status() == "finished" and big.summary()["ok"] == 200
    assert small.status() == "finished" and small.summary()["ok"] == 3

    # Stream ids are the Redis server's clock: order the two jobs' events on it.
    def events(job_id: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        return redis.xrange(Keys().job_events(job_id))

    small_done = next(i for i, f in events(small.id) if f[b"type"] == b"finished")
    big_items = [i for i, f in events(big.id) if f[b"type"] == b"item"]
    big_before = sum(1 for i in big_items if _sid(i) < _sid(small_done))
    assert 10 <= big_before < 190, f"small job finished after {big_before}/200 big items"
    # Items of both jobs were in flight together: they shared batches.
    small_first = min(_sid(i) for i, f in events(small.id) if f[b"type"] == b"item")
    assert any(_sid(i) > small_first for i in big_items[:big_before + 1])

    final = stats(redis, "bp")
    assert 0 < int(final["peak_waiting"]) <= bound
    # The engine's own count of submitted-but-not-batched requests agrees.
    assert 0 < int(final["engine_peak_waiting"]) <= bound
    assert peak_seen <= bound


def _rss_mb(pid: int) -> float:
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc to read a process's memory")
    status = Path(f"/proc/{pid}/status")
    line = next(x for x in status.read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _sid(stream_id: bytes) -> tuple[int, int]:
    ms, seq = stream_id.split(b"-")
    return int(ms), int(seq)


def test_a_model_that_cannot_be_found_stops_the_worker_with_a_clear_error(
        redis_url: str, tmp_path: Path, start_worker: Spawn) -> None:
    missing = tmp_path / "no-such-model"
    rc, out = finish(start_worker(redis_url, missing, tmp_path, "--burst"))
    assert rc == 78  # EX_CONFIG: a service does not restart it
    assert f"model folder {missing} does not exist" in out
    assert "Traceback" not in out


def test_a_poison_job_fails_alone_and_the_worker_goes_on(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    blob, _ = BlobStore(redis, Keys()).put(make_images(tmp_path / "i", 1)[0].read_bytes())
    # "~nosuchuser/..." makes path expansion raise inside the worker's model check.
    poison = enqueue(redis, JobPayload(task="caption", settings={"model": "~nosuchuser/model"},
                                       items=(Item("image", blob, "a.png"),)), queue="caption")
    good = Client(redis_url).caption(make_images(tmp_path / "j", 2), max_side=112,
                                     max_tokens=4)
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst"))
    assert rc == 0, out
    assert fetch_job(redis, poison).get_status() == "failed"
    assert good.status() == "finished" and good.summary()["ok"] == 2


def test_a_job_canceled_mid_run_stays_canceled(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    client = Client(redis_url)
    pages = 30
    job = client.ocr([make_pdf(tmp_path / "long.pdf", pages)], max_side=112, max_tokens=24)
    proc = start_worker(redis_url, tiny_model, tmp_path, "--burst", "--max-batch", "2",
                        "--heartbeat-ttl", "3")
    wait_for(lambda: job.progress()[0] >= 2, 300, "two items done")
    fetch_job(redis, job.id).cancel()
    rc, out = finish(proc, timeout=120)
    assert rc == 0, out
    assert job.status() == "canceled"
    assert job.progress()[0] < pages, "the worker went on computing a canceled job"
    assert f"job {job.id} dropped (canceled)" in out
    # RQ's own cancel writes no vlmq event: the worker that drops the job writes it, once.
    types = [f[b"type"] for _, f in redis.xrange(Keys().job_events(job.id))]
    assert types.count(b"canceled") == 1 and types[-1] == b"canceled"


def test_worker_start_problems_are_reported_before_loading_the_model(
        redis_url: str, tiny_model: Path, tmp_path: Path, start_worker: Spawn) -> None:
    rc, out = finish(start_worker("redis://127.0.0.1:1/0", tiny_model, tmp_path, "--burst"))
    assert rc == 69 and "cannot reach Redis at redis://127.0.0.1:1/0" in out  # restarted
    assert "loading model" not in out and "Traceback" not in out

    first = start_worker(redis_url, tiny_model, tmp_path, name="twin")
    wait_for(lambda: b"rq:worker:twin" in Redis.from_url(redis_url).keys("rq:worker:*"), 60,
             "the first worker to register")
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", name="twin"))
    assert rc == 1 and "a worker named 'twin' is already registered" in out, out
    os.killpg(first.pid, signal.SIGTERM)
    assert finish(first)[0] == 0


def test_a_job_id_pushed_twice_runs_once(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    job = Client(redis_url).caption(make_images(tmp_path / "i", 3), max_side=112,
                                    max_tokens=4, labels={"batch": "nov"})
    redis.rpush("rq:queue:caption", job.id)  # a producer's naive retry
    first = start_worker(redis_url, tiny_model, tmp_path, "--burst", name="a")
    second = start_worker(redis_url, tiny_model, tmp_path, "--burst", name="b")
    for proc in (first, second):
        rc, out = finish(proc)
        assert rc == 0, out
    assert job.status() == "finished"
    assert job.summary()["labels"] == {"batch": "nov"}
    events = redis.xrange(Keys().job_events(job.id))
    assert sorted(int(f[b"index"]) for _, f in events if f[b"type"] == b"item") == [0, 1, 2]
    assert sum(1 for _, f in events if f[b"type"] == b"finished") == 1


def test_a_hash_rq_cannot_parse_fails_alone_and_never_stops_a_worker(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    client = Client(redis_url)
    broken = client.caption(make_images(tmp_path / "i", 1), max_side=112, max_tokens=4)
    redis.hset(f"rq:job:{broken.id}", "timeout", "86400.0")  # RQ's parse_timeout asserts
    good = client.caption(make_images(tmp_path / "j", 2), max_side=112, max_tokens=4)
    for name in ("first", "again"):  # a restarted worker must not trip over it either
        rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", name=name))
        assert rc == 0, out
    assert good.status() == "finished"
    assert redis.hget(f"rq:job:{broken.id}", "status") == b"failed"
    assert not redis.lrange("rq:queue:caption:intermediate", 0, -1)


def test_a_cleanly_stopped_worker_name_can_be_reused_at_once(
        redis_url: str, tiny_model: Path, tmp_path: Path, start_worker: Spawn) -> None:
    for _ in range(2):
        rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst", name="same"))
        assert rc == 0, out


def test_readme_demo_command_runs(redis_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "REDIS_URL": redis_url, "VLMQ_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([VLMQ, "demo"], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "tiny reader" in out  # the demo reads
    rate = re.search(r"character error rate: ([\d.]+)% over 5 pages", out)
    assert rate is not None and float(rate.group(1)) <= 10.0, out
    cold, warm = re.findall(r"(\d+)/(\d+) items ok, (\d+) vision-cache hits", out)
    assert cold[0] == cold[1] and int(cold[2]) == 0
    assert warm[0] == warm[1] and int(warm[2]) == int(warm[1]) > 0
    work = re.findall(r"(\d+) vision-tower calls, (\d+) PDF renders", out)
    assert int(work[0][0]) > 0 and int(work[0][1]) > 0
    assert work[1] == ("0", "0"), "the warm run repeated image work"
    # Each job's summary is a table (headings, then figures), not a Python dict.
    assert "summary: {" not in out and "{'" not in proc.stdout
    table = re.findall(r"^  items +ok +failed +vision-cache hits .*\n  (5 +5 +0 +(\d+)) ",
                       proc.stdout, re.M)
    assert [hits for _, hits in table] == ["0", "5"], proc.stdout
    left = Redis.from_url(redis_url).keys("*")
    assert not [k for k in left if k.startswith((b"rq:job:", b"vlmq:job:", b"rq:queue:",
                                                 b"vlmq:blob:", b"rq:results:"))], left


def test_demo_json_is_one_object(redis_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "REDIS_URL": redis_url, "VLMQ_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([VLMQ, "demo", "--json"], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert "tiny reader" in proc.stderr  # notes go to stderr, beside the worker's log
    assert report["model"] == "reader"
    cold, warm = report["rounds"]
    assert (cold["round"], warm["round"]) == ("cold cache", "warm cache, restarted worker")
    for one in (cold, warm):
        (job,) = one["jobs"]
        assert job["status"] == "finished" and one["ok"] == one["items"] == 5
        assert job["summary"]["items"] == 5 and len(job["results"]) == 5
        assert job["cer"] is not None and job["cer"] <= 0.10
        assert {r["source"] for r in job["results"]} >= {"reader.pdf"}
    assert cold["cache_hits"] == 0 and warm["cache_hits"] == 5
    assert int(cold["worker_stats"]["tower_calls"]) > 0
    assert warm["worker_stats"]["tower_calls"] == "0"


def test_pickled_job_is_refused_by_the_worker(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        start_worker: Spawn) -> None:
    from rq import Queue

    marker = tmp_path / "unpickled"
    # The trap unpickles to a call of a stdlib function the worker can import: if anything
    # in the worker ever unpickled the job, the marker file would appear.
    trap = Tripwire(marker)
    assert pickle.loads(pickle.dumps(trap)) is None and marker.exists()
    marker.unlink()
    q = Queue("caption", connection=redis)  # RQ's default serializer: pickle
    job = q.enqueue_call(func=C.TASK_FUNC, args=[trap], meta={"trap": trap})
    rc, out = finish(start_worker(redis_url, tiny_model, tmp_path, "--burst"))
    assert rc == 0, out
    assert not marker.exists(), "the worker unpickled a job"
    assert redis.hget(f"rq:job:{job.id}", "status") == b"failed"
    assert "not JSON" in out or "pickle" in out.lower(), out


if sys.platform == "win32":  # pragma: no cover
    pytest.skip("process groups are POSIX", allow_module_level=True)
