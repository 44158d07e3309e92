"""Local input validation: content-based type detection, limits, page ranges, path expansion."""

from __future__ import annotations

import hashlib
import io
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.support.helpers import pdf_bytes
from vlmq.producer import files
from vlmq.producer.expand import expand_paths
from vlmq.producer.files import BlobSource, check_file
from vlmq.producer.inputs import InputErrors, prepare
from vlmq.producer.page_specs import parse_pages
from vlmq.shared import constants as C
from vlmq.shared.errors import InputError


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (64, 48),
                color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, fmt)
    return buf.getvalue()


def noisy_bytes(fmt: str) -> bytes:
    """An image whose encoding is long enough that cutting its tail really truncates pixels."""
    buf = io.BytesIO()
    Image.effect_noise((300, 200), 60).convert("RGB").save(buf, fmt)
    return buf.getvalue()


def bomb_png(width: int, height: int) -> bytes:
    """A real, valid PNG of huge declared size: 1-bit zeros compress to a few KB."""
    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, "PNG")
    return buf.getvalue()


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# --- type detection by content ------------------------------------------------------------


def test_pdf_is_recognised_and_its_pages_counted(tmp_path: Path) -> None:
    f = check_file(write(tmp_path / "doc.pdf", pdf_bytes(4)))
    assert (f.kind, f.pages, f.source) == ("pdf", 4, str(tmp_path / "doc.pdf"))
    assert len(f.sha256) == 64


def test_type_comes_from_content_not_extension(tmp_path: Path) -> None:
    assert check_file(write(tmp_path / "scan.png", pdf_bytes(2))).kind == "pdf"
    assert check_file(write(tmp_path / "photo.pdf", image_bytes("JPEG"))).kind == "image"
    assert check_file(write(tmp_path / "noext", image_bytes("PNG"))).kind == "image"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "TIFF", "BMP"])
def test_common_image_formats_pass(tmp_path: Path, fmt: str) -> None:
    f = check_file(write(tmp_path / f"img.{fmt.lower()}", image_bytes(fmt)))
    # Every TIFF is a page set, even of one page (tests/producer/test_tiff.py).
    assert (f.kind, f.pages) == ("tiff" if fmt == "TIFF" else "image", 1)


def _problem(path: Path) -> str:
    with pytest.raises(InputError) as info:
        check_file(path)
    assert info.value.path == str(path)
    return info.value.problem


def test_empty_file(tmp_path: Path) -> None:
    assert _problem(write(tmp_path / "empty.pdf", b"")) == "is empty"


def test_missing_file_and_directory(tmp_path: Path) -> None:
    assert _problem(tmp_path / "nope.png") == "no such file"
    assert "is a directory" in _problem(tmp_path)


