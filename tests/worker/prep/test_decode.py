"""Preprocessing: image decode/convert/resize, bomb guard, PDF render under the lock, counters."""

from __future__ import annotations

import io
import struct
import threading
import warnings
import zlib
from collections.abc import Iterator

import numpy as np
import pypdfium2 as pdfium
import pytest
from PIL import Image, ImageDraw
from redis import Redis

from vlmq.shared import constants as C
from vlmq.shared.blobs import BlobStore
from vlmq.shared.errors import BlobError, VlmqError
from vlmq.shared.keys import Keys
from vlmq.worker.prep import decode
from vlmq.worker.prep.decode import (
    PreprocessError,
    clear_pdf_cache,
    decode_image,
    fetch_blob,
    render_pdf_page,
)
from vlmq.worker.stats import COUNTERS


@pytest.fixture(autouse=True)
def _no_open_docs() -> Iterator[None]:
    yield
    clear_pdf_cache()


def encode(im: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def header_only_png(w: int, h: int) -> bytes:
    """A PNG of a few dozen bytes whose header claims w x h 1-bit pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


# -- images ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP", "TIFF", "GIF"])
def test_decode_formats(fmt: str) -> None:
    im = decode_image(encode(noise(64, 48), fmt), None)
    assert im.mode == "RGB" and im.size == (64, 48)


def test_decode_png_is_lossless() -> None:
    src = noise(40, 30)
    assert np.array_equal(np.asarray(decode_image(encode(src, "PNG"), None)), np.asarray(src))


def test_rgba_transparency_goes_over_white() -> None:
    src = Image.new("RGBA", (20, 10), (0, 0, 0, 0))
    src.paste((255, 0, 0, 255), (0, 0, 10, 10))
    out = np.asarray(decode_image(encode(src, "PNG"), None))
    assert out.shape == (10, 20, 3)
    assert (out[:, :10] == [255, 0, 0]).all() and (out[:, 10:] == 255).all()


def test_palette_with_and_without_transparency() -> None:
    pal = Image.new("P", (8, 8), 1)
    pal.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)
    out = decode_image(encode(pal, "PNG"), None)
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (0, 0, 255)
    pal.info["transparency"] = 1
    out = decode_image(encode(pal, "PNG", transparency=1), None)
    assert out.getpixel((0, 0)) == (255, 255, 255)


def test_gray_cmyk_and_16bit() -> None:
    assert decode_image(encode(Image.new("L", (4, 4), 77), "PNG"), None).getpixel(
        (0, 0)) == (77, 77, 77)
    assert decode_image(encode(Image.new("1", (4, 4), 1), "PNG"), None).getpixel(
        (0, 0)) == (255, 255, 255)
    cmyk = decode_image(encode(Image.new("CMYK", (8, 8), (0, 0, 0, 0)), "JPEG"), None)
    assert cmyk.mode == "RGB" and min(cmyk.getpixel((0, 0))) > 240
    wide = Image.fromarray(np.array([[0, 32896, 65535]], dtype=np.uint16))
    data = encode(wide, "PNG")
    assert Image.open(io.BytesIO(data)).mode.startswith("I")  # really a 16-bit file
    out = decode_image(data, None)
    assert [out.getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]


def test_exif_orientation_applied() -> None:
    src = Image.new("RGB", (40, 20), (255, 255, 255))
    src.paste((255, 0, 0), (0, 0, 10, 20))  # red strip on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated; viewers turn it 90 degrees clockwise
    out = decode_image(encode(src, "JPEG", exif=exif.tobytes(), quality=95), None)
    assert out.size == (20, 40)
    r, g, b = out.getpixel((10, 2))  # the left strip is now at the top
    assert r > 200 and g < 60 and b < 60


@pytest.mark.parametrize(("size", "max_side", "want"), [
    ((1000, 500), 200, (200, 100)),
    ((500, 1000), 200, (100, 200)),
    ((333, 333), 100, (100, 100)),
    ((50, 30), 200, (50, 30)),      # never upscaled
    ((200, 100), 200, (200, 100)),
    ((50, 30), None, (50, 30)),
    ((3000, 16), 100, (100, 1)),     # a side never shrinks to zero
])
def test_resize_bound(size: tuple[int, int], max_side: int | None,
                      want: tuple[int, int]) -> None:
    assert decode_image(encode(noise(*size), "PNG"), max_side).size == want


def test_large_jpeg_uses_draft_and_still_hits_the_bound() -> None:
    src = Image.new("RGB", (2000, 1000), (10, 200, 30))
    out = decode_image(encode(src, "JPEG"), 300)
    assert out.size == (300, 150)
    r, g, b = out.getpixel((150, 75))
    assert abs(r - 10) < 8 and abs(g - 200) < 8 and abs(b - 30) < 8


def test_non_image_rejected() -> None:
    with pytest.raises(PreprocessError, match=r"not an image \(cannot identify image file\)"):
        decode_image(b"%PDF-1.4 this is not an image", 100)
    assert issubclass(PreprocessError, VlmqError)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image_rejected(fmt: str) -> None:
    data = encode(noise(200, 200), fmt)
    with pytest.raises(PreprocessError, match="truncated"):
        decode_image(data[: len(data) // 2], 100)


@pytest.mark.parametrize("side", [20_000, 10_000, 8_500])
@pytest.mark.parametrize("warning_filter", ["error", "ignore"])
def test_decompression_bomb_rejected_from_header(side: int, warning_filter: str) -> None:
    # 20000^2 trips Pillow's hard limit, 10000^2 its warning, 8500^2 only ours (64 Mpx).
    data = header_only_png(side, side)
    assert len(data) < 100 and side * side > C.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter(warning_filter, Image.DecompressionBombWarning)
        with pytest.raises(PreprocessError, match="decompression bomb"):
            decode_image(data, 1000)


def test_decode_counter() -> None:
    before = COUNTERS.snapshot()
    decode_image(encode(noise(8, 8), "PNG"), None)
    with pytest.raises(PreprocessError):
        decode_image(b"nope", None)
    after = COUNTERS.snapshot()
    assert after["image_decodes"] - before["image_decodes"] == 2
    assert after["pdf_renders"] == before["pdf_renders"]


# -- PDFs --------------------------------------------------------------------------------

PAGE_SIZES = [(600, 800), (800, 500), (300, 300)]
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]


def make_pdf() -> bytes:
    """Three pages of different sizes, each with its own coloured block and label."""
    pages = []
    for i, (size, colour) in enumerate(zip(PAGE_SIZES, COLOURS, strict=True)):
        im = Image.new("RGB", size, "white")
        draw = ImageDraw.Draw(im)
        draw.rectangle((20, 20, 120 + 40 * i, 120), fill=colour)
        draw.text((30, 150), f"page {i + 1}", fill="black")
        pages.append(im)
    return encode(pages[0], "PDF", save_all=True, append_images=pages[1:], resolution=72)


@pytest.fixture(scope="module")
def pdf_bytes() -> bytes:
    return make_pdf()


@pytest.mark.parametrize("max_side", [300, 257, 1024])
def test_pdf_pages_render_distinct_at_max_side(pdf_bytes: bytes, max_side: int) -> None:
    images = [render_pdf_page(pdf_bytes, p, max_side) for p in (1, 2, 3)]
    for im, (w, h) in zip(images, PAGE_SIZES, strict=True):
        assert im.mode == "RGB"
        assert max(im.size) == max_side
        assert abs(im.size[0] / im.size[1] - w / h) < 0.01  # aspect kept
    arrays = [np.asarray(im.resize((64, 64))) for im in images]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not np.array_equal(arrays[i], arrays[j])
    # Page 1's block is red: its colour came through.
    r, g, b = images[0].getpixel((int(70 * max_side / 800), int(70 * max_side / 800)))
    assert r > 150 and g < 80 and b < 80


def test_pdf_page_rotation_is_honoured(pdf_bytes: bytes) -> None:
    with decode.PDFIUM_LOCK:  # tests touch PDFium too, so they share the lock
        pdf = pdfium.PdfDocument(pdf_bytes)
        page = pdf[0]
        page.set_rotation(90)
        page.close()
        buf = io.BytesIO()
        pdf.save(buf)
        pdf.close()
    im = render_pdf_page(buf.getvalue(), 1, 400)
    assert im.size == (400, 300)  # 600x800 portrait turned landscape


@pytest.mark.parametrize("page", [0, -1, 4, 99])
def test_pdf_page_out_of_range(pdf_bytes: bytes, page: int) -> None:
    with pytest.raises(PreprocessError, match=f"page {page} is out of range") as info:
        render_pdf_page(pdf_bytes, page, 100)
    if page > 0:
        assert "the PDF has 3 page(s)" in str(info.value)


@pytest.mark.parametrize("data", [b"%PDF-1.4 garbage", b"", b"\x89PNG\r\n\x1a\n"])
def test_corrupt_pdf_rejected(data: bytes) -> None:
    with pytest.raises(PreprocessError, match="not a readable PDF"):
        render_pdf_page(data, 1, 100)


def test_pdf_counters_and_document_reuse(pdf_bytes: bytes) -> None:
    before = COUNTERS.snapshot()
    for p in (1, 2, 3):
        render_pdf_page(pdf_bytes, p, 64, doc_key="a" * 64)
    mid = COUNTERS.snapshot()
    assert mid["pdf_renders"] - before["pdf_renders"] == 3
    assert mid["pdf_opens"] - before["pdf_opens"] == 1  # one open for three pages
    assert mid["image_decodes"] == before["image_decodes"]
    # Beyond PDF_DOC_CACHE_SIZE other documents, the first one is closed and reopened.
    for k in range(decode.PDF_DOC_CACHE_SIZE):
        render_pdf_page(pdf_bytes, 1, 64, doc_key=f"{k:064x}")
    render_pdf_page(pdf_bytes, 1, 64, doc_key="a" * 64)
    after = COUNTERS.snapshot()
    assert after["pdf_opens"] - mid["pdf_opens"] == decode.PDF_DOC_CACHE_SIZE + 1
    render_pdf_page(pdf_bytes, 2, 64)  # without a key: opened and closed each time
    assert COUNTERS.snapshot()["pdf_opens"] - after["pdf_opens"] == 1


def test_concurrent_rendering_from_four_threads(pdf_bytes: bytes) -> None:
    expected = {p: np.asarray(render_pdf_page(pdf_bytes, p, 200)) for p in (1, 2, 3)}
    barrier = threading.Barrier(4)
    failures: list[str] = []

    def work(t: int) -> None:
        barrier.wait()
        for n in range(6):
            p = (t + n) % 3 + 1
            key = "b" * 64 if t % 2 else None  # mix cached and one-off documents
            try:
                got = np.asarray(render_pdf_page(pdf_bytes, p, 200, doc_key=key))
                img = decode_image(encode(noise(32, 32, t), "PNG"), 16)  # runs alongside
            except VlmqError as exc:
                failures.append(f"thread {t}: {exc}")
                continue
            if not np.array_equal(got, expected[p]) or img.size != (16, 16):
                failures.append(f"thread {t} page {p}: wrong pixels")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert failures == []


# -- blobs -------------------------------------------------------------------------------


def test_fetch_blob(redis: Redis, keys: Keys) -> None:
    store = BlobStore(redis, keys)
    sha, _ = store.put(b"page bytes")
    assert fetch_blob(store, sha) == b"page bytes"
    with pytest.raises(BlobError, match="missing"):
        fetch_blob(store, "0" * 64)
    with pytest.raises(BlobError, match="malformed"):
        fetch_blob(store, "not-a-sha")
