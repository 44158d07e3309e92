"""Export keeps the user's own files, and its writes cannot be carried out of the root.

vlmq overwrites only what it wrote itself (the per-folder manifest with each file's
sha256); enqueue skips only those files as sidecars. Every folder is opened through its
parent's descriptor with O_NOFOLLOW, so a folder swapped for a symlink mid-export is
refused rather than followed.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image

from tests.support import helpers
from vlmq.producer.expand import expand_inputs, expand_sources
from vlmq.producer.export_ledger import MANIFEST_NAME
from vlmq.producer.ops.export import export_results
from vlmq.shared.messages import ItemResult
from vlmq.stores.backends import S3Store, Stores
from vlmq.worker.redis_server import free_port


def _result(source: str, page: int | None = None, text: str = "caption",
            index: int = 0) -> ItemResult:
    return ItemResult(index=index, source=source, page=page, text=text,
                      finish_reason="stop", prompt_tokens=1, completion_tokens=1,
                      vision_cache_hit=False, error=None)


def test_users_own_sidecar_named_files_are_kept_and_listed(tmp_path: Path) -> None:
    notes = tmp_path / "photo.jpg.txt"
    notes.write_text("MY OWN NOTES")
    takeout = tmp_path / "photo.jpg.json"
    takeout.write_text('{"title": "photo.jpg"}')
    report_md = tmp_path / "report.md"  # next to an extension-less PDF `report`
    report_md.write_text("# my report")
    rep = export_results([_result("photo.jpg")], tmp_path, "md")
    assert rep.kept == [notes] and rep.written == []
    assert notes.read_text() == "MY OWN NOTES"
    rep = export_results([_result("photo.jpg")], tmp_path, "json")
    assert rep.kept == [takeout] and takeout.read_text() == '{"title": "photo.jpg"}'
    rep = export_results([_result("report", 1)], tmp_path, "md")
    assert rep.kept == [report_md] and report_md.read_text() == "# my report"
    assert rep.to_dict()["kept"] == [str(report_md)]

    rep = export_results([_result("photo.jpg")], tmp_path, "md", overwrite=True)
    assert rep.written == [notes] and rep.kept == [] and notes.read_text() == "caption\n"


def test_vlmq_replaces_its_own_unchanged_files_only(tmp_path: Path) -> None:
    first = export_results([_result("a/p.png", text="one")], tmp_path)
    out = tmp_path / "a" / "p.png.txt"
    assert first.written == [out]
    manifest = json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())
    assert list(manifest["files"]) == ["p.png.txt"]
    again = export_results([_result("a/p.png", text="two")], tmp_path)
    assert again.written == [out] and out.read_text() == "two\n"
    out.write_text("edited by hand")  # changed since vlmq wrote it: the user's now
    third = export_results([_result("a/p.png", text="three")], tmp_path)
    assert third.kept == [out] and out.read_text() == "edited by hand"


def test_enqueue_skips_only_vlmqs_own_sidecars(tmp_path: Path) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "b.png")
    (tmp_path / "b.png.txt").write_text("MY OWN NOTES")  # the user's: an input like any
    export_results([_result("a.png")], tmp_path)          # vlmq's: skipped
    found, errors = expand_sources([tmp_path], recursive=True)
    assert errors == []
    assert sorted(f.source for f in found) == ["a.png", "b.png", "b.png.txt"]


def test_symlinked_folder_is_refused_even_pointing_inside(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, root / "out")
    os.symlink(root / "real", root / "in")
    rep = export_results([_result("out/x.jpg"), _result("in/y.jpg"),
                          _result("out/deep/z.jpg")], root)
    assert sorted(s for s, _ in rep.refused) == ["in/y.jpg", "out/deep/z.jpg", "out/x.jpg"]
    assert list(outside.iterdir()) == [] and list((root / "real").iterdir()) == []


def test_symlinked_target_file_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "secret"
    outside.write_text("keep")
    (tmp_path / "root").mkdir()
    os.symlink(outside, tmp_path / "root" / "x.jpg.txt")
    rep = export_results([_result("x.jpg")], tmp_path / "root", overwrite=True)
    assert [s for s, _ in rep.refused] == ["x.jpg"] and outside.read_text() == "keep"


def test_folder_swapped_for_a_symlink_mid_export_writes_nothing_outside(
        tmp_path: Path) -> None:
    """A thread swaps root/a between the real folder and a symlink to outside while
    hundreds of results are written into a/: no file may ever land outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    link = root / "a.lnk"
    os.symlink(outside, link)
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            try:
                os.rename(root / "a", root / "a.real")
                os.rename(link, root / "a")
                os.rename(root / "a", link)
                os.rename(root / "a.real", root / "a")
            except OSError:
                continue  # the export made a fresh `a` meanwhile: go round again

    results = [_result(f"a/{i}/x{i}.jpg", index=i) for i in range(400)]
    results += [_result(f"a/y{i}.jpg", index=400 + i) for i in range(400)]
    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        export_results(results, root, overwrite=True)
    finally:
        stop.set()
        swapper.join()
    assert [p for p in outside.rglob("*")] == []