def test_truncated_pdf(tmp_path: Path) -> None:
    data = pdf_bytes(3)
    assert "corrupt or truncated PDF" in _problem(write(tmp_path / "t.pdf", data[: len(data) // 2]))


def test_corrupt_pdf(tmp_path: Path) -> None:
    junk = b"%PDF-1.7\n" + bytes(range(256)) * 20
    assert "corrupt or truncated PDF" in _problem(write(tmp_path / "c.pdf", junk))


def test_non_image_named_png(tmp_path: Path) -> None:
    problem = _problem(write(tmp_path / "notes.png", b"just some text, not pixels\n"))
    assert problem == ("is neither a PDF nor an image Pillow can read: it is plain text; "
                       "captions and OCR need an image or a PDF")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image(tmp_path: Path, fmt: str) -> None:
    data = noisy_bytes(fmt)
    problem = _problem(write(tmp_path / f"cut.{fmt.lower()}", data[: len(data) - 2000]))
    assert "corrupt or truncated image" in problem


def test_image_over_pixel_limit_refused_before_decoding(tmp_path: Path) -> None:
    # 72 Mpx: over vlmq's limit, under Pillow's own warning threshold (~89 Mpx).
    w, h = 9000, 8000
    assert C.MAX_IMAGE_PIXELS < w * h < Image.MAX_IMAGE_PIXELS  # type: ignore[operator]
    problem = _problem(write(tmp_path / "big.png", bomb_png(w, h)))
    assert "decompression bomb" in problem and "9000x8000" in problem


@pytest.mark.parametrize("side", [10_000, 14_000])
def test_pillow_bomb_warning_and_error_become_rejections(tmp_path: Path, side: int) -> None:
    # 100 Mpx trips Pillow's DecompressionBombWarning, 196 Mpx its DecompressionBombError;
    # pytest turns stray warnings into errors, so this also proves none escapes.
    data = bomb_png(side, side)
    assert len(data) < 64 * 1024
    assert "decompression bomb" in _problem(write(tmp_path / "bomb.png", data))


def test_file_over_blob_limit_is_refused_without_reading(tmp_path: Path) -> None:
    path = tmp_path / "huge.png"
    with open(path, "wb") as fh:  # sparse: costs no disk
        fh.truncate(C.BLOB_MAX_BYTES + 1)
    assert "over the" in _problem(path) and str(C.BLOB_MAX_BYTES) in _problem(path)
    assert "split" not in _problem(path)


def test_pdf_over_blob_limit_suggests_splitting(tmp_path: Path) -> None:
    path = tmp_path / "scans.bin"  # the header, not the name, makes it a PDF
    with open(path, "wb") as fh:
        fh.write(b"%PDF-1.7\n")
        fh.truncate(C.BLOB_MAX_BYTES + 1)
    problem = _problem(path)
    assert problem == (f"is {C.BLOB_MAX_BYTES + 1} bytes, over the 64 MiB "
                       f"({C.BLOB_MAX_BYTES}-byte) blob limit; split it into smaller PDFs")


# --- page ranges ----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "pages"), [
    (None, [1, 2, 3, 4]),
    ("1-3,7", None),  # 7 > 4: checked below
    ("2", [2]),
    ("1-2,4", [1, 2, 4]),
    (" 3 - 4 , 1 ", [3, 4, 1]),
    ("1,1,2-3,2", [1, 2, 3]),
    ([4, 2], [4, 2]),
])
def test_parse_pages_valid(spec: str | list[int] | None, pages: list[int] | None) -> None:
    if pages is None:
        assert parse_pages(spec, 7, "doc.pdf") == [1, 2, 3, 7]
    else:
        assert parse_pages(spec, 4, "doc.pdf") == pages


@pytest.mark.parametrize(("spec", "needle"), [
    ("0", "numbered from 1"),
    ("0-2", "numbered from 1"),
    ("5-2", "'5-2': 2 comes before 5"),
    ("abc", "bad page range 'abc'"),
    ("1-", "bad page range '1-'"),
    ("1,,2", "bad page range ''"),
    ("-3", "bad page range '-3'"),
    ("", "empty page range"),
    ("9", "page 9 is out of range: doc.pdf has 4 pages"),
    ("2-5", "page 5 is out of range: doc.pdf has 4 pages"),
    ("1-300000000", "page 300000000 is out of range: doc.pdf has 4 pages"),
    ("1-2,3-9,abc", "page 9 is out of range"),
    ([0], "numbered from 1"),
    ([], "empty page list"),
])
def test_parse_pages_errors(spec: str | list[int], needle: str) -> None:
    with pytest.raises(InputError) as info:
        parse_pages(spec, 4, "doc.pdf")
    assert info.value.path == "doc.pdf"
    assert needle in info.value.problem


def test_huge_range_is_checked_before_it_is_expanded() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match="page 5000000 is out of range"):
            parse_pages("1-5000000", 4, "doc.pdf")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000  # expanding first would allocate ~200 MB of ints


def test_single_page_wording() -> None:
    with pytest.raises(InputError, match=r"a\.pdf has 1 page$"):
        parse_pages("2", 1, "a.pdf")


# --- path expansion and whole-set validation ----------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    write(tmp_path / "a.png", image_bytes(color=(1, 2, 3)))
    write(tmp_path / "b.jpg", image_bytes("JPEG", color=(4, 5, 6)))
    write(tmp_path / ".hidden.png", image_bytes())
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "c.png", image_bytes(color=(7, 8, 9)))
    return tmp_path


def test_expand_folder_flat_and_recursive(tree: Path) -> None:
    flat, errors = expand_paths([tree])
    assert [Path(p).name for p in flat] == ["a.png", "b.jpg"] and errors == []
    deep, errors = expand_paths([tree], recursive=True)
    assert [Path(p).name for p in deep] == ["a.png", "b.jpg", "c.png"] and errors == []


def test_expand_globs_duplicates_and_misses(tree: Path) -> None:
    names, errors = expand_paths([str(tree / "*.png"), str(tree / "a.png"),
                                  str(tree / "**" / "*.png"), str(tree / "*.gif")])
    assert [Path(p).name for p in names] == ["a.png", "c.png"]
    assert [(e.path, e.problem) for e in errors] == [
        (str(tree / "*.gif"), "no files match this pattern")]


