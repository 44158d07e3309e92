"""One way to open every input kind, with one set of caps, for producer, worker and dashboard.

Why: the producer's checks, the worker's decode and the dashboard's preview each opened
images their own way: their own pixel cap (the preview's was 80 Mpx, the others' 64 Mpx),
their own aspect rule (the preview had none), their own frame handling (the preview
walked a TIFF's frames with Pillow's seek and n_frames, the others used media/tiff.py's
index) and their own error texts. An input could then be accepted at enqueue and refused
by the worker, or previewed as something the model never sees. Here, once:

- CAPS: the pixel limit (decompression-bomb guard) and the aspect limit, checked on the
  header of the frame that becomes the item, before any pixel is decoded. Pillow's own
  bomb guard (about 89 Mpx) fires inside Image.open, before ours can; it is a refusal too.
- Frames: an image file is one item, the frame Pillow opens at (an animated GIF, APNG or
  WebP, an MPO or a HEIF sequence: its first, for HEIF its primary image), and nothing
  asks Pillow for `n_frames` (for a TIFF that walks the whole page chain). A TIFF's pages
  are items, each opened directly through media/tiff.py's index.
- Errors: MediaError, one per problem (`Problem`). Its str() is the decode's message (the
  worker's item error, the preview's reason); `at_enqueue` is the same verdict phrased
  to follow a file's name in the producer's refusal ("scan.tiff: page 3: ..."). Both
  phrasings live in the one table below, which keeps the texts users and tests know.

Nothing here changes warning filters or Pillow's globals, so it is safe on any thread;
`strict_warnings()` is for a caller that is alone in its process or thread (the
producer's check), to make Pillow's warnings about a file refusals.
"""

from __future__ import annotations

import enum
import io
import math
import os
import struct
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Final

from vlmq.media import formats
from vlmq.media.pdfium import open_problem
from vlmq.media.tiff import Document, Index, TiffError
from vlmq.shared import constants as C
from vlmq.shared.errors import VlmqError

# Pillow and PDFium are imported where a file is opened: a producer's listing or help
# never opens one, and the two cost a fifth of a second at start.
if TYPE_CHECKING:
    import pypdfium2 as pdfium
    from PIL import Image


@dataclass(frozen=True)
class Caps:
    """What an image (or TIFF page) may be, from its header: the one definition."""

    max_pixels: int  # width x height over this is refused (decompression-bomb guard)
    max_aspect: float  # longest over shortest side at or over this is refused: Qwen-style
    # vision processors (smart_resize) refuse it, after resizing, with a misleading figure


CAPS: Final = Caps(max_pixels=C.MAX_IMAGE_PIXELS, max_aspect=C.MAX_ASPECT_RATIO)

# What Pillow raises for a corrupt or truncated file, depending on the codec (libheif's
# messages end in a newline; a TIFF directory can fail as a TypeError or struct.error).
# UserWarning: Pillow only warns about some truncations; strict_warnings() raises them.
# RuntimeError: pillow-heif's for whatever libheif refuses while decoding, e.g. a coded
# image larger than its `ispe` box declares; uncaught it ended a whole
# enqueue, a scheduler, or the worker's item batch rather than refusing the one file.
DECODE_ERRORS: Final = (OSError, SyntaxError, ValueError, EOFError, TypeError, KeyError,
                        IndexError, struct.error, UserWarning, RuntimeError)


class Problem(enum.Enum):
    """Why an input cannot be opened; one verdict, whoever asks."""

    UNREADABLE = "unreadable"  # Pillow cannot identify the bytes
    HEADER = "header"  # identified, but its header cannot be read
    BOMB = "bomb"  # Pillow's own decompression-bomb guard fired inside open()
    EMPTY = "empty"  # a zero width or height
    PIXELS = "pixels"  # over CAPS.max_pixels
    ASPECT = "aspect"  # too far from square: CAPS.max_aspect
    CORRUPT = "corrupt"  # its pixels cannot be decoded: corrupt or truncated
    DOCUMENT = "document"  # a PDF or TIFF whose structure cannot be read
    PAGE = "page"  # a page of a document that is out of range or cannot be drawn


