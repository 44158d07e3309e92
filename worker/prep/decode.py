"""CPU-side input work (blob fetch, image decode, PDF page render), run in a thread pool.

Everything here is numpy/Pillow/PDFium only and never calls MLX: one other thread owns
every MLX call. Failures caused by the input raise PreprocessError with a message that names
the problem, so the worker can fail that one item and carry on with the job.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, TypeAlias, TypeVar

import numpy as np
import pypdfium2 as pdfium
from PIL import Image

from vlmq.media import opener, tiff
from vlmq.media.opener import MediaError
from vlmq.media.pdfium import PDFIUM_LOCK
from vlmq.shared.blobs import BlobStore
from vlmq.shared.errors import VlmqError
from vlmq.worker.prep import text_layer
from vlmq.worker.stats import COUNTERS

T = TypeVar("T")

# An input's bytes, or an open file holding exactly them (a referenced input's verified
# copy, stores/backends.py): a file is read as the decoder needs it, never whole into memory
# by vlmq. A function that fetches one is called only when the bytes are needed; what it
# returns is closed here. A file passed in directly stays the caller's to close.
Source: TypeAlias = bytes | IO[bytes]
Data: TypeAlias = Source | Callable[[], Source]

# Every pypdfium2 call holds the process-wide PDFIUM_LOCK (see vlmq.media.pdfium).

# Open documents kept per blob sha, so the pages of one PDF do not re-parse it each time.
# Each holds its bytes (up to BLOB_MAX_BYTES), hence the small bound.
PDF_DOC_CACHE_SIZE = 8  # >= the worker's default jobs in flight, so round-robin keeps hits
_DOCS: OrderedDict[str, pdfium.PdfDocument] = OrderedDict()

_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


class PreprocessError(VlmqError):
    """An input cannot be turned into an image; the message says why."""


def fetch_blob(blob_store: BlobStore, sha: str) -> bytes:
    """Fetch an input blob, verified against its sha256.

    A missing, expired or mismatching blob raises BlobError (a VlmqError: an item error);
    Redis connection errors propagate, since they are the worker's problem, not the item's.
    """
    return blob_store.get(sha)


# -- images ----------------------------------------------------------------------------


@contextmanager
def _source(data: Data) -> Iterator[Source]:
    """`data`'s bytes or file, fetched if it is a function; a file fetched here is closed
    after the block (one passed in is the caller's)."""
    if not callable(data):
        yield data
        return
    got = data()
    try:
        yield got
    finally:
        if not isinstance(got, bytes):
            got.close()


@contextmanager
def _item_errors() -> Iterator[None]:
    """The opener's refusal of an input (media/opener.py) as this item's PreprocessError,
    with the same message."""
    try:
        yield
    except MediaError as exc:
        raise PreprocessError(str(exc)) from exc


def check_side(max_side: int | None) -> None:
    """A caller's bug, not the input's: ValueError."""
    if max_side is not None and max_side < 1:
        raise ValueError(f"max_side must be >= 1, got {max_side}")


def check_page(page: int) -> None:
    """A page number under 1 is the item's error (PreprocessError)."""
    if page < 1:
        raise PreprocessError(f"page {page} is out of range (pages are numbered from 1)")


def decode_image(data: Data, max_side: int | None) -> Image.Image:
    """Decode an image to RGB, upright, with the longest side <= max_side (never upscaled).

    Opened by the one opener (media/opener.py): the caps are checked from the header,
    before any pixel is decoded, so a small file that claims a huge canvas costs nothing,
    and an animated image is its first frame. A file is read as the codec asks, so the
    tail a PNG ends before is never read.
    """
    check_side(max_side)
    COUNTERS.incr("image_decodes")
    with _item_errors(), _source(data) as src, opener.open_image(src) as im:
        opener.reduce_for(im, max_side)  # JPEG: libjpeg decodes at 1/2, 1/4 or 1/8 scale
        rgb = _rgb(opener.decode(im))
    return _bound(rgb, max_side)


def _rgb(im: Image.Image, page: int | None = None) -> Image.Image:
    """A decoded frame in RGB; a mode Pillow cannot convert is the frame's corruption."""
    try:
        return _to_rgb(im)
    except opener.DECODE_ERRORS as exc:
        raise opener.frame_error(opener.Problem.CORRUPT, page=page, detail=exc) from exc


def _to_rgb(im: Image.Image) -> Image.Image:
    """Convert any mode to RGB; transparency goes over white, the usual paper colour."""
    if im.mode == "RGB":
        return im
    if im.mode in (*_SIXTEEN_BIT, "I", "F"):
        return _wide_gray_to_rgb(im)
    if im.mode in _ALPHA_MODES or "transparency" in im.info:
        rgba = im.convert("RGBA")
        page = Image.new("RGB", rgba.size, (255, 255, 255))
        page.paste(rgba, mask=rgba.getchannel("A"))
        return page
    return im.convert("RGB")  # L, 1, P, CMYK, YCbCr, LAB, HSV


def _wide_gray_to_rgb(im: Image.Image) -> Image.Image:
    """Scale 16/32-bit grey to 8 bits; Pillow's own convert clips, turning scans white."""
    arr = np.asarray(im).astype(np.float64)
    if im.mode in _SIXTEEN_BIT or (im.mode == "I" and arr.size and arr.max() > 255):
        arr = arr / 257.0  # 0..65535 -> 0..255
    gray = np.clip(np.rint(arr), 0, 255).astype(np.uint8)
    return Image.fromarray(gray).convert("RGB")


def _bound(im: Image.Image, max_side: int | None) -> Image.Image:
    w, h = im.size
    if max_side is None or max(w, h) <= max_side:
        return im
    s = max_side / max(w, h)
    size = (max_side, max(1, round(h * s))) if w >= h else (max(1, round(w * s)), max_side)
    return im.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)