def test_symlink_retargeted_between_check_and_write_is_refused(tmp_path: Path) -> None:
    """root/a is a symlink a thread keeps pointing at a folder inside, then outside: a
    check by name followed by a write by name (the old export) lands files outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    os.symlink(root / "real", root / "a")
    stop = threading.Event()

    def retarget() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            fresh = root / f".link{n}"
            os.symlink(outside if n % 2 else root / "real", fresh)
            os.replace(fresh, root / "a")

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads finely, as two processes would
    thread = threading.Thread(target=retarget)
    thread.start()
    try:
        reports = [export_results([_result(f"a/y{i}.jpg")], root) for i in range(300)]
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert list(outside.rglob("*")) == [] and list((root / "real").iterdir()) == []
    assert all(len(r.refused) == 1 and not r.written for r in reports)


def test_an_s3_listing_skips_only_what_a_manifest_names(tmp_path: Path) -> None:
    """A folder exported with --sidecar, then copied to a bucket, next to a user's own
    photo.jpg.txt: only the manifest and the files it names are left out."""
    boto3 = pytest.importorskip("boto3", reason="boto3 is a dependency of vlmq")
    server = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    assert server, "moto_server is in the dev extra (moto[server])"
    port = free_port()
    moto = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}",
                          aws_access_key_id="k", aws_secret_access_key="s",
                          region_name="us-east-1")
        helpers.wait_for(lambda: _listening(port), 30, "moto_server to listen")
        s3.create_bucket(Bucket="vlmq-sidecars")
        export_results([_result("a.png")], tmp_path)
        png = io.BytesIO()
        Image.new("RGB", (8, 8)).save(png, "PNG")
        objects = {"in/day/a.png": png.getvalue(), "in/day/b.png": png.getvalue(),
                   "in/day/b.png.txt": b"MY OWN NOTES", "in/c.png": png.getvalue(),
                   "in/c.png.txt": b"no manifest in this folder",
                   "in/day/a.png.txt": (tmp_path / "a.png.txt").read_bytes(),
                   f"in/day/{MANIFEST_NAME}": (tmp_path / MANIFEST_NAME).read_bytes()}
        for key, body in objects.items():
            s3.put_object(Bucket="vlmq-sidecars", Key=key, Body=body)
        stores = Stores([S3Store("scans", "vlmq-sidecars", "in", client=s3)])
        found, errors = expand_inputs(["s3://vlmq-sidecars/in/"], stores, recursive=True)
    finally:
        moto.terminate()
        moto.wait(10)
    assert errors == []
    assert sorted(f.source for f in found) == ["c.png", "c.png.txt", "day/a.png", "day/b.png",
                                               "day/b.png.txt"]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
