"""Hostile inputs the attack on the landed service found: each is
refused or escaped where it enters, naming what is wrong, on a real Redis."""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from redis import Redis
from redis.exceptions import ResponseError

from tests.support import helpers
from tests.support.factories import SHA
from tests.support.helpers import VLMQ
from vlmq.cli.demo import DEMO_QUEUE_PREFIX, demo_queues, round_problem
from vlmq.producer.client import Client
from vlmq.producer.files import check_file
from vlmq.producer.inputs import InputErrors, prepare
from vlmq.producer.manifest import MAX_LINE_BYTES, ManifestError, read_manifest
from vlmq.producer.ops.output_formats import FORMATS, JobResults
from vlmq.producer.options import JobOptions
from vlmq.shared import constants as C
from vlmq.shared.enqueue import lua_script
from vlmq.shared.errors import InputError
from vlmq.shared.keys import RQ_QUEUES, Keys
from vlmq.worker.prep.decode import PreprocessError, decode_image
from vlmq.worker.redis_server import free_port


def _png(path: Path, size: tuple[int, int] = (16, 16)) -> Path:
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return path


# -- file names that are not UTF-8 ------------------------------------------------------

def test_a_non_utf8_file_name_is_skipped_and_named_with_skip_bad(tmp_path: Path) -> None:
    _png(tmp_path / "good.png")
    _png(Path(os.fsdecode(bytes(tmp_path) + b"/\xff\xfe.png")))
    prepared = prepare([tmp_path], recursive=True, skip_bad=True)
    assert [i.source for i in prepared.items] == ["good.png"]
    [(name, problem)] = prepared.rejected
    assert name.endswith("/\\xff\\xfe.png") and "not valid UTF-8" in problem
    name.encode("utf-8")  # printable as it is


def test_a_non_utf8_file_name_is_refused_naming_it(tmp_path: Path) -> None:
    _png(tmp_path / "good.png")
    _png(Path(os.fsdecode(bytes(tmp_path) + b"/\xff\xfe.png")))
    with pytest.raises(InputError) as info:
        prepare([tmp_path], recursive=True)
    assert not isinstance(info.value, InputErrors)
    assert info.value.path.endswith("\\xff\\xfe.png"), info.value.path


# -- manifest lines ---------------------------------------------------------------------

def test_an_overlong_manifest_line_is_refused_by_number_without_reading_it(
        tmp_path: Path) -> None:
    img = _png(tmp_path / "a.png")
    good = json.dumps({"custom_id": "a", "task": "caption", "file": img.name})
    long = json.dumps({"custom_id": "b", "task": "caption", "file": img.name,
                       "prompt": "x" * (20 * MAX_LINE_BYTES)})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(f"{good}\n{long}\n{good.replace('a', 'c', 1)}\n")
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError) as info:
            read_manifest(manifest, JobOptions())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.errors == [(2, f"is longer than the {MAX_LINE_BYTES}-byte limit for a "
                                     "manifest line")]
    assert peak < 8 * MAX_LINE_BYTES, peak  # the 20 MiB line was never held whole
    groups, rejected = read_manifest(manifest, JobOptions(), skip_bad=True)
    assert [n for n, _ in rejected] == [2] and len(groups[0].prepared.items) == 2


def test_a_manifest_line_of_exactly_the_cap_is_read(tmp_path: Path) -> None:
    img = _png(tmp_path / "a.png")
    head = json.dumps({"custom_id": "a", "task": "caption", "file": img.name})
    line = head[:-1] + ' ' * (MAX_LINE_BYTES - len(head)) + "}"
    assert len(line) == MAX_LINE_BYTES
    (tmp_path / "m.jsonl").write_text(line + "\n")
    groups, _ = read_manifest(tmp_path / "m.jsonl", JobOptions())
    assert len(groups[0].prepared.items) == 1


# -- control characters in `vlmq result --format md` --------------------------------------

def test_control_characters_in_names_are_escaped_in_markdown_headings(
        redis_url: str, redis: Redis) -> None:
    redis.set(Keys().blob(SHA), b"x")
    job_id = helpers.raw_enqueue(redis, {"v": 1, "task": "caption", "items": [
        {"kind": "image", "blob": SHA, "source": "a\r\n## forged\x00.png",
         "custom_id": "id\nwith\rbreaks"},
        {"kind": "image", "blob": SHA, "source": "b.png"}]}, queue="caption")
    with Client(redis_url) as client:
        md = FORMATS["md"].render(JobResults.read(client.job(job_id)))
    headings = [line for line in md.split("\n") if line.startswith("## ")]
    assert headings == ["## a\\r\\n## forged\\x00.png (id\\nwith\\rbreaks)", "## b.png"]
    assert "\x00" not in md and "\r" not in md


# -- aspect ratio -----------------------------------------------------------------------

def _wide_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (60000, 1), (9, 9, 9)).save(buf, "JPEG")
    return buf.getvalue()


def test_a_60000_by_1_image_is_refused_at_enqueue_with_its_real_ratio(tmp_path: Path) -> None:
    (tmp_path / "wide.jpg").write_bytes(_wide_jpeg())
    with pytest.raises(InputError) as info:
        check_file(tmp_path / "wide.jpg")
    assert "60000x1" in info.value.problem and "60000.0" in info.value.problem
    assert f"under {C.MAX_ASPECT_RATIO}" in info.value.problem
    _png(tmp_path / "ok.png", (199, 1))
    assert check_file(tmp_path / "ok.png").kind == "image"


