"""An input's content checked at enqueue: what it is (PDF, TIFF, image) and that the
worker will be able to open it, by the same opener and caps (media/opener.py).

A bulk job that fails on page 4,000 of a worker's queue because one scan was truncated
costs hours; the producer is the cheap place to refuse it. Types are decided by content,
never by file name, since scans arrive with whatever extension the scanner chose. The
checks are stricter than the decode where that is cheap (PNG checksums, Pillow's
warnings about a truncated TIFF directory), never looser: whatever the worker refuses
for its size, shape or bytes is refused here first.

A reference (a file in a store, never uploaded) gets the light check (thorough=False): its
type, its header (a bomb by declared size, a canvas over the caps), a PDF's page count (a
truncated PDF still fails to open) and a TIFF's pages as always; an image's pixels are not
decoded. At 600-byte files the decode was a third of a reference's whole cost at enqueue,
and the worker decodes the image anyway: a truncated one fails its item with the same
message, and the job goes on.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import IO, Final

from vlmq.media import formats, opener
from vlmq.media.pdfium import PDFIUM_LOCK
from vlmq.media.tiff import MARKS
from vlmq.shared.errors import InputError

PDF_MAGIC: Final = b"%PDF-"
# The PDF spec lets the header sit anywhere in the first 1024 bytes (PDFium agrees).
PDF_HEADER_WINDOW: Final = 1024
PNG_SIGNATURE: Final = b"\x89PNG\r\n\x1a\n"
# Bit depths Pillow reads for each PNG colour type (the PNG spec's own table).
_PNG_DEPTHS: Final = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16),
                      6: (8, 16)}


class NotMedia(InputError):
    """A file that is neither a PDF nor an image, and whose name and first bytes do not
    claim to be one (formats.claims_media): a sidecar, a note, a video. A folder leaves it
    out; named on its own it is refused as before, with the same message."""


def refusal(source: str, problem: str, head: bytes,
            data: bytes | IO[bytes] | None = None) -> InputError:
    """The refusal of a file for its size alone (empty, over the blob limit): NotMedia when
    nothing says it is media, neither its name, its first bytes, nor (given `data`)
    Pillow's reading of its header, so a folder's 2 GB video or empty note is left out."""
    if formats.claims_media(source, head) or (data is not None and _identified(data)):
        return InputError(source, problem)
    return NotMedia(source, problem)


def _identified(data: bytes | IO[bytes]) -> bool:
    """Whether Pillow knows the format from the header (its caps may still refuse it)."""
    try:
        with opener.open_image(_stream(data)):
            return True
    except opener.MediaError as exc:
        return exc.problem is not opener.Problem.UNREADABLE


def is_tiff(head: bytes) -> bool:
    """A TIFF or BigTIFF, by its first four bytes (every byte-order mark Pillow accepts)."""
    return head[:4] in MARKS


def check_content(data: bytes | IO[bytes], head: bytes, source: str, *,
                  thorough: bool = True) -> tuple[str, int]:
    """(kind, pages) of an input by its content (`head`: its first bytes); InputError
    naming `source` and the problem. A file is read as the checks need (seekable; a TIFF
    must be the caller's own copy, since its pages are mapped). `thorough=False`: an
    image's header only (the module's note says when)."""
    try:
        if PDF_MAGIC in head:
            return "pdf", _pdf_page_count(data)
        if is_tiff(head):
            return "tiff", _check_tiff(data)
        if thorough:
            _check_image(data)
        else:
            _check_header(data)
        return "image", 1
    except opener.MediaError as exc:
        if exc.problem is opener.Problem.UNREADABLE and exc.page is None \
                and not formats.claims_media(source, head):
            raise NotMedia(source, exc.at_enqueue) from exc
        raise InputError(source, exc.at_enqueue) from exc


def _pdf_page_count(data: bytes | IO[bytes]) -> int:
    """Pages of a PDF given as bytes, or as a seekable file PDFium reads as it needs."""
    with PDFIUM_LOCK:
        pdf = opener.open_pdf(data)
        try:
            return len(pdf)
        finally:
            pdf.close()


def _stream(data: bytes | IO[bytes]) -> IO[bytes]:
    if isinstance(data, bytes):
        return io.BytesIO(data)
    data.seek(0)
    return data


def _check_header(data: bytes | IO[bytes]) -> None:
    """Pillow's lazy open: a known format, a header it can parse, a canvas within the
    caps (a bomb is refused by its declared size); nothing decoded. A PNG's header is
    read here directly (its signature, a well-formed IHDR with the right CRC, the caps),
    at a tenth of what Pillow's open costs; anything else, or a PNG header that is not
    plainly right, goes to Pillow, which then names the problem."""
    if isinstance(data, bytes) and _png_header_ok(data):
        return
    with opener.strict_warnings(), opener.open_image(_stream(data)):
        pass


# A PNG's first 33 bytes: signature, IHDR's length and type, width, height, bit depth,
# colour type, compression, filter, interlace, IHDR's CRC.
_PNG_HEAD: Final = struct.Struct(">8s8sIIBBBBBI")
_IHDR_START: Final = b"\x00\x00\x00\rIHDR"


def _png_header_ok(data: bytes) -> bool:
    """A PNG whose IHDR is well formed; its canvas is checked against the caps (MediaError
    as Pillow's open would raise). False: not plainly a good PNG header. One unpack of the
    33 bytes: at a million files, each step here is a second."""
    if len(data) < 33:
        return False
    sig, start, width, height, depth, colour, compression, filters, interlace, crc = (
        _PNG_HEAD.unpack_from(data))
    if sig != PNG_SIGNATURE or start != _IHDR_START or crc != zlib.crc32(data[12:29]):
        return False
    if depth not in _PNG_DEPTHS.get(colour, ()) or compression or filters or interlace > 1:
        return False
    caps = opener.CAPS
    if not (0 < width * height <= caps.max_pixels
            and max(width, height) / min(width, height) < caps.max_aspect):
        opener.check_size(width, height)  # raises, naming the problem
    return True


def _check_image(data: bytes | IO[bytes]) -> None:
    """Open lazily (refused by header size before decoding), verify, then decode.

    verify() checks what the format carries (PNG CRCs) without decoding pixels; the
    decode catches truncation. JPEG decodes at 1/8 scale: that still reads every byte,
    so a truncated file fails, at a fraction of the cost of a full decode.
    """
    with opener.strict_warnings():
        with opener.open_image(_stream(data)) as im:
            width, height = im.size
            try:
                im.verify()
            except opener.DECODE_ERRORS as exc:
                raise opener.frame_error(opener.Problem.CORRUPT, detail=exc) from exc
        with opener.open_image(_stream(data)) as im:
            im.draft("RGB", (max(1, width // 8), max(1, height // 8)))
            opener.decode(im, copy=False)


def _check_tiff(data: bytes | IO[bytes]) -> int:
    """Check every page of a TIFF, one at a time; returns the page count.

    A TIFF is a document, each page an item, so each page is checked as an image is (a
    bomb can hide in page 40 of a fax). The page chain is walked once (media/tiff.py) and
    each page opened directly, so every page costs what page 1 does. A loop in the chain,
    a directory past the end of the file or more than MAX_TIFF_PAGES pages refuses the
    file. Memory is one page's however many pages there are. Errors name the page.
    """
    doc = opener.open_tiff(data)
    if doc.index.problem is not None:
        raise opener.MediaError(opener.Problem.DOCUMENT, str(doc.index.problem),
                                at_enqueue=opener.tiff_problem(doc.index.problem))
    with opener.strict_warnings(tiff=True):
        for page in range(1, doc.pages + 1):
            with opener.tiff_page(doc, page) as im:
                opener.decode(im, page=page, copy=False)  # one page's pixels at a time
    return doc.pages
