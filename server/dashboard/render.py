"""Preview images of job inputs, decoded in a child process with a size cap and a timeout.

Blobs are untrusted (any producer can enqueue a PDF): PDFium or Pillow on a hostile file
can take minutes or gigabytes. The child gets a memory limit and is killed after
RENDER_TIMEOUT_S, so the dashboard itself never hangs or grows. Results are cached in
memory because the same page is usually looked at more than once. Inputs open through
media/opener.py, so a preview refuses what the worker refuses (the same caps, the same
frame of an animated image, the same TIFF page index), with the worker's message.

Run as `python render.py KIND PAGE MAX_PX` with the blob on stdin;
writes a PNG to stdout, or a one-line reason to stderr and exits 2.
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

RENDER_TIMEOUT_S = 15.0
MAX_PX = 1400  # longest side of a preview
CHILD_MEMORY_BYTES = 2 << 30
CACHE_ENTRIES = 128


class RenderError(Exception):
    """The input could not be previewed; the message says why, for the page."""


class PreviewCache:
    """Rendered PNGs by (blob, page, size), least recently used dropped first."""

    def __init__(self, entries: int = CACHE_ENTRIES, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        self.entries = entries
        self.timeout_s = timeout_s
        self._png: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, sha: str, data_of: Callable[[], bytes], kind: str, page: int | None,
            max_px: int = MAX_PX) -> bytes:
        key = (sha, page or 0, max_px)
        with self._lock:
            if key in self._png:
                self._png.move_to_end(key)
                return self._png[key]
        png = render(data_of(), kind, page, max_px, timeout_s=self.timeout_s)
        with self._lock:
            self._png[key] = png
            while len(self._png) > self.entries:
                self._png.popitem(last=False)
        return png


def render(data: bytes, kind: str, page: int | None, max_px: int = MAX_PX, *,
           timeout_s: float = RENDER_TIMEOUT_S) -> bytes:
    """PNG preview of an image blob, or of one page (1-based) of a PDF or TIFF blob."""
    # The file itself, not `-m`: the child imports only vlmq.media (the one opener, and
    # the caps the worker decodes under), not the dashboard's packages (faster start).
    cmd = [sys.executable, "-I", __file__, kind, str(page or 0), str(max_px)]
    try:
        done = subprocess.run(cmd, input=data, capture_output=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        raise RenderError(f"rendering took longer than {timeout_s:g} s; gave up") from None
    if done.returncode != 0:
        reason = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise RenderError(reason[-1] if reason else f"renderer exited {done.returncode}")
    return done.stdout


def _render_pdf(data: bytes, page: int, max_px: int) -> bytes:
    from vlmq.media import opener
    from vlmq.media.pdfium import PDFIUM_LOCK

    with PDFIUM_LOCK:
        pdf = opener.open_pdf(data)
        try:
            if not 1 <= page <= len(pdf):
                raise RenderError(f"the PDF has {len(pdf)} pages, not {page}")
            # At most 4x: a tiny page is not blown up to the preview's size.
            return _png(opener.render_page(pdf, page, max_px, max_scale=4.0), max_px)
        finally:
            pdf.close()


def _render_image(data: bytes, max_px: int) -> bytes:
    """The frame the worker decodes (an animated image's first), under the same caps,
    upright as the model sees it (JPEG EXIF orientation; HEIF's irot is applied by
    libheif, which leaves no EXIF orientation behind to apply twice)."""
    from vlmq.media import opener

    with opener.open_image(data) as image:
        opener.reduce_for(image, max_px)  # JPEG: decode at a reduced size
        return _png(opener.decode(image), max_px)


def _render_tiff(data: bytes, page: int, max_px: int) -> bytes:
    """One page of a TIFF, through the page index the worker uses; the caps are checked
    on that page's own header, as the worker checks them."""
    from vlmq.media import opener

    doc = opener.open_tiff(data)
    if page > doc.pages and doc.index.problem is None:
        raise RenderError(f"the TIFF has {doc.pages} pages, not {page}")
    with opener.tiff_page(doc, page) as image:
        return _png(opener.decode(image, page=page), max_px)


def _png(image: Image.Image, max_px: int) -> bytes:
    image.thumbnail((max_px, max_px))
    out = io.BytesIO()
    image.convert("RGB").save(out, "PNG")
    return out.getvalue()


def _child(argv: list[str]) -> int:
    import resource

    from vlmq.media import opener

    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    kind, page, max_px = argv[0], int(argv[1]), int(argv[2])
    data = sys.stdin.buffer.read()
    try:
        # Pillow's warnings about a file refuse it, as at enqueue (a bomb-sized canvas).
        with opener.strict_warnings(tiff=kind == "tiff"):
            if kind == "pdf":
                png = _render_pdf(data, page, max_px)
            elif kind == "tiff":
                png = _render_tiff(data, max(page, 1), max_px)
            else:
                png = _render_image(data, max_px)
    except Exception as exc:  # noqa: BLE001 - any failure of a hostile file is one line
        print(f"cannot render this {kind}: {type(exc).__name__}: {exc}".strip(),
              file=sys.stderr)
        return 2
    sys.stdout.buffer.write(png)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
