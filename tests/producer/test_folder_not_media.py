"""A folder is taken as a person means it: its PDFs and images, with the sidecars beside
them (.xmp, .json, .aae, .txt), notes and videos left out and reported; a damaged picture
and a file named on its own are refused as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.factories import image_bytes
from tests.support.helpers import pdf_bytes
from vlmq.producer import stream_sets
from vlmq.producer.client import Client
from vlmq.producer.inputs import InputErrors, NoMedia, not_media_summary, prepare
from vlmq.producer.job_sets import Batch
from vlmq.shared import constants as C
from vlmq.shared.enqueue import fetch_job, payload_of
from vlmq.shared.errors import InputError
from vlmq.stores.backends import FolderStore, Stores

MOV = b"\x00\x00\x00\x14ftypqt  \x00\x00\x02\x00qt  " + bytes(4096)


def _library(root: Path) -> Path:
    """A photo library as a phone or a Mac exports it."""
    (root / "day2").mkdir(parents=True)
    (root / "IMG_0001.JPG").write_bytes(image_bytes("JPEG", color=(9, 0, 0)))
    (root / "IMG_0001.xmp").write_bytes(b'<?xpacket begin=""?><x:xmpmeta xmlns:x="adobe:ns:meta/">')
    (root / "IMG_0001.aae").write_bytes(b'<?xml version="1.0"?>\n<plist version="1.0"><dict/>')
    (root / "IMG_0001.JPG.json").write_text('{"title": "IMG_0001.JPG"}')
    (root / "IMG_0002.MOV").write_bytes(MOV)
    (root / "notes.txt").write_text("day one\n")
    (root / "empty.txt").write_bytes(b"")
    (root / "LICENSE").write_text("all rights reserved\n")
    (root / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (root / "day2" / "scan.pdf").write_bytes(pdf_bytes(2))
    (root / "day2" / "IMG_0003.png").write_bytes(image_bytes(color=(0, 9, 0)))
    (root / "day2" / "IMG_0003.xmp").write_bytes(b"<x:xmpmeta/>")
    return root


def test_a_folder_gives_its_media_and_leaves_the_rest_out(tmp_path: Path) -> None:
    root = _library(tmp_path / "lib")
    prepared = prepare([root], recursive=True)
    assert sorted((i.source, i.page) for i in prepared.items) == [
        ("IMG_0001.JPG", None), ("day2/IMG_0003.png", None), ("day2/scan.pdf", 1),
        ("day2/scan.pdf", 2)]
    assert prepared.rejected == []
    left = {Path(p).relative_to(root).as_posix(): kind for p, kind, _ in prepared.not_media}
    assert left == {"IMG_0001.xmp": ".xmp", "IMG_0001.aae": ".aae",
                    "IMG_0001.JPG.json": ".json", "IMG_0002.MOV": ".mov",
                    "notes.txt": ".txt", "empty.txt": ".txt", "LICENSE": "(no suffix)",
                    "day2/IMG_0003.xmp": ".xmp"}
    reasons = {Path(p).name: r for p, _, r in prepared.not_media}
    assert "it is a video" in reasons["IMG_0002.MOV"] and reasons["empty.txt"] == "is empty"
    assert not_media_summary(prepared.not_media) == (
        "skipped 8 files that are not PDFs or images: "
        "(no suffix) 1, .aae 1, .json 1, .mov 1, .txt 2, .xmp 2")


def test_one_file_left_out_is_counted_in_the_singular(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(image_bytes())
    (tmp_path / "a.xmp").write_text("<x/>")
    prepared = prepare([tmp_path])
    assert not_media_summary(prepared.not_media) == (
        "skipped 1 file that is not a PDF or an image: .xmp 1")


def test_a_damaged_picture_in_a_folder_still_refuses_the_set(tmp_path: Path) -> None:
    root = _library(tmp_path / "lib")
    (root / "IMG_0004.jpg").write_bytes(image_bytes("JPEG")[:300])
    (root / "IMG_0005.heic").write_bytes(b"")
    with pytest.raises(InputErrors) as caught:
        prepare([root], recursive=True)
    assert sorted(Path(e.path).name for e in caught.value.errors) == [
        "IMG_0004.jpg", "IMG_0005.heic"]
    prepared = prepare([root], recursive=True, skip_bad=True)
    assert sorted(Path(p).name for p, _ in prepared.rejected) == ["IMG_0004.jpg",
                                                                   "IMG_0005.heic"]
    assert len(prepared.not_media) == 8 and len(prepared.items) == 4


def test_a_file_named_on_its_own_is_refused_even_beside_a_folder(tmp_path: Path) -> None:
    root = _library(tmp_path / "lib")
    with pytest.raises(InputError, match=r"notes\.txt: is neither a PDF nor an image"):
        prepare([root / "notes.txt"])
    with pytest.raises(InputError, match=r"LICENSE: is neither a PDF nor an image"):
        prepare([root / "day2", root / "LICENSE"])
    # A quoted glob names its matches: they are refused as files named one by one are.
    with pytest.raises(InputErrors):
        prepare([str(root / "IMG_0001.*")])


def test_a_folder_without_media_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("nothing to see\n")
    (tmp_path / "a.xmp").write_text("<x/>")
    (tmp_path / "b.xmp").write_text("<x/>")
    with pytest.raises(NoMedia) as caught:
        prepare([tmp_path])
    assert str(caught.value) == (
        "no PDFs or images to enqueue, only 3 other file(s): .txt 1, .xmp 2\n"
        f"  e.g. {tmp_path / 'a.xmp'}: is neither a PDF nor an image Pillow can read: it is "
        "plain text; captions and OCR need an image or a PDF")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="folder has no files"):
        prepare([empty])


def test_a_video_over_the_blob_limit_is_left_out_and_a_photo_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "BLOB_MAX_BYTES", 2048)
    (tmp_path / "a.png").write_bytes(image_bytes())
    (tmp_path / "clip.mov").write_bytes(MOV)
    prepared = prepare([tmp_path])
    assert [Path(p).name for p, _, _ in prepared.not_media] == ["clip.mov"]
    (tmp_path / "big.png").write_bytes(image_bytes(size=(400, 400)) + bytes(4096))
    with pytest.raises(InputError, match=r"big\.png: is \d+ bytes, over the"):
        prepare([tmp_path])


def test_a_folder_store_leaves_the_same_files_out(tmp_path: Path) -> None:
    root = _library(tmp_path / "lib")
    stores = Stores([FolderStore("lib", root)])
    prepared = prepare([root], recursive=True, stores=stores)
    assert all(i.ref is not None for i in prepared.items) and len(prepared.items) == 4
    assert len(prepared.not_media) == 8


def test_the_client_reports_what_a_folder_left_out(redis_url: str, tmp_path: Path) -> None:
    root = _library(tmp_path / "lib")
    with Client(redis_url) as client:
        job = client.caption(root, recursive=True)
        assert job.items == 4  # two images, two PDF pages
        assert sorted(Path(p).name for p, _, _ in job.not_media) == sorted([
            "IMG_0001.xmp", "IMG_0001.aae", "IMG_0001.JPG.json", "IMG_0002.MOV", "notes.txt",
            "empty.txt", "LICENSE", "IMG_0003.xmp"])
        payload = payload_of(fetch_job(client.redis, job.id))
        assert sorted(i.source for i in payload.items) == [
            "IMG_0001.JPG", "day2/IMG_0003.png", "day2/scan.pdf", "day2/scan.pdf"]
        made = client.submit_set("caption", [root], recursive=True)
        assert len(made.not_media) == 8


def test_a_set_streamed_as_it_is_walked_reports_what_it_left_out(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_sets, "STREAM_AFTER_ITEMS", 1)
    root = _library(tmp_path / "lib")
    with Client(redis_url) as client:
        made = client.submit_set("caption", [root], recursive=True, job_size=1)
        assert isinstance(made, Batch) and len(made.jobs()) == 4
        assert sorted(Path(p).name for p, _, _ in made.not_media) == sorted([
            "IMG_0001.xmp", "IMG_0001.aae", "IMG_0001.JPG.json", "IMG_0002.MOV", "notes.txt",
            "empty.txt", "LICENSE", "IMG_0003.xmp"])