class MediaError(VlmqError):
    """An input (or one page of it) cannot be opened. str(): the decode's message;
    `at_enqueue`: the producer's, completing "<file>: ..."; `page`: the page at fault."""

    def __init__(self, problem: Problem, message: str, *, at_enqueue: str | None = None,
                 page: int | None = None) -> None:
        self.problem = problem
        self.page = page
        self.at_enqueue = at_enqueue if at_enqueue is not None else message
        super().__init__(message)


# (decode, image) (decode, page) (enqueue, image) (enqueue, page), per problem. The fields:
# w, h, n (pixels), ratio, limit, aspect, page, detail (Pillow's words), named (": what
# the bytes are", or ""), unreadable (the producer's sentence for unidentified bytes).
_BOMB_AT_ENQUEUE = "image is larger than the {limit}-pixel limit (possible decompression bomb)"
_ASPECT = "is {w}x{h}, an aspect ratio of {ratio:.1f}; the vision processor needs it under {aspect}"
_TEXTS: Final[dict[Problem, tuple[str, str, str, str]]] = {
    Problem.UNREADABLE: ("not an image (cannot identify image file){named}",
                         "page {page}: corrupt TIFF directory ({detail})",
                         "{unreadable}",
                         "page {page}: starts like a TIFF but Pillow cannot read it"),
    Problem.HEADER: ("corrupt image header ({detail})",
                     "page {page}: corrupt TIFF directory ({detail})",
                     "is a corrupt or truncated image ({detail})",
                     "page {page}: is a corrupt or truncated TIFF page ({detail})"),
    Problem.BOMB: ("image rejected as a decompression bomb: {detail}",
                   "page {page} rejected as a decompression bomb: {detail}",
                   _BOMB_AT_ENQUEUE + " ({detail})",
                   "page {page}: " + _BOMB_AT_ENQUEUE + " ({detail})"),
    Problem.EMPTY: ("image has an empty size ({w}x{h})",
                    "page {page} has an empty size ({w}x{h})",
                    "image has an empty size ({w}x{h})",
                    "page {page}: has an empty size ({w}x{h})"),
    Problem.PIXELS: ("image is {w}x{h} = {n} pixels, over the limit of {limit} "
                     "(decompression bomb guard)",
                     "page {page} is {w}x{h} = {n} pixels, over the limit of {limit} "
                     "(decompression bomb guard)",
                     _BOMB_AT_ENQUEUE + ": {w}x{h}",
                     "page {page}: " + _BOMB_AT_ENQUEUE + ": {w}x{h}"),
    Problem.ASPECT: ("image " + _ASPECT, "page {page} " + _ASPECT,
                     "image " + _ASPECT, "page {page}: " + _ASPECT),
    Problem.CORRUPT: ("corrupt or truncated image ({detail})",
                      "page {page}: corrupt or truncated TIFF page ({detail})",
                      "is a corrupt or truncated image ({detail})",
                      "page {page}: is a corrupt or truncated TIFF page ({detail})"),
}


def frame_error(problem: Problem, *, page: int | None = None,
                size: tuple[int, int] = (0, 0), detail: object = "",
                head: bytes = b"") -> MediaError:
    """The MediaError for an image (page None) or a TIFF page, both phrasings from _TEXTS.
    `head`: the file's first bytes, which name an unidentified format (media/formats.py)."""
    w, h = size
    fields: dict[str, object] = {
        "w": w, "h": h, "n": w * h, "ratio": max(w, h) / max(1, min(w, h)),
        "limit": CAPS.max_pixels, "aspect": CAPS.max_aspect, "page": page,
        "detail": str(detail).strip(), "named": "", "unreadable": ""}
    if problem is Problem.UNREADABLE and page is None:
        what = formats.describe(head)
        fields["named"] = f": {what}" if what else ""
        fields["unreadable"] = formats.unreadable_problem(head)
    texts = _TEXTS[problem]
    at = 0 if page is None else 1
    return MediaError(problem, texts[at].format(**fields),
                      at_enqueue=texts[at + 2].format(**fields), page=page)


def check_size(width: int, height: int, *, page: int | None = None) -> None:
    """A frame of width x height against CAPS (MediaError when it is refused)."""
    size = (width, height)
    if width < 1 or height < 1:
        raise frame_error(Problem.EMPTY, page=page, size=size)
    if width * height > CAPS.max_pixels:
        raise frame_error(Problem.PIXELS, page=page, size=size)
    if max(width, height) / min(width, height) >= CAPS.max_aspect:
        raise frame_error(Problem.ASPECT, page=page, size=size)