# -- TIFF pages ------------------------------------------------------------------------


# Open TIFFs (bytes and page index, media/tiff.py) by blob sha, so a 500-page fax is
# fetched and indexed once, not once per page; bounded by count and bytes.
TIFF_DOC_CACHE_SIZE = PDF_DOC_CACHE_SIZE
TIFF_BYTES_BUDGET = 256 * 1024 * 1024
_TIFFS: OrderedDict[str, tiff.Document] = OrderedDict()
_TIFFS_LOCK = threading.Lock()


def decode_tiff_page(data: Data, page: int, max_side: int | None, *,
                     doc_key: str | None = None) -> Image.Image:
    """Decode 1-based `page` (frame) of a TIFF to RGB, upright, longest side <= max_side.

    Any page costs what page 1 does: the document's page index (read once, kept with it)
    says where the page's directory is, and the page opens as a one-page TIFF. Only that
    directory is checked (the opener's caps) and only its pixels decoded, so a bomb on
    another page is not this item's problem. With `doc_key` (the blob's sha256) the bytes
    are fetched and indexed once for all the pages that follow.
    """
    check_side(max_side)
    check_page(page)
    COUNTERS.incr("image_decodes")
    with _item_errors():
        doc = _tiff_doc(data, doc_key)
        with opener.tiff_page(doc, page) as im:
            rgb = _rgb(opener.decode(im, page=page), page)
    return _bound(rgb, max_side)


def _tiff_doc(data: Data, doc_key: str | None) -> tiff.Document:
    """The open document for `doc_key`, else one opened from `data` (fetched outside the
    lock, so other pages go on meanwhile) and kept."""
    if doc_key is not None:
        with _TIFFS_LOCK:
            kept = _TIFFS.get(doc_key)
            if kept is not None:
                _TIFFS.move_to_end(doc_key)
                return kept
    with _source(data) as src:
        doc = opener.open_tiff(src)
    if doc_key is not None:
        with _TIFFS_LOCK:
            _TIFFS[doc_key] = doc
            _TIFFS.move_to_end(doc_key)
            # Dropped, not closed: a page of it may be decoding on another thread.
            while len(_TIFFS) > 1 and (len(_TIFFS) > TIFF_DOC_CACHE_SIZE or sum(
                    d.nbytes for d in _TIFFS.values()) > TIFF_BYTES_BUDGET):
                _TIFFS.popitem(last=False)
    return doc