def test_the_worker_names_the_ratio_of_the_image_it_was_given() -> None:
    with pytest.raises(PreprocessError) as info:
        decode_image(_wide_jpeg(), 2048)
    assert "60000.0" in str(info.value) and "2048.0" not in str(info.value)


# -- enqueue.lua's own limits -------------------------------------------------------------

def _eval(redis: Redis, items: list[dict[str, Any]], *, now: str = "2026-11-29T12:00:00.0Z",
          description: str = "d") -> Any:
    k = Keys()
    keys = [Keys.rq_job("j1"), Keys.rq_queue("ocr"), RQ_QUEUES, k.job_items("j1"),
            k.job_events("j1")]
    data = json.dumps([C.TASK_FUNC, None, [{"v": 1, "task": "caption", "items": items}], {}])
    return redis.eval(lua_script(), len(keys), *keys, "j1", "ocr", data, description,
                      "60", "60", "60", now, "3")


def _item(sha: str = SHA, **extra: Any) -> dict[str, Any]:
    return {"kind": "image", "blob": sha, "source": "a.png", **extra}


def _refused(redis: Redis, needle: str, items: list[dict[str, Any]], **kw: str) -> None:
    with pytest.raises(ResponseError) as info:
        _eval(redis, items, **kw)
    assert needle in str(info.value), str(info.value)
    assert not redis.exists(Keys.rq_job("j1"))


@pytest.mark.parametrize("now", ["2026-13-01T12:00:00.0Z", "2026-11-45T12:00:00.0Z",
                                 "2026-02-29T12:00:00.0Z", "2026-11-29T25:00:00.0Z",
                                 "2026-11-29T12:61:00.0Z", "2026-11-29T12:00:61.0Z",
                                 "2026-13-45T25:61:61.000000Z", "0000-01-01T00:00:00.0Z"])
def test_enqueue_refuses_an_impossible_now(redis: Redis, now: str) -> None:
    redis.set(Keys().blob(SHA), b"x")
    _refused(redis, f"now: {now} is not a valid UTC date and time", [_item()], now=now)


def test_enqueue_takes_a_leap_day(redis: Redis) -> None:
    redis.set(Keys().blob(SHA), b"x")
    assert _eval(redis, [_item()], now="2028-02-29T23:59:59.999999Z") == 1


def test_enqueue_refuses_an_overlong_source_and_description(redis: Redis) -> None:
    redis.set(Keys().blob(SHA), b"x")
    _refused(redis, "items[1].source: must be a string of at most 4096 characters",
             [_item(), _item(source="é" * 4097)])
    _refused(redis, "items[0].source: must be a string", [_item(source=None)])
    _refused(redis, "description: is longer than 16384 characters", [_item()],
             description="d" * 16385)
    assert _eval(redis, [_item(source="é" * 4096)], description="é" * 16384) == 1


def test_enqueue_names_the_first_missing_blob(redis: Redis) -> None:
    shas = [f"{n:064x}" for n in range(1, 400)]
    _refused(redis, "items[0].blob: no blob", [_item(s) for s in shas])
    redis.set(Keys().blob(shas[0]), b"x")
    _refused(redis, "items[1].blob: no blob", [_item(s) for s in shas])


def test_enqueue_refuses_a_blob_over_64_mib(redis: Redis) -> None:
    key = Keys().blob(SHA)
    redis.setrange(key, C.BLOB_MAX_BYTES, b"x")  # one byte over
    _refused(redis, f"holds {C.BLOB_MAX_BYTES + 1} bytes, over the {C.BLOB_MAX_BYTES}-byte",
             [_item()])
    redis.set(key, b"x" * 10)
    assert _eval(redis, [_item()]) == 1
    assert str(C.BLOB_MAX_BYTES) in lua_script()


# -- no payload bytes in messages ---------------------------------------------------------

@pytest.fixture
def replica_url(tmp_path: Path) -> Iterator[str]:
    """A real read-only replica (of a master that is not there) on a free port."""
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                             "--replicaof", "127.0.0.1", "1"], stdout=subprocess.DEVNULL)
    try:
        conn = Redis(port=port)
        for _ in range(100):
            try:
                conn.ping()
                break
            except OSError:
                time.sleep(0.05)
        conn.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_refused_upload_does_not_print_the_image_bytes(replica_url: str,
                                                        tmp_path: Path) -> None:
    img = _png(tmp_path / "a.png")
    res = subprocess.run([VLMQ, "--redis-url", replica_url, "enqueue", "caption", str(img)],
                         capture_output=True, check=False)
    err = res.stderr.decode("utf-8", "replace")
    assert res.returncode != 0 and "read only replica" in err, err
    assert b"PNG" not in res.stderr and b"\x89" not in res.stderr, err
    assert "in SET command 1 of a pipeline" in err
    assert all(c.isprintable() for c in err.rstrip("\n")), err


# -- demos on one Redis -------------------------------------------------------------------

def test_each_demo_run_has_queues_of_its_own() -> None:
    first, second = demo_queues(), demo_queues()
    assert first != second and not set(first) & set(second)
    assert all(q.startswith(DEMO_QUEUE_PREFIX) for q in first + second)


def test_a_demo_that_saw_nothing_of_its_own_says_why(redis_url: str, tmp_path: Path) -> None:
    img = _png(tmp_path / "a.png")
    with Client(redis_url) as client:
        job = client.caption([img], queue=demo_queues()[1])
        problem = round_problem([job], {"items": 0, "ok": 0, "cache_hits": 0, "tokens": 0})
    assert problem is not None
    assert "finished 0 of this demo's 1 items" in problem and f"{job.id} queued" in problem
