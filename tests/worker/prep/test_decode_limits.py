"""Every kind of input decodes under one time and memory limit: images and
TIFF pages go to the render processes as PDF pages do, come back as the same pixels, and
an input past a limit fails alone, naming it, with the asking thread free at once.

Real render processes (worker/prep/render_pool.py) throughout; timings are ratios with wide
bounds, since these 2 cores are shared.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
from collections.abc import Iterator
from typing import IO

import numpy as np
import pillow_heif
import pytest
from PIL import Image

from tests.support.factories import slow_png
from tests.support.tiff_craft import many_pages, page_value
from vlmq.shared.blobs import sha256_hex
from vlmq.worker.prep import decode
from vlmq.worker.prep.render_pool import RenderPool
from vlmq.worker.stats import COUNTERS


def _encoded(im: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _noise(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def pool() -> Iterator[RenderPool]:
    rp = RenderPool(2, mem_mb=512, timeout_s=60)
    yield rp
    rp.close()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "HEIF"])
def test_images_decode_out_of_process_to_the_same_pixels(pool: RenderPool, fmt: str) -> None:
    pillow_heif.register_heif_opener()
    data = _encoded(_noise(90, 60), fmt)
    want = decode.decode_image(data, 64)
    COUNTERS.reset()
    got = pool.decode_image(data, 64, key=sha256_hex(data))
    assert (got.mode, got.size) == ("RGB", want.size)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    # Counted here, as renders are: a test proves a cache hit did no work by these.
    assert COUNTERS.snapshot()["image_decodes"] == 1


def test_an_unreadable_image_fails_with_the_in_process_message(pool: RenderPool) -> None:
    for data in (b"", b"hello, world", _encoded(_noise(30, 30), "PNG")[:60]):
        with pytest.raises(decode.PreprocessError) as here:
            decode.decode_image(data, 64)
        with pytest.raises(decode.PreprocessError) as there:
            pool.decode_image(data, 64, key=sha256_hex(data))
        assert str(there.value) == str(here.value)


def test_tiff_pages_go_once_per_document_and_come_back_as_themselves(pool: RenderPool) -> None:
    data = many_pages(50, size=(20, 20))
    fetched: list[int] = []

    def fetch() -> bytes:
        fetched.append(1)
        return data

    key = sha256_hex(data)
    pages = [pool.decode_tiff_page(fetch, n, 64, doc_key=key) for n in (50, 1, 25, 50)]
    assert [p.getpixel((0, 0))[0] for p in pages] == [page_value(n) for n in (50, 1, 25, 50)]
    assert len(fetched) <= 2  # once per render process at most, not once per page
    with pytest.raises(decode.PreprocessError, match=r"page 51 is out of range: the TIFF has 50 "):
        pool.decode_tiff_page(fetch, 51, 64, doc_key=key)


def test_a_file_goes_as_a_descriptor_and_stays_the_callers(pool: RenderPool) -> None:
    data = _encoded(_noise(70, 50), "PNG")
    with tempfile.TemporaryFile() as fh:
        fh.write(data)
        fh.seek(0)
        img = pool.decode_image(fh, 64, key=sha256_hex(data))
        assert not fh.closed  # passed in: the caller's
    assert np.array_equal(np.asarray(img), np.asarray(decode.decode_image(data, 64)))
    opened: list[IO[bytes]] = []

    def fetch() -> IO[bytes]:
        fh = tempfile.TemporaryFile()  # noqa: SIM115 - closed by the pool, checked below
        fh.write(data)
        fh.seek(0)
        opened.append(fh)
        return fh

    pool.decode_image(fetch, 64, key=sha256_hex(data))
    assert opened[0].closed  # fetched for the request: closed once the child had its own


def test_an_image_past_the_time_limit_fails_alone_and_frees_the_caller() -> None:
    rp = RenderPool(1, mem_mb=1024, timeout_s=0.3)
    try:
        small = _encoded(_noise(40, 40), "PNG")
        rp.decode_image(small, 64, key="small")
        [child] = rp.pids
        # The caller is freed by the limit, not by the decode ending: the error names the
        # limit, and the child still decoding is killed (a decode that ended leaves it be).
        with pytest.raises(decode.PreprocessError, match=r"^image too complex to decode: over the "
                           r"0\.3 s decode time limit "
                                                    r"\(--render-timeout\)$"):
            rp.decode_image(slow_png(), 1288, key="slow")
        assert rp.pids == []  # the stuck child was killed
        assert _gone(child)
        assert rp.decode_image(small, 64, key="small").size == (40, 40)  # a fresh child
    finally:
        rp.close()


def test_a_tiff_page_past_the_time_limit_names_its_page() -> None:
    rp = RenderPool(1, mem_mb=1024, timeout_s=0.3)
    try:
        a = (np.add.outer(np.arange(8000), np.arange(8000)) % 251).astype(np.uint8)
        data = _encoded(Image.fromarray(a), "TIFF", compression="tiff_lzw")
        with pytest.raises(decode.PreprocessError,
                           match=r"^TIFF page 1 too complex to decode: over "
                           r"the 0\.3 s decode time limit"):
            rp.decode_tiff_page(data, 1, 1288, doc_key=sha256_hex(data))
    finally:
        rp.close()


def test_an_image_past_the_memory_limit_fails_alone() -> None:
    rp = RenderPool(1, mem_mb=128, timeout_s=120)
    try:
        with pytest.raises(decode.PreprocessError, match=r"^image too complex to decode: .*the "
                           r"128 MB decode memory limit "
                                                    r"\(--render-mem-mb\)"):
            rp.decode_image(slow_png(), 1288, key="big")
        assert rp.decode_image(_encoded(_noise(30, 30), "PNG"), 64, key="ok").size == (30, 30)
    finally:
        rp.close()


def test_a_pdf_page_names_the_limit_option_too() -> None:
    from tests.support.pdf_craft import drawing_bomb_pdf

    rp = RenderPool(1, mem_mb=4096, timeout_s=0.3)
    try:
        bomb = drawing_bomb_pdf(2_000_000)
        with pytest.raises(decode.PreprocessError, match=r"^page 1 too complex to render: over the "
                           r"0\.3 s render time limit "
                                                    r"\(--render-timeout\)$"):
            rp.render(bomb, 1, 1288, doc_key=sha256_hex(bomb))
    finally:
        rp.close()


def test_the_time_limit_starts_once_the_input_is_fetched() -> None:
    """A slow fetch (Redis, S3) is not the input's decode: it is not charged to the limit."""
    rp = RenderPool(1, mem_mb=512, timeout_s=0.5)
    try:
        rp.warm()
        data = _encoded(_noise(40, 40), "PNG")

        def slow_fetch() -> bytes:
            time.sleep(1.0)
            return data

        assert rp.decode_image(slow_fetch, 64, key="late").size == (40, 40)
    finally:
        rp.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc")
def test_children_get_their_descriptors_and_nothing_else() -> None:
    """A child holds the socket it was given and its pipes; what it was sent it closes."""
    rp = RenderPool(1, mem_mb=512, timeout_s=60)
    try:
        data = _encoded(_noise(40, 40), "PNG")
        for _ in range(5):
            with tempfile.TemporaryFile() as fh:
                fh.write(data)
                fh.seek(0)
                rp.decode_image(fh, 64, key="fd")
        [pid] = rp.pids
        fds = os.listdir(f"/proc/{pid}/fd")
        assert len(fds) <= 8, fds  # 0, 1, 2, the socket; not one per request
    finally:
        rp.close()
