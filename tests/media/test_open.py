"""One media opener: the producer's check, the worker's decode (in its render
processes) and the dashboard's preview give every input the same verdict, from one set of
caps defined in one place (media/opener.py).

Each case is asked of all three: accepted everywhere, or refused everywhere with the same
verdict (the worker's message, which the preview repeats, and the producer's phrasing of
the same MediaError).
"""

from __future__ import annotations

import ast
import io
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image, TiffImagePlugin

from vlmq.media import opener
from vlmq.media.checks import check_content
from vlmq.media.formats import register_plugins
from vlmq.producer.files import check_file
from vlmq.producer.inputs import prepare
from vlmq.server.dashboard.render import RenderError, render
from vlmq.shared import constants as C
from vlmq.shared.blobs import sha256_hex
from vlmq.shared.errors import InputError
from vlmq.worker.prep import decode
from vlmq.worker.prep.render_pool import RenderPool

ROOT = Path(__file__).resolve().parents[2]
SIDE = 96


@pytest.fixture(scope="module")
def pool() -> Iterator[RenderPool]:
    rp = RenderPool(1, mem_mb=512, timeout_s=60)
    yield rp
    rp.close()


def _encoded(im: Image.Image, fmt: str, **kw: object) -> bytes:
    register_plugins()  # HEIF's writer, as the opener registers its reader
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _png_claiming(w: int, h: int) -> bytes:
    """A valid PNG header (right CRC) claiming a w x h canvas, with no pixel data."""
    ihdr = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk
            + struct.pack(">I", zlib.crc32(chunk)) + struct.pack(">I", 0) + b"IEND"
            + struct.pack(">I", zlib.crc32(b"IEND")))


def _tiff(frames: list[tuple[Image.Image, str]]) -> bytes:
    buf = io.BytesIO()
    with TiffImagePlugin.AppendingTiffWriter(buf) as tf:
        for im, compression in frames:
            im.save(tf, format="TIFF", compression=compression)
            tf.newFrame()
    return buf.getvalue()


