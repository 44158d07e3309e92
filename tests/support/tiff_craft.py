"""TIFFs written directory by directory, for tests and benchmarks that need thousands of pages.

Pillow's writer appends a frame by walking every frame before it, so a 20,000-page file
takes it minutes; here one is a list of packed structs (a fraction of a second). Pages are
8-bit grey, one strip each, raw or with a strip another encoder made (LZW, Group 4).
"""

from __future__ import annotations

import io
import struct
import time
from collections.abc import Callable, Sequence

from PIL import Image, ImageDraw, TiffImagePlugin

from tests.support.helpers import page_image

RAW, LZW, GROUP4 = 1, 5, 4


def best_time(fn: Callable[[], object], repeat: int = 5) -> float:
    """The fastest of `repeat` runs of `fn`, in seconds: what page N costs, less the noise
    of a shared machine (the TIFF tests and benchmarks/input_costs.py compare pages by it)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
_SHORT, _LONG, _LONG8 = 3, 4, 16


def encoded_strip(im: Image.Image, compression: str) -> bytes:
    """`im`'s pixel data as Pillow's TIFF encoder writes it with `compression`, one strip."""
    buf = io.BytesIO()
    im.save(buf, "TIFF", compression=compression, strip_size=1 << 30)
    data = buf.getvalue()
    with Image.open(io.BytesIO(data)) as tif:
        offsets, counts = tif.tag_v2[273], tif.tag_v2[279]
    return b"".join(data[o:o + c] for o, c in zip(offsets, counts, strict=True))


def page_value(page: int) -> int:
    """The grey level of 1-based `page` in many_pages (so a test can tell pages apart)."""
    return (page * 37) % 256


def many_pages(pages: int, *, size: tuple[int, int] = (8, 8), endian: str = "<",
               bigtiff: bool = False, strips: Sequence[tuple[bytes, int]] = (),
               bits: int = 8) -> bytes:
    """A TIFF of `pages` grey pages of `size`: page n is filled with page_value(n), raw.

    `strips` replaces the last pages' data with (encoded strip, compression) pairs, so a
    file can end in real LZW or Group 4 pages (`bits` 1 for Group 4) without encoding every
    page. `bigtiff` writes 8-byte offsets; `endian` is "<" (II) or ">" (MM).
    """
    w, h = size
    head = (b"II" if endian == "<" else b"MM")
    out = bytearray(head + struct.pack(endian + ("HHHQ" if bigtiff else "HI"),
                                       *((43, 8, 0, 0) if bigtiff else (42, 0))))
    first_at = 8 if bigtiff else 4
    entry = endian + ("HHQQ" if bigtiff else "HHII")
    special = {pages - len(strips) + i + 1: s for i, s in enumerate(strips)}
    prev_ptr = first_at
    for page in range(1, pages + 1):
        data, compression = special.get(page, (bytes([page_value(page)]) * (w * h), RAW))
        page_bits = bits if page in special else 8
        tags = [(256, _SHORT, w), (257, _SHORT, h), (258, _SHORT, page_bits),
                (259, _SHORT, compression), (262, _SHORT, 1),  # black is zero
                (273, _LONG, 0), (277, _SHORT, 1), (278, _SHORT, h),
                (279, _LONG, len(data))]
        at = len(out)
        struct.pack_into(endian + ("Q" if bigtiff else "I"), out, prev_ptr, at)
        ifd_len = (8 + 20 * len(tags) + 8) if bigtiff else (2 + 12 * len(tags) + 4)
        strip_at = at + ifd_len
        out += struct.pack(endian + ("Q" if bigtiff else "H"), len(tags))
        for tag, typ, value in tags:
            value = strip_at if tag == 273 else value
            # A SHORT is left-justified in the value field, whatever the byte order.
            if typ == _SHORT:
                field = struct.pack(endian + "H", value).ljust(8 if bigtiff else 4, b"\0")
                out += struct.pack(endian + "HH", tag, typ) + struct.pack(
                    endian + ("Q" if bigtiff else "I"), 1) + field
            else:
                out += struct.pack(entry, tag, _LONG8 if bigtiff else typ, 1, value)
        prev_ptr = len(out)
        out += bytes(8 if bigtiff else 4)  # next-page offset, filled by the next page
        out += data
    return bytes(out)


# -- a small fax: five pages of mixed modes and compressions, Pillow's own writer --------

# (mode, compression) of each page: Group 4 needs 1-bit pixels; LZW takes the rest.
PAGES = [("1", "group4"), ("L", "tiff_lzw"), ("RGB", "tiff_lzw"), ("1", "group4"),
         ("L", "tiff_lzw")]


def fax_page(i: int, mode: str, size: tuple[int, int] = (200, 260)) -> Image.Image:
    """A page unlike its neighbours (so each page's features differ), in `mode`."""
    im = page_image(i, size)
    ImageDraw.Draw(im).text((20, size[1] - 30), f"PAGE {i + 1}", fill=(0, 0, 0))
    return im.convert(mode)


def tiff_bytes(frames: list[tuple[Image.Image, str | None]]) -> bytes:
    """A multi-page TIFF, each frame written with its own compression (None: raw)."""
    buf = io.BytesIO()
    with TiffImagePlugin.AppendingTiffWriter(buf) as tf:
        for im, compression in frames:
            if compression is None:
                im.save(tf, format="TIFF")
            else:
                im.save(tf, format="TIFF", compression=compression)
            tf.newFrame()
    return buf.getvalue()


def fax_bytes() -> bytes:
    return tiff_bytes([(fax_page(i, mode), comp) for i, (mode, comp) in enumerate(PAGES)])