def has_document(doc_key: str) -> bool:
    """True when this process has the PDF or TIFF open (its bytes need not be sent again)."""
    with _TIFFS_LOCK:
        if doc_key in _TIFFS:
            return True
    with PDFIUM_LOCK:
        return doc_key in _DOCS


# -- PDFs ------------------------------------------------------------------------------


def render_pdf_page(data: Data, page: int, max_side: int, *,
                    doc_key: str | None = None) -> Image.Image:
    """Render 1-based `page` of a PDF to RGB with its longest side == max_side.

    `doc_key` (the blob's sha256) lets the pages of one PDF reuse one open document; it
    must identify the bytes exactly. `data` may be a function that fetches them: it is
    called only when that document is not already open, so a 2,000-page PDF is fetched
    once, not once per page. Rendering holds PDFIUM_LOCK throughout, so PDF pages render
    one at a time per process; image decodes still run in parallel.
    """
    check_side(max_side)
    check_page(page)
    COUNTERS.incr("pdf_renders")
    return _with_pdf(data, doc_key, lambda pdf: _render(pdf, page, max_side))


def pdf_text_layer(data: Data, page: int, *, doc_key: str | None = None) -> text_layer.Layer:
    """Page `page`'s text layer, judged (worker/prep/text_layer.py); the same document cache
    and lock as render_pdf_page, so a page rendered and read shares one open document."""
    check_page(page)
    COUNTERS.incr("text_extracts")
    return _with_pdf(data, doc_key, lambda pdf: _extract(pdf, page))


def _with_pdf(data: Data, doc_key: str | None,
              use: Callable[[pdfium.PdfDocument], T]) -> T:
    """`use` the document under PDFIUM_LOCK: the open one for `doc_key` if any, else
    opened from `data` (fetched outside the lock, so other pages go on meanwhile)."""
    if callable(data) and doc_key is not None:
        with PDFIUM_LOCK:
            cached = _DOCS.get(doc_key)
            if cached is not None:
                _DOCS.move_to_end(doc_key)
                return use(cached)
    with _source(data) as src, PDFIUM_LOCK:
        pdf, owned = _open_pdf(src, doc_key)
        try:
            return use(pdf)
        finally:
            if owned:
                pdf.close()


def _extract(pdf: pdfium.PdfDocument, page: int) -> text_layer.Layer:
    """PDFIUM_LOCK held."""
    try:
        return text_layer.extract(pdf, page)
    except IndexError as exc:
        raise PreprocessError(str(exc)) from exc
    except pdfium.PdfiumError as exc:
        raise PreprocessError(f"page {page}'s text cannot be read ({exc})") from exc


def clear_pdf_cache() -> None:
    """Close every cached document (e.g. when the worker shuts down)."""
    with PDFIUM_LOCK:
        while _DOCS:
            _, pdf = _DOCS.popitem()
            pdf.close()


def _load_pdf(src: Source) -> pdfium.PdfDocument:
    """PDFium reads a file as it needs (lazily), through a descriptor of its own: the
    document may outlive the caller's file."""
    COUNTERS.incr("pdf_opens")
    with _item_errors():
        return opener.open_pdf(src, own_handle=True)


def _open_pdf(src: Source, doc_key: str | None) -> tuple[pdfium.PdfDocument, bool]:
    """PDFIUM_LOCK held. Returns (document, caller_must_close)."""
    if doc_key is None:
        return _load_pdf(src), True
    pdf = _DOCS.get(doc_key)
    if pdf is not None:
        _DOCS.move_to_end(doc_key)
        return pdf, False
    pdf = _load_pdf(src)
    _DOCS[doc_key] = pdf
    while len(_DOCS) > PDF_DOC_CACHE_SIZE:
        _, old = _DOCS.popitem(last=False)
        old.close()
    return pdf, False


def _render(pdf: pdfium.PdfDocument, page: int, max_side: int) -> Image.Image:
    """PDFIUM_LOCK held."""
    with _item_errors():
        return opener.render_page(pdf, page, max_side)
