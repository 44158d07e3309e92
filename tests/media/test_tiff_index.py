"""Any TIFF page costs what page 1 does: the page chain is walked once
(media/tiff.py), kept with the document, and a page opens as a one-page view of the same
bytes; the producer's check and the worker's decode share the walk and its guards.

Files are written directory by directory (tests/support/tiff_craft.py): Pillow's own writer takes
minutes for 20,000 pages. Costs are counted (page directories read), not timed:
benchmarks/input_costs.py gives the times.
"""

from __future__ import annotations

import io
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.support.tiff_craft import (
    GROUP4,
    LZW,
    encoded_strip,
    fax_bytes,
    many_pages,
    page_value,
)
from vlmq.media import tiff
from vlmq.producer.files import check_file, check_stored
from vlmq.shared import constants as C
from vlmq.shared.errors import InputError
from vlmq.stores.backends import FolderStore
from vlmq.worker.prep import decode
from vlmq.worker.prep.render_pool import RenderPool

VARIANTS = [pytest.param({}, id="classic-II"), pytest.param({"endian": ">"}, id="classic-MM"),
            pytest.param({"bigtiff": True}, id="bigtiff-II")]


def _pillow_pages(data: bytes) -> list[int]:
    """Each page's first pixel, as Pillow's own frame walk reads them."""
    with Image.open(io.BytesIO(data)) as im:
        out = []
        for i in range(im.n_frames):
            im.seek(i)
            out.append(int(im.getpixel((0, 0))))
        return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_walk_finds_every_page_pillow_finds(variant: dict[str, object]) -> None:
    data = many_pages(7, **variant)  # type: ignore[arg-type]
    index = tiff.walk(data)
    assert index.problem is None
    assert index.pages == 7 == len(_pillow_pages(data))
    assert index.layout.big is bool(variant.get("bigtiff"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_page_decodes_as_itself(variant: dict[str, object]) -> None:
    data = many_pages(7, **variant)  # type: ignore[arg-type]
    got = [int(decode.decode_tiff_page(data, n, None).getpixel((0, 0))[0]) for n in range(1, 8)]
    assert got == [page_value(n) for n in range(1, 8)] == _pillow_pages(data)


def test_pillows_own_bigtiff_and_the_mixed_fax_decode_as_pillow_reads_them(
        tmp_path: Path) -> None:
    """Files another writer made: the five-page fax (Group 4 and LZW, through libtiff) and
    a BigTIFF from Pillow, page by page pixel-equal to Pillow's frame walk."""
    frames = [Image.new("L", (40, 30), v) for v in (10, 200, 90)]
    frames[0].save(tmp_path / "big.tif", save_all=True, append_images=frames[1:],
                   big_tiff=True, compression="tiff_lzw")
    for data in (fax_bytes(), (tmp_path / "big.tif").read_bytes()):
        with Image.open(io.BytesIO(data)) as im:
            want = []
            for i in range(im.n_frames):
                im.seek(i)
                want.append(np.asarray(im.convert("RGB")))
        got = [np.asarray(decode.decode_tiff_page(data, n, None)) for n in range(1, len(want) + 1)]
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_page_view_leaves_the_document_as_it_was() -> None:
    data = many_pages(3)
    doc = tiff.Document(data)
    with doc.page(2) as fp:
        head = fp.read(8)
        assert struct.unpack("<I", head[4:])[0] == doc.index.offsets[1]
    ptr = doc.index.offsets[0] + 2 + 12 * 9  # page 1's next-page offset (9 entries)
    with doc.page(1) as fp:  # page 2's patches undone, page 1's own in place
        assert fp.read() == data[:ptr] + bytes(4) + data[ptr + 4:]
    with pytest.raises(ValueError, match="closed"):
        fp.read(1)  # a view outlives its block only as a closed file


def _looped(pages: int, back_to: int) -> bytes:
    """`pages` pages whose last page's next-page offset points back at page `back_to`."""
    data = bytearray(many_pages(pages))
    index = tiff.walk(bytes(data))
    last = index.offsets[-1]
    (entries,) = struct.unpack_from("<H", data, last)
    struct.pack_into("<I", data, last + 2 + 12 * entries, index.offsets[back_to - 1])
    return bytes(data)


def test_a_looping_chain_is_refused_at_enqueue_and_ends_the_document_in_the_worker(
        tmp_path: Path) -> None:
    data = _looped(4, back_to=2)
    index = tiff.walk(data)
    assert index.pages == 4
    assert index.problem is not None and index.problem.page == 4
    assert "loops back to page 2" in str(index.problem)
    path = tmp_path / "loop.tif"
    path.write_bytes(data)
    with pytest.raises(InputError, match=r"page 4: is a corrupt or truncated TIFF page \(its "
                                         r"next-page offset loops back to page 2"):
        check_file(path)
    # Pages before the loop are fine; a page past it names the break.
    assert decode.decode_tiff_page(data, 4, None).getpixel((0, 0))[0] == page_value(4)
    with pytest.raises(decode.PreprocessError, match=r"page 5 cannot be reached: the TIFF's page "
                       r"chain stops after page 4 \(page 4: its "
                                                r"next-page offset loops back to page 2"):
        decode.decode_tiff_page(data, 5, None)


def test_the_page_count_is_bounded() -> None:
    index = tiff.walk(many_pages(30), max_pages=25)
    assert index.pages == 25
    assert str(index.problem) == "has more than 25 pages"
    assert tiff.Document.__init__.__kwdefaults__ == {"max_pages": C.MAX_TIFF_PAGES}


@pytest.mark.parametrize(("data", "problem"), [
    (b"II*\x00", "is 4 bytes, too short for a TIFF header"),
    (b"II+\x00\x08\x00", "too short for a BigTIFF header"),
    (b"II+\x00\x04\x00\x00\x00" + bytes(8), "a BigTIFF with 4-byte offsets"),
    (b"IIRO\x08\x00\x00\x00", "is not a TIFF"),
    (b"II*\x00\x00\x00\x00\x00", "has no pages"),
    (b"II*\x00\xff\xff\x00\x00" + bytes(8), "page 1: its directory offset 65535 lies outside"),
    (b"II*\x00\x08\x00\x00\x00\xff\x00" + bytes(20), "page 1: its directory (255 entries"),
])
def test_bad_headers_and_first_directories_say_what_is_wrong(data: bytes, problem: str) -> None:
    with pytest.raises(tiff.TiffError) as info:
        tiff.walk(data)
    assert problem in str(info.value)
    with pytest.raises(decode.PreprocessError, match="not a readable TIFF: the file "):
        decode.decode_tiff_page(data, 1, None)


def test_a_chain_cut_at_page_three_serves_pages_one_and_two() -> None:
    data = many_pages(5)
    cut = data[:tiff.walk(data).offsets[2] + 10]  # inside page 3's directory
    assert decode.decode_tiff_page(cut, 2, None).getpixel((0, 0))[0] == page_value(2)
    with pytest.raises(decode.PreprocessError, match=r"page 3 cannot be reached: .*\(page 3: its "
                       r"directory \(9 entries at byte \d+\) runs "
                                                r"past the end of the file"):
        decode.decode_tiff_page(cut, 3, None)


# -- cost: page N against page 1 ---------------------------------------------------------

DEEP = 20_000


@pytest.fixture(scope="module")
def deep() -> bytes:
    """20,000 raw pages and a last LZW page (libtiff's path), built in well under a second."""
    return many_pages(DEEP, strips=[(encoded_strip(Image.new("L", (8, 8), 99), "tiff_lzw"),
                                     LZW)])


@pytest.fixture
def directory_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The page number of every page directory media/tiff.py reads: what a page costs, as
    a count rather than a clock. The walk reads each directory once; a page open, one."""
    reads: list[int] = []
    real = tiff._directory

    def counting(buf: tiff.Readable, lay: tiff.Layout, at: int, page: int) -> tuple[int, int]:
        reads.append(page)
        return real(buf, lay, at, page)

    monkeypatch.setattr(tiff, "_directory", counting)
    return reads


def test_the_last_page_costs_what_the_first_does_in_the_worker(
        deep: bytes, directory_reads: list[int]) -> None:
    """From a fresh document, page 20,000 and page 1 each cost the one walk plus one
    directory; from the kept one, one directory each (before: page 20,000 re-read every
    directory before it, 2.5 s against 0.1 ms)."""
    fresh = []
    for page in (1, DEEP):
        directory_reads.clear()
        decode.decode_tiff_page(deep, page, 64)
        fresh.append(len(directory_reads))
    assert fresh == [DEEP + 1, DEEP + 1]
    decode.decode_tiff_page(lambda: deep, 1, 64, doc_key="deep")
    for page, value in ((1, page_value(1)), (DEEP, 99)):
        directory_reads.clear()
        im = decode.decode_tiff_page(lambda: deep, page, 64, doc_key="deep")
        assert directory_reads == [page] and im.getpixel((0, 0))[0] == value


def test_the_last_page_is_read_from_the_kept_document_in_a_render_process(
        deep: bytes) -> None:
    """The render process keeps the document it indexed: the bytes are fetched and sent
    once for every page that follows, and page 20,000 decodes as it does in process."""
    fetches: list[int] = []

    def fetch() -> bytes:
        fetches.append(1)
        return deep

    pool = RenderPool(1, timeout_s=60)
    try:
        first = pool.decode_tiff_page(fetch, 1, 64, doc_key="deep")  # sent and indexed once
        last = pool.decode_tiff_page(fetch, DEEP, 64, doc_key="deep")
        again = pool.decode_tiff_page(fetch, 1, 64, doc_key="deep")
    finally:
        pool.close()
    assert np.array_equal(np.asarray(first), np.asarray(decode.decode_tiff_page(deep, 1, 64)))
    assert np.array_equal(np.asarray(last), np.asarray(decode.decode_tiff_page(deep, DEEP, 64)))
    assert np.array_equal(np.asarray(again), np.asarray(first))
    assert len(fetches) == 1


def test_a_page_view_of_the_last_page_is_a_one_page_tiff(
        deep: bytes, directory_reads: list[int]) -> None:
    """What the producer's check does for each page: open the view, decode the page.
    Pillow sees one page whichever is asked, and the view reads one directory."""
    doc = tiff.Document(deep)
    for page, value in ((1, page_value(1)), (DEEP, 99)):
        directory_reads.clear()
        with doc.page(page) as fp, Image.open(fp, formats=["TIFF"]) as im:
            im.load()
            assert getattr(im, "n_frames", 1) == 1
            assert im.getpixel((0, 0)) == value
        assert directory_reads == [page]


def test_the_producer_checks_each_page_once(tmp_path: Path, deep: bytes,
                                            directory_reads: list[int]) -> None:
    """The whole check of 20,000 pages: one walk and one open of each page, each page's
    directory read twice in all (each page is still decoded, as a truncated strip
    anywhere must be found)."""
    big = tmp_path / "big.tif"
    big.write_bytes(deep)
    checked = check_file(big)
    assert checked.pages == DEEP
    assert len(directory_reads) == 2 * DEEP
    assert set(Counter(directory_reads).values()) == {2}


def test_a_stored_tiff_is_checked_from_a_copy_of_its_own(tmp_path: Path) -> None:
    """The checker maps the TIFF it walks; a store's file is copied first, so someone
    cutting it meanwhile cannot fault the producer."""
    (tmp_path / "a.tif").write_bytes(many_pages(3))
    checked = check_stored(FolderStore("scans", tmp_path), "a.tif", "a.tif")
    assert (checked.kind, checked.pages) == ("tiff", 3)


@pytest.fixture
def _no_kept_tiffs() -> Iterator[None]:
    yield
    with decode._TIFFS_LOCK:
        decode._TIFFS.clear()


def test_a_group4_page_at_the_end_of_a_deep_file(_no_kept_tiffs: None) -> None:
    strip = encoded_strip(Image.new("1", (16, 16), 0), "group4")
    data = many_pages(1000, size=(16, 16), strips=[(strip, GROUP4)], bits=1)
    page = decode.decode_tiff_page(lambda: data, 1000, None, doc_key="g4")
    assert page.getpixel((0, 0)) == (0, 0, 0)
    assert decode.decode_tiff_page(lambda: data, 999, None, doc_key="g4").getpixel((0, 0))[0] \
        == page_value(999)