@contextmanager
def strict_warnings(*, tiff: bool = False) -> Iterator[None]:
    """Pillow's warnings about a file as exceptions, so they refuse it rather than print:
    a bomb-sized canvas, and with `tiff` a page directory running past the end of the
    file (Pillow only warns: a truncated file). Changes the process's warning filters for
    the block: only where nothing else runs meanwhile."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        for message in ("Corrupt EXIF data", "Truncated File Read") if tiff else ():
            warnings.filterwarnings("error", message=message, category=UserWarning)
        yield


def _head(fp: IO[bytes]) -> bytes:
    fp.seek(0)
    return fp.read(formats.HEAD_BYTES)


def open_image(data: bytes | IO[bytes], *, page: int | None = None,
               tiff: bool = False) -> Image.Image:
    """Pillow's lazy open (the header only, nothing decoded), checked against CAPS.

    The frame it returns is the item (see the module's note on frames). `tiff`: read it
    as a TIFF only (a page from Document.page). Close it (`with`); a file passed in
    stays the caller's. MediaError for every refusal.
    """
    from PIL import Image, UnidentifiedImageError

    formats.register_plugins()  # HEIC/HEIF (pillow-heif), before the first open
    fp = io.BytesIO(data) if isinstance(data, bytes) else data
    fp.seek(0)
    try:
        im = Image.open(fp, formats=["TIFF"] if tiff else None)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own guard: an error past twice its limit, a warning past it.
        raise frame_error(Problem.BOMB, page=page, detail=exc) from exc
    except UnidentifiedImageError as exc:
        head = b"" if tiff else _head(fp)
        raise frame_error(Problem.UNREADABLE, page=page, detail=exc, head=head) from exc
    except DECODE_ERRORS as exc:
        raise frame_error(Problem.HEADER, page=page, detail=exc) from exc
    try:
        check_size(*im.size, page=page)
    except MediaError:
        im.close()
        raise
    return im


def decode(im: Image.Image, *, page: int | None = None, copy: bool = True) -> Image.Image:
    """The open frame's pixels decoded and turned upright (EXIF orientation): the image
    the model sees, in its own mode. `copy=False` turns `im` itself (no second image in
    memory, for a check that only needs the decode to succeed). MediaError on failure."""
    from PIL import ImageOps

    try:
        im.load()
        if not copy:
            ImageOps.exif_transpose(im, in_place=True)
            return im
        return ImageOps.exif_transpose(im)
    except DECODE_ERRORS as exc:
        raise frame_error(Problem.CORRUPT, page=page, detail=_decode_detail(im, exc)) from exc


def _decode_detail(im: Image.Image, exc: BaseException) -> str:
    """The decoder's words, and for a HEIF whose coded image libheif finds another size
    than its header (`ispe`) declares, that inconsistency named first: the file lies about
    its size, which is what the user needs to hear, not "memory allocation error"."""
    detail = str(exc).strip()
    if im.format == "HEIF" and "size" in detail.lower():
        w, h = im.size
        return (f"its header says {w}x{h} but the coded image is another size; "
                f"libheif: {detail}")
    return detail


def reduce_for(im: Image.Image, max_side: int | None) -> None:
    """Let libjpeg decode at 1/2, 1/4 or 1/8 scale when that still leaves the longest
    side >= max_side (a no-op for other formats and small images)."""
    w, h = im.size
    if max_side is not None and im.format == "JPEG" and max(w, h) > 2 * max_side:
        s = max_side / max(w, h)
        im.draft(None, (math.ceil(w * s), math.ceil(h * s)))


# -- TIFF pages --------------------------------------------------------------------------


def open_tiff(data: bytes | IO[bytes]) -> Document:
    """A TIFF's page index (media/tiff.py); MediaError when not even page 1 is reachable.
    A chain broken later is the index's `problem`: see unreachable()."""
    try:
        return Document(data)
    except TiffError as exc:
        raise MediaError(Problem.DOCUMENT, f"not a readable TIFF: the file {exc}",
                         at_enqueue=tiff_problem(exc), page=exc.page) from exc


def tiff_problem(exc: TiffError) -> str:
    """A broken page chain, phrased for the producer's refusal of the file."""
    if exc.page is None:
        return exc.problem
    return f"page {exc.page}: is a corrupt or truncated TIFF page ({exc.problem})"


def unreachable(index: Index, page: int) -> MediaError:
    """Page `page` (past the index's last) cannot be had: out of range, or past a break."""
    if index.problem is not None:
        return MediaError(Problem.PAGE, f"page {page} cannot be reached: the TIFF's page "
                                        f"chain stops after page {index.pages} "
                                        f"({index.problem})", page=page)
    return MediaError(Problem.PAGE, f"page {page} is out of range: the TIFF has "
                                    f"{index.pages} page(s)", page=page)


@contextmanager
def tiff_page(doc: Document, page: int) -> Iterator[Image.Image]:
    """Page `page` (1-based) of an indexed TIFF, opened as open_image opens an image
    (CAPS checked on that page's own header: a bomb on another page is not its problem).
    Decode it inside the block: its bytes are patched for this page only meanwhile."""
    if page > doc.pages:
        raise unreachable(doc.index, page)
    with doc.page(page) as fp, open_image(fp, page=page, tiff=True) as im:
        yield im


# -- PDF pages ---------------------------------------------------------------------------


def open_pdf(src: bytes | IO[bytes], *, own_handle: bool = False) -> pdfium.PdfDocument:
    """A PDF opened by PDFium, with at least one page; the caller holds PDFIUM_LOCK
    (media/pdfium.py) and closes it. PDFium reads a file as it needs; `own_handle` gives
    it a descriptor of its own, for a document kept after the caller's file is closed."""
    import pypdfium2 as pdfium

    what = "blob" if isinstance(src, bytes) else "file"
    own: IO[bytes] | None = None
    if own_handle and not isinstance(src, bytes):
        own = os.fdopen(os.dup(src.fileno()), "rb")
    try:
        pdf = pdfium.PdfDocument(src if own is None else own, autoclose=own is not None)
    except pdfium.PdfiumError as exc:
        if own is not None:
            own.close()
        head = src if isinstance(src, bytes) else _read_all(src)  # failure path only
        problem = open_problem(exc, head)
        raise MediaError(Problem.DOCUMENT, f"not a readable PDF: the {what} {problem}",
                         at_enqueue=problem) from exc
    if len(pdf) < 1:
        pdf.close()
        problem = "is a PDF with no pages"
        raise MediaError(Problem.DOCUMENT, f"not a readable PDF: the {what} {problem}",
                         at_enqueue=problem)
    return pdf


def _read_all(src: IO[bytes]) -> bytes:
    src.seek(0)
    return src.read(C.BLOB_MAX_BYTES)


def render_page(pdf: pdfium.PdfDocument, page: int, max_side: int, *,
                max_scale: float | None = None) -> Image.Image:
    """Page `page` (1-based) drawn in RGB with its longest side == max_side (or at
    `max_scale` points-to-pixels, if that is smaller). PDFIUM_LOCK held; page and bitmap
    are closed here, never left to garbage collection on some other thread."""
    import pypdfium2 as pdfium

    n = len(pdf)
    if not 1 <= page <= n:
        raise MediaError(Problem.PAGE, f"page {page} is out of range: the PDF has {n} "
                                       "page(s)", page=page)
    try:
        pg = pdf[page - 1]
    except pdfium.PdfiumError as exc:
        raise MediaError(Problem.PAGE, f"page {page} of {n} cannot be loaded ({exc})",
                         page=page) from exc
    try:
        w, h = pg.get_size()  # points, with the page's /Rotate already applied
        if not (w > 0 and h > 0):
            raise MediaError(Problem.PAGE, f"page {page} of {n} has an empty size "
                                           f"({w}x{h} pt)", page=page)
        scale = fit_scale(max(w, h), max_side)
        bitmap = pg.render(scale=scale if max_scale is None else min(scale, max_scale))
        try:
            img: Image.Image = bitmap.to_pil()
            return img.convert("RGB")  # a copy, independent of the bitmap buffer
        finally:
            bitmap.close()
    except pdfium.PdfiumError as exc:
        raise MediaError(Problem.PAGE, f"page {page} of {n} cannot be rendered ({exc})",
                         page=page) from exc
    finally:
        pg.close()


def fit_scale(longest_pt: float, max_side: int) -> float:
    """Largest scale whose rendered longest side is exactly max_side (pypdfium2 uses ceil)."""
    scale = max_side / longest_pt
    while math.ceil(longest_pt * scale) > max_side:
        scale = math.nextafter(scale, 0.0)
    return scale