def test_expand_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    _, errors = expand_paths([tmp_path / "empty"])
    assert "folder has no files" in errors[0].problem


def test_prepare_ocr_items_and_one_blob_per_distinct_file(tmp_path: Path) -> None:
    pdf = write(tmp_path / "doc.pdf", pdf_bytes(4))
    img = write(tmp_path / "page.png", image_bytes())
    same = write(tmp_path / "copy.png", image_bytes())  # same bytes, another name
    prepared = prepare([pdf, img, same], pages="2-3")
    assert [(i.kind, i.page, Path(i.source).name) for i in prepared.items] == [
        ("pdf", 2, "doc.pdf"), ("pdf", 3, "doc.pdf"),
        ("image", None, "page.png"), ("image", None, "copy.png")]
    assert len(prepared.blobs) == 2
    assert prepared.items[2].blob == prepared.items[3].blob


def test_prepare_keeps_hashes_not_bytes(tmp_path: Path) -> None:
    pdf = write(tmp_path / "doc.pdf", pdf_bytes(2))
    prepared = prepare([pdf])
    (source,) = prepared.blobs.values()
    assert isinstance(source, BlobSource)
    assert not any(isinstance(v, bytes) for v in vars(source).values())
    assert (source.path, source.size) == (pdf, pdf.stat().st_size)
    assert source.sha256 == prepared.items[0].blob == hashlib.sha256(pdf.read_bytes()).hexdigest()
    assert source.read_verified() == pdf.read_bytes()
    pdf.write_bytes(pdf_bytes(3))
    with pytest.raises(InputError, match="changed since it was validated"):
        source.read_verified()


def test_item_limit_stops_reading_files_once_passed(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(6):
        write(tmp_path / f"img{i}.png", image_bytes(color=(i, 0, 0)))
    write(tmp_path / "img9-empty.png", b"")  # after the limit: never read, never reported
    checked: list[str] = []
    real_check = files.check_file

    def counting_check(path: str | os.PathLike[str], **kw: Any) -> files.CheckedFile:
        checked.append(os.fspath(path))
        return real_check(path, **kw)

    monkeypatch.setattr(files, "check_file", counting_check)
    with pytest.raises(InputError) as info:
        prepare([tmp_path], limit=3)
    assert "the first 4 file(s) already make 4 items, over the 3-item limit" in str(info.value)
    assert [Path(p).name for p in checked] == ["img0.png", "img1.png", "img2.png", "img3.png"]


def test_prepare_collects_every_bad_file(tree: Path) -> None:
    write(tree / "empty.png", b"")
    write(tree / "text.png", b"hello")
    with pytest.raises(InputErrors) as info:
        prepare([tree])
    assert sorted((Path(e.path).name, e.problem) for e in info.value.errors) == [
        ("empty.png", "is empty"),
        ("text.png", "is neither a PDF nor an image Pillow can read: it is plain text; "
                     "captions and OCR need an image or a PDF")]
    message = str(info.value)
    assert "empty.png: is empty" in message and "text.png: is neither" in message


def test_prepare_skip_bad_keeps_good_and_reports_rejected(tree: Path) -> None:
    write(tree / "empty.png", b"")
    prepared = prepare([tree, tree / "missing.png"], skip_bad=True)
    assert sorted(Path(i.source).name for i in prepared.items) == ["a.png", "b.jpg"]
    assert sorted((Path(p).name, r) for p, r in prepared.rejected) == [
        ("empty.png", "is empty"), ("missing.png", "no such file")]


def test_prepare_skip_bad_with_nothing_good_still_fails(tmp_path: Path) -> None:
    write(tmp_path / "empty.png", b"")
    with pytest.raises(InputError, match="is empty"):
        prepare([tmp_path / "empty.png"], skip_bad=True)


def test_source_is_the_path_as_given(tmp_path: Path) -> None:
    write(tmp_path / "x.png", image_bytes())
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert prepare(["x.png"]).items[0].source == "x.png"
    finally:
        os.chdir(cwd)


def test_prepare_reports_each_file_hashed(tmp_path: Path) -> None:
    for i in range(3):
        write(tmp_path / f"img{i}.png", image_bytes(color=(i, 9, 0)))
    write(tmp_path / "bad.png", b"not an image")
    seen: list[tuple[int, int]] = []
    prepared = prepare([tmp_path], skip_bad=True, on_file=lambda d, t: seen.append((d, t)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]  # bad files count as checked too
    assert len(prepared.items) == 3 and len(prepared.rejected) == 1
