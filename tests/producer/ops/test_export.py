"""`vlmq export`: results back into files, on a real Redis with a real worker."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from redis import Redis

from tests.support import helpers
from tests.support.helpers import VLMQ, finish, make_pdf, page_image
from vlmq.producer.export_ledger import MANIFEST_NAME
from vlmq.producer.ops.export import UnsafeSource, export_results, target_path
from vlmq.producer.ops.output_formats import strip_controls
from vlmq.shared.blobs import BlobStore
from vlmq.shared.enqueue import enqueue
from vlmq.shared.keys import Keys
from vlmq.shared.messages import Item, ItemResult, JobPayload


def _vlmq(redis_url: str, *args: str, cwd: Path | None = None,
          check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VLMQ, "--redis-url", redis_url, *args], cwd=cwd,
                          capture_output=True, text=True, check=check)


@pytest.mark.slow
def test_export_mirrors_the_tree_and_writes_sidecars(
        redis_url: str, redis: Redis, tiny_model: Path, tmp_path: Path,
        procs: list[subprocess.Popen[str]]) -> None:
    tree = tmp_path / "in"
    (tree / "docs").mkdir(parents=True)
    make_pdf(tree / "docs" / "report.pdf", 3)
    for day, k in (("day1", 0), ("day2", 2)):
        (tree / "photos" / day).mkdir(parents=True)
        for i in range(2):
            page_image(k + i, (96, 96)).save(tree / "photos" / day / f"img{i}.png")
    settings = ["--max-tokens", "5", "--max-side", "112"]
    ocr = _vlmq(redis_url, "enqueue", "ocr", "docs/report.pdf", *settings,
                cwd=tree).stdout.strip()
    cap = _vlmq(redis_url, "enqueue", "caption", "photos", "-r", *settings,
                cwd=tree).stdout.strip()
    # A producer in any language may write any source: this one tries to climb out.
    sha, _ = BlobStore(redis, Keys()).put((tree / "photos" / "day1" / "img0.png").read_bytes())
    crafted = enqueue(redis, JobPayload(
        task="caption", items=(Item(kind="image", blob=sha, source="../../x.jpg"),),
        settings={"max_tokens": 3, "max_side": 112}), queue="caption")
    procs.append(helpers.start_worker(redis_url, tiny_model, tmp_path, "--burst"))
    rc, out = finish(procs[-1])
    assert rc == 0, out

    out_dir = tmp_path / "out"
    res = _vlmq(redis_url, "export", ocr, cap, "--dir", str(out_dir))
    assert res.returncode == 0, res.stderr
    written = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*")
                     if p.is_file() and p.name != MANIFEST_NAME)
    assert written == ["day1/img0.png.txt", "day1/img1.png.txt", "day2/img0.png.txt",
                       "day2/img1.png.txt", "docs/report.pdf.md"]
    doc = (out_dir / "docs" / "report.pdf.md").read_text()
    marks = [doc.index(f"<!-- page {n} -->") for n in (1, 2, 3)]
    assert marks == sorted(marks)
    texts = {r["source"]: r["text"] for r in map(
        json.loads, _vlmq(redis_url, "result", cap).stdout.splitlines())}
    # A .txt holds the text without control characters (the tiny model
    # writes some); the jsonl and json keep them.
    files = {source: strip_controls(text) for source, text in texts.items()}
    assert (out_dir / "day2" / "img1.png.txt").read_text() == files["day2/img1.png"] + "\n"

    res = _vlmq(redis_url, "export", cap, "--dir", str(tmp_path / "js"), "--format", "json")
    one = json.loads((tmp_path / "js" / "day1" / "img0.png.json").read_text())
    assert one["source"] == "day1/img0.png" and one["text"] == texts["day1/img0.png"]

    notes = tree / "photos" / "day1" / "img0.png.txt"
    notes.write_text("MY OWN NOTES")  # the user's own file where a sidecar would go
    res = _vlmq(redis_url, "export", cap, "--sidecar", str(tree / "photos"), check=False)
    assert res.returncode == 1 and f"kept {notes}" in res.stderr, res.stderr
    assert notes.read_text() == "MY OWN NOTES"
    assert (tree / "photos" / "day1" / "img1.png.txt").read_text() == \
        files["day1/img1.png"] + "\n"
    assert "wrote 3 file(s)" in res.stdout
    res = _vlmq(redis_url, "export", cap, "--sidecar", str(tree / "photos"), "--overwrite")
    assert "wrote 4 file(s)" in res.stdout and notes.read_text() == files["day1/img0.png"] + "\n"

    res = _vlmq(redis_url, "export", crafted, "--dir", str(out_dir / "deep" / "er"),
                check=False)
    assert res.returncode == 1 and "climbs out" in res.stderr, res.stderr
    assert not (tmp_path / "x.jpg.txt").exists() and not (out_dir / "x.jpg.txt").exists()

    txt = _vlmq(redis_url, "result", cap, "--format", "txt").stdout
    assert txt == "".join(files[s] + "\n\n" for s in sorted(files))


def _result(source: str, page: int | None = None, text: str = "t") -> ItemResult:
    return ItemResult(index=0, source=source, page=page, text=text, finish_reason="stop",
                      prompt_tokens=1, completion_tokens=1, vision_cache_hit=False, error=None)


@pytest.mark.parametrize("source", ["../../x.jpg", "a/../../x.jpg", "/etc/x.jpg",
                                    "C:\\x.jpg", "..\\x.jpg", ""])
def test_sources_that_escape_are_refused(tmp_path: Path, source: str) -> None:
    with pytest.raises(UnsafeSource):
        target_path(tmp_path / "out", source, ".txt")
    report = export_results([_result(source)], tmp_path / "out")
    assert report.refused and not report.written
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_symlinked_folder_pointing_out_is_refused(tmp_path: Path) -> None:
    outside, root = tmp_path / "outside", tmp_path / "root"
    outside.mkdir()
    root.mkdir()
    os.symlink(outside, root / "link")
    report = export_results([_result("link/x.jpg"), _result("fine/y.jpg")], root)
    assert [s for s, _ in report.refused] == ["link/x.jpg"]
    assert list(outside.iterdir()) == [] and (root / "fine" / "y.jpg.txt").read_text() == "t\n"


def test_failed_page_keeps_its_place_and_failed_image_is_not_written(tmp_path: Path) -> None:
    bad = ItemResult(index=1, source="d.pdf", page=2, text=None, finish_reason="error",
                     prompt_tokens=0, completion_tokens=0, vision_cache_hit=False,
                     error="render failed")
    img = ItemResult(index=3, source="p.png", page=None, text=None, finish_reason="error",
                     prompt_tokens=0, completion_tokens=0, vision_cache_hit=False, error="x")
    report = export_results([_result("d.pdf", 3, "three"), bad, _result("d.pdf", 1, "one"),
                             img], tmp_path, "txt")
    doc = (tmp_path / "d.pdf.txt").read_text()
    assert doc.index("one") < doc.index("[error: render failed]") < doc.index("three")
    assert not (tmp_path / "p.png.txt").exists()
    assert sorted(s for s, _ in report.failed) == ["d.pdf page 2", "p.png"]