def _gif_animation() -> bytes:
    """Three frames of one size: red, green, blue. The item is the red one."""
    frames = [Image.new("RGB", (40, 30), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return buf.getvalue()


# -- the three places, each asked for a verdict --------------------------------------------


@dataclass(frozen=True)
class Verdict:
    ok: bool
    message: str  # "" when ok
    pixel: tuple[int, ...] | None = None  # the centre pixel of what was decoded


def producer(tmp_path: Path, data: bytes) -> Verdict:
    path = tmp_path / "input.bin"
    path.write_bytes(data)
    try:
        check_file(path)
    except InputError as exc:
        return Verdict(False, exc.problem)
    return Verdict(True, "")


def worker(pool: RenderPool, data: bytes, kind: str, page: int | None) -> Verdict:
    """The worker's decode, in its render processes, as the worker asks for it."""
    key = sha256_hex(data)
    try:
        if kind == "tiff":
            assert page is not None
            im = pool.decode_tiff_page(data, page, SIDE, doc_key=key)
        else:
            im = pool.decode_image(data, SIDE, key=key)
    except decode.PreprocessError as exc:
        return Verdict(False, str(exc))
    return Verdict(True, "", _centre(im))


def dashboard(data: bytes, kind: str, page: int | None) -> Verdict:
    try:
        png = render(data, kind, page, SIDE)
    except RenderError as exc:
        reason = re.sub(r"^cannot render this \w+: \w+: ", "", str(exc))
        return Verdict(False, reason)
    with Image.open(io.BytesIO(png)) as im:
        return Verdict(True, "", _centre(im.convert("RGB")))


def _centre(im: Image.Image) -> tuple[int, ...]:
    px = im.convert("RGB").getpixel((im.width // 2, im.height // 2))
    assert isinstance(px, tuple)
    return px


def _near(a: tuple[int, ...] | None, b: tuple[int, ...]) -> bool:
    return a is not None and all(abs(x - y) <= 24 for x, y in zip(a, b, strict=True))


# -- images: one verdict ------------------------------------------------------------------

CASES = {
    # 72 Mpx: over the pixel cap (64 Mpx), under the preview's old 80 Mpx one.
    "bomb-sized PNG, 9000x8000": (_png_claiming(9000, 8000), "over the limit of 64000000"),
    # Over Pillow's own guard: it fires inside Image.open, before the cap can.
    "bomb PNG, 20000x20000": (_png_claiming(20_000, 20_000), "decompression bomb"),
    # Too far from square: the preview used to show it; the worker always refused it.
    "sliver PNG, 4000x1": (_encoded(Image.new("RGB", (4000, 1), "red"), "PNG"),
                           "an aspect ratio of 4000.0"),
    "truncated PNG": (_encoded(Image.effect_noise((300, 200), 60).convert("RGB"),
                               "PNG")[:-2000], "corrupt or truncated image"),
    "text": (b"not an image at all\n", "not an image (cannot identify image file)"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_refused_image_is_refused_alike_at_all_three(
        name: str, tmp_path: Path, pool: RenderPool) -> None:
    data, words = CASES[name]
    work = worker(pool, data, "image", None)
    preview = dashboard(data, "image", None)
    at_enqueue = producer(tmp_path, data)
    assert not work.ok and words in work.message, work
    assert not preview.ok and preview.message == work.message, (preview, work)
    assert not at_enqueue.ok, at_enqueue


def test_the_refusals_are_one_error_phrased_twice(tmp_path: Path) -> None:
    """The producer's text and the worker's come from the same MediaError."""
    data = _png_claiming(9000, 8000)
    with pytest.raises(opener.MediaError) as info:
        opener.open_image(data)
    assert info.value.problem is opener.Problem.PIXELS
    assert str(info.value) == worker_text(data)
    assert producer(tmp_path, data).message == info.value.at_enqueue
    assert "9000x8000" in info.value.at_enqueue and "decompression bomb" in info.value.at_enqueue


def worker_text(data: bytes) -> str:
    with pytest.raises(decode.PreprocessError) as info:
        decode.decode_image(data, SIDE)
    return str(info.value)


@pytest.mark.parametrize("size", [(150, 1), (8, 1500)])
def test_an_image_just_inside_the_caps_is_accepted_at_all_three(
        size: tuple[int, int], tmp_path: Path, pool: RenderPool) -> None:
    data = _encoded(Image.new("RGB", size, (10, 200, 10)), "PNG")
    assert producer(tmp_path, data).ok
    assert worker(pool, data, "image", None).ok
    assert dashboard(data, "image", None).ok


def test_an_animated_gif_is_one_item_its_first_frame_at_all_three(
        tmp_path: Path, pool: RenderPool) -> None:
    data = _gif_animation()
    with Image.open(io.BytesIO(data)) as im:
        assert getattr(im, "n_frames", 1) == 3  # really animated
    path = tmp_path / "anim.gif"
    path.write_bytes(data)
    assert [(i.kind, i.page) for i in prepare([path]).items] == [("image", None)]
    red = (255, 0, 0)
    assert _near(worker(pool, data, "image", None).pixel, red)
    assert _near(dashboard(data, "image", None).pixel, red)


def test_heic_opens_alike_at_all_three(tmp_path: Path, pool: RenderPool) -> None:
    picture = Image.effect_mandelbrot((120, 80), (-2, -1.2, 1, 1.2), 100).convert("RGB")
    data = _encoded(picture, "HEIF")
    assert check_content(data, data[:1024], "x.heic") == ("image", 1)
    work, preview = worker(pool, data, "image", None), dashboard(data, "image", None)
    assert work.ok and preview.ok and _near(preview.pixel, work.pixel or ())
    cut = data[: len(data) // 2]  # the header opens, the coded image runs off the end
    work, preview = worker(pool, cut, "image", None), dashboard(cut, "image", None)
    at_enqueue = producer(tmp_path, cut)
    assert not work.ok and "corrupt or truncated image" in work.message
    assert not preview.ok and preview.message == work.message
    assert at_enqueue.message.startswith("is a corrupt or truncated image")


def test_an_extreme_heic_is_refused_at_all_three(tmp_path: Path, pool: RenderPool) -> None:
    data = _encoded(Image.new("RGB", (2000, 8), (0, 0, 200)), "HEIF")  # 250:1
    work, preview = worker(pool, data, "image", None), dashboard(data, "image", None)
    assert not work.ok and "an aspect ratio of 250.0" in work.message
    assert not preview.ok and preview.message == work.message
    assert "an aspect ratio of 250.0" in producer(tmp_path, data).message


# -- TIFF pages: each page its own verdict, through the one page index -------------------


def _fax_with_a_bomb_page() -> bytes:
    """Page 1 grey, page 2 a 72 Mpx blank (Group 4: a few KB), page 3 a 600:1 sliver,
    page 4 near black."""
    return _tiff([(Image.new("L", (60, 80), 128), "tiff_lzw"),
                  (Image.new("1", (9000, 8000), 1), "group4"),
                  (Image.new("L", (600, 1), 128), "tiff_lzw"),
                  (Image.new("L", (60, 80), 10), "tiff_lzw")])


def test_each_tiff_page_gets_its_own_verdict_alike_at_worker_and_preview(
        pool: RenderPool) -> None:
    data = _fax_with_a_bomb_page()
    for page, words in ((2, "page 2 is 9000x8000 = 72000000 pixels, over the limit"),
                        (3, "page 3 is 600x1, an aspect ratio of 600.0")):
        work, preview = worker(pool, data, "tiff", page), dashboard(data, "tiff", page)
        assert not work.ok and work.message.startswith(words), work
        assert not preview.ok and preview.message == work.message, (preview, work)
    for page, grey in ((1, 128), (4, 10)):  # the pages beside them are fine
        work, preview = worker(pool, data, "tiff", page), dashboard(data, "tiff", page)
        assert _near(work.pixel, (grey,) * 3) and _near(preview.pixel, (grey,) * 3), page


def test_the_producer_refuses_a_tiff_for_its_first_bad_page(tmp_path: Path) -> None:
    refused = producer(tmp_path, _fax_with_a_bomb_page())
    assert refused.message.startswith("page 2: image is larger than the 64000000-pixel "
                                      "limit"), refused
    good = _tiff([(Image.new("L", (60, 80), 128), "tiff_lzw")] * 3)
    path = tmp_path / "good.tiff"
    path.write_bytes(good)
    assert (check_file(path).kind, check_file(path).pages) == ("tiff", 3)


def test_a_tiff_page_past_the_end_is_named_by_worker_and_preview(pool: RenderPool) -> None:
    data = _tiff([(Image.new("L", (60, 80), 128), "tiff_lzw")] * 2)
    assert worker(pool, data, "tiff", 3).message == ("page 3 is out of range: the TIFF "
                                                     "has 2 page(s)")
    assert dashboard(data, "tiff", 3).message == "the TIFF has 2 pages, not 3"


# -- the caps are defined once ------------------------------------------------------------


def test_the_caps_are_the_protocols_limits() -> None:
    assert opener.CAPS.max_pixels == C.MAX_IMAGE_PIXELS == 64_000_000
    assert opener.CAPS.max_aspect == C.MAX_ASPECT_RATIO == 200


def _package_sources() -> Iterator[tuple[Path, str]]:
    for folder in ("media", "producer", "worker", "cli", "stores"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, path.read_text(encoding="utf-8")


def test_only_the_opener_reads_the_caps_or_sets_pillows() -> None:
    readers = {p.relative_to(ROOT).as_posix() for p, text in _package_sources()
               if re.search(r"MAX_IMAGE_PIXELS|MAX_ASPECT_RATIO", text)}
    assert readers == {"media/opener.py"}
    setters = [p for p, text in _package_sources()
               if re.search(r"Image\.MAX_IMAGE_PIXELS\s*=", text)]
    assert setters == []  # Pillow's own guard is left as it is, everywhere


def test_no_caller_counts_frames_itself() -> None:
    """Frames are the opener's rule (an image's first; TIFF pages by the index): no code
    asks Pillow for n_frames, which for a TIFF walks its whole page chain."""
    def counts(text: str) -> bool:
        return any((isinstance(node, ast.Attribute) and node.attr == "n_frames")
                   or (isinstance(node, ast.Constant) and node.value == "n_frames")
                   for node in ast.walk(ast.parse(text)))
    assert [p.relative_to(ROOT).as_posix() for p, text in _package_sources()
            if counts(text)] == []


def test_a_cap_changed_in_the_opener_changes_producer_and_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process: the producer's check and the worker's decode read the one CAPS (the
    preview runs in a process of its own, and imports the same module)."""
    data = _encoded(Image.new("RGB", (100, 100), "white"), "PNG")
    assert producer(tmp_path, data).ok
    monkeypatch.setattr(opener, "CAPS", opener.Caps(max_pixels=9_999, max_aspect=200))
    assert "9999-pixel limit" in producer(tmp_path, data).message
    assert "over the limit of 9999" in worker_text(data)
