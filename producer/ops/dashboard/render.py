"""Preview images of job inputs, decoded in a child process with a size cap and a timeout.

Blobs are untrusted (any producer can enqueue a PDF): PDFium or Pillow on a hostile file
can take minutes or gigabytes. The child gets a memory limit and is killed after
RENDER_TIMEOUT_S, so the dashboard itself never hangs or grows. Results are cached in
memory because the same page is usually looked at more than once.

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

RENDER_TIMEOUT_S = 15.0
MAX_PX = 1400  # longest side of a preview
CHILD_MEMORY_BYTES = 2 << 30
MAX_IMAGE_PIXELS = 80_000_000
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
    # The file itself, not `-m`: the child then imports no vlmq package (faster start).
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
    import pypdfium2 as pdfium

    doc = pdfium.PdfDocument(data)
    try:
        if not 1 <= page <= len(doc):
            raise RenderError(f"the PDF has {len(doc)} pages, not {page}")
        pdf_page = doc[page - 1]
        width, height = pdf_page.get_size()
        if width <= 0 or height <= 0:
            raise RenderError("the page has no size")
        scale = min(max_px / max(width, height), 4.0)
        bitmap = pdf_page.render(scale=scale)
        image = bitmap.to_pil()
        out = io.BytesIO()
        image.convert("RGB").save(out, "PNG")
        return out.getvalue()
    finally:
        doc.close()


def _render_image(data: bytes, max_px: int) -> bytes:
    from PIL import Image, ImageOps, UnidentifiedImageError

    # Only this small module of vlmq's: HEIC/HEIF through pillow-heif, and the formats
    # that still cannot be read named in the reason.
    from vlmq.media import formats as image_formats

    image_formats.register_plugins()
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        what = image_formats.describe(data[:image_formats.HEAD_BYTES])
        raise RenderError(what or "it is not an image Pillow can read") from None
    with image:
        image.draft("RGB", (max_px, max_px))  # JPEG: decode at a reduced size
        image.thumbnail((max_px, max_px))
        # Upright as the model sees it (JPEG EXIF orientation; HEIF's irot is applied by
        # libheif, which leaves no EXIF orientation behind to apply twice).
        upright = ImageOps.exif_transpose(image)
        out = io.BytesIO()
        upright.convert("RGB").save(out, "PNG")
        return out.getvalue()


def _render_tiff(data: bytes, page: int, max_px: int) -> bytes:
    """One page (frame) of a TIFF; the pixel cap is checked on that page, since Pillow's
    own guard looks at the first page only."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    with Image.open(io.BytesIO(data), formats=["TIFF"]) as image:
        try:
            image.seek(page - 1)
        except EOFError:
            # Counted on a fresh open: after a seek past the end, n_frames is one too many.
            with Image.open(io.BytesIO(data), formats=["TIFF"]) as fresh:
                count = getattr(fresh, "n_frames", 1)
            raise RenderError(f"the TIFF has {count} pages, not {page}") from None
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise RenderError(f"page {page} is {width}x{height}, over the "
                              f"{MAX_IMAGE_PIXELS}-pixel preview limit")
        image.thumbnail((max_px, max_px))
        out = io.BytesIO()
        image.convert("RGB").save(out, "PNG")
        return out.getvalue()


def _child(argv: list[str]) -> int:
    import resource
    import warnings

    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    kind, page, max_px = argv[0], int(argv[1]), int(argv[2])
    data = sys.stdin.buffer.read()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a decompression-bomb warning is a refusal
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
