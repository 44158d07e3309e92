"""`vlmq enqueue` and `vlmq schedule` over a photo folder as people keep one: pictures with
sidecars beside them. The sidecars are left out and counted; the job id alone is stdout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result
from redis import Redis

from tests.support.factories import image_bytes
from vlmq.shared.enqueue import fetch_job, payload_of

RunCli = Callable[..., Result]


@pytest.fixture
def trip(tmp_path: Path) -> Path:
    root = tmp_path / "trip"
    (root / "day2" / "edits").mkdir(parents=True)
    (root / "IMG_0001.jpg").write_bytes(image_bytes("JPEG", color=(9, 0, 0)))
    (root / "IMG_0001.xmp").write_bytes(b'<?xpacket begin=""?><x:xmpmeta xmlns:x="adobe:ns:meta/">')
    (root / "IMG_0001.jpg.json").write_text('{"title": "IMG_0001.jpg", "people": []}')
    (root / "notes.txt").write_text("Day one: the harbour at dawn.\n")
    (root / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1\x00")
    (root / "day2" / "IMG_0002.png").write_bytes(image_bytes(color=(0, 9, 0)))
    (root / "day2" / "IMG_0002.aae").write_bytes(
        b'<?xml version="1.0" encoding="UTF-8"?>\n<plist version="1.0"><dict/></plist>')
    (root / "day2" / "edits" / "IMG_0003.heic.png").write_bytes(image_bytes(color=(0, 0, 9)))
    (root / "day2" / "edits" / "IMG_0003.xmp").write_bytes(b"<x:xmpmeta/>")
    return root


SIDECARS = ["IMG_0001.jpg.json", "IMG_0001.xmp", "IMG_0002.aae", "IMG_0003.xmp", "notes.txt"]


def test_a_folder_enqueues_its_images_and_names_the_sidecars_it_left_out(
        run_cli: RunCli, redis: Redis, trip: Path) -> None:
    res = run_cli("enqueue", "caption", str(trip), "--recursive", code=0)
    job_id = res.stdout.strip()
    assert res.stdout == f"{job_id}\n" and job_id  # what PHOTOS=$(vlmq enqueue ...) takes
    assert ("vlmq: skipped 5 files that are not PDFs or images: .aae 1, .json 1, .txt 1, "
            ".xmp 2") in res.stderr, res.stderr
    payload = payload_of(fetch_job(redis, job_id))
    assert sorted(i.source for i in payload.items) == [
        "IMG_0001.jpg", "day2/IMG_0002.png", "day2/edits/IMG_0003.heic.png"]


def test_json_lists_each_file_left_out_with_its_kind(run_cli: RunCli, redis: Redis,
                                                    trip: Path) -> None:
    res = run_cli("enqueue", "caption", str(trip), "-r", "--json", code=0)
    out = json.loads(res.stdout)
    assert out["items"] == 3 and out["rejected"] == []
    left = sorted((Path(f["path"]).name, f["kind"]) for f in out["not_media"])
    assert left == [("IMG_0001.jpg.json", ".json"), ("IMG_0001.xmp", ".xmp"),
                    ("IMG_0002.aae", ".aae"), ("IMG_0003.xmp", ".xmp"), ("notes.txt", ".txt")]
    assert all(f["reason"].startswith("is neither a PDF nor an image")
               for f in out["not_media"])
    assert out["jobs"][0]["not_media"] == out["not_media"]


def test_a_corrupt_jpeg_beside_the_sidecars_still_stops_the_set(run_cli: RunCli,
                                                               redis: Redis,
                                                               trip: Path) -> None:
    (trip / "day2" / "IMG_0004.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut off by the card")
    before = redis.dbsize()
    res = run_cli("enqueue", "caption", str(trip), "-r", code=2)
    assert f"{trip / 'day2' / 'IMG_0004.jpg'}: " in res.stderr
    assert "nothing was enqueued" in res.stderr and res.stdout == ""
    assert not any(name in res.stderr for name in SIDECARS), res.stderr
    assert redis.dbsize() == before
    res = run_cli("enqueue", "caption", str(trip), "-r", "--skip-bad", "--json", code=0)
    out = json.loads(res.stdout)
    assert out["items"] == 3 and [Path(r["path"]).name for r in out["rejected"]] == [
        "IMG_0004.jpg"]
    assert len(out["not_media"]) == 5


def test_a_note_named_on_the_command_line_is_still_refused(run_cli: RunCli, redis: Redis,
                                                            trip: Path) -> None:
    before = redis.dbsize()
    res = run_cli("enqueue", "caption", str(trip / "IMG_0001.jpg"), str(trip / "notes.txt"),
                  code=2)
    assert f"{trip / 'notes.txt'}: is neither a PDF nor an image" in res.stderr
    assert "nothing was enqueued" in res.stderr and res.stdout == ""
    assert redis.dbsize() == before


def test_a_folder_of_sidecars_alone_enqueues_nothing(run_cli: RunCli, redis: Redis,
                                                     trip: Path) -> None:
    (trip / "day2" / "edits" / "IMG_0003.heic.png").unlink()
    (trip / "day2" / "edits" / "README").write_text("edited in Photos\n")
    before = redis.dbsize()
    res = run_cli("enqueue", "caption", str(trip / "day2" / "edits"), code=2)
    assert res.stdout == ""
    assert ("vlmq: error: no PDFs or images to enqueue, only 2 other file(s): (no suffix) 1, "
            ".xmp 1\n") in res.stderr, res.stderr
    assert f"  e.g. {trip / 'day2' / 'edits' / 'IMG_0003.xmp'}: is neither a PDF nor" \
        in res.stderr
    assert "nothing was enqueued" in res.stderr
    assert redis.dbsize() == before


def test_a_scheduled_run_leaves_the_same_files_out(run_cli: RunCli, redis: Redis,
                                                   trip: Path) -> None:
    run_cli("schedule", "add", "trip", "caption", str(trip), "-r", "--every", "3600", code=0)
    run = json.loads(run_cli("schedule", "run", "trip", "--json", code=0).stdout)
    assert run["items"] == 3 and run["bad"] == []
    assert run["not_media"] == {".aae": 1, ".json": 1, ".txt": 1, ".xmp": 2}
    line = run_cli("schedule", "run", "trip", code=0).stdout
    assert "5 file(s) not PDFs or images left out (.aae 1, .json 1, .txt 1, .xmp 2)" in line
