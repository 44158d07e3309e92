"""A PDF page's own text layer: extracted with PDFium, and judged before it is trusted.

Born-digital PDFs carry their exact text, and most bulk sets mix them with scans. With
`text_layer: prefer` a page whose layer passes `assess` skips the model; with `fallback`
a page the model fails gets the layer's text beside the failure. Extraction runs where
rendering does (the bounded render processes), so a hostile PDF costs a child, not the
worker. The checks are plain counts over the text, documented in the README:

- at least MIN_CHARS non-space characters (a blank page or a lone page number is not a
  reading of the page);
- at most MAX_BAD_SHARE of them broken: U+FFFD, control or private-use characters, which
  is what a font without a usable ToUnicode map extracts as;
- at least MIN_WORD_SHARE letters or digits (a layer of symbols or dingbats is not text);
- for `prefer` only, images cover under MAX_IMAGE_COVER of the page: a scan, even with an
  OCR layer of unknown quality on it, goes to the model. `fallback` takes such a layer,
  since any reading beats none once the model failed.

Only text a reader can see is a page's text (an invoice's visible "100.00
EUR" beside an invisible "1,000,000.00 EUR, pay to IBAN ..." made the invisible one the
result). Each character is judged by what PDFium says of it and of its text object:
hidden when its render mode draws nothing (3 invisible, 7 clip only), its box's centre is
off the page's visible box, its paint is fully transparent, or it is filled white with no
image under it (white on the bare page). Hidden characters are left out of the layer's
text, with one exception: invisible text over an image is that image's OCR layer (what
OCRmyPDF writes), kept for `fallback`. The rule for `prefer` is the simple one: a page
holding any character no reader sees is not taken at all, the model reads it, so a page
whose visible text is only part of its layer never passes for its reading. Not judged: a
clip path that hides text, and text under an opaque shape (both still count as seen).
"""

from __future__ import annotations

import ctypes
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c

MIN_CHARS = 20
MAX_BAD_SHARE = 0.02
MIN_WORD_SHARE = 0.5
MAX_IMAGE_COVER = 0.5
# A page holding more than this is not a page of text (and would be a huge result).
MAX_CHARS = 100_000
# Image objects looked at per page; a crafted page with millions stops being counted here.
MAX_IMAGE_OBJECTS = 10_000
# Of those, the largest this many are what "an image under this text" is checked against
# (a scan is one image; the cap keeps a page of tiny images from costing chars x images).
MAX_UNDER_IMAGES = 64
# A fill this close to white (each of r, g, b at least this) with no image under it is
# white on the bare page: unseen.
WHITE = 0xF0

_UNSEEN_MODES = frozenset({pdfium_c.FPDF_TEXTRENDERMODE_INVISIBLE,
                           pdfium_c.FPDF_TEXTRENDERMODE_CLIP})
_STROKE_ONLY = frozenset({pdfium_c.FPDF_TEXTRENDERMODE_STROKE,
                          pdfium_c.FPDF_TEXTRENDERMODE_STROKE_CLIP})
_FILL_ONLY = frozenset({pdfium_c.FPDF_TEXTRENDERMODE_FILL,
                        pdfium_c.FPDF_TEXTRENDERMODE_FILL_CLIP})
Box = tuple[float, float, float, float]  # left, bottom, right, top (PDF points)


@dataclass(frozen=True)
class Layer:
    """A page's extracted text and what the checks found; `problem` is None when usable."""

    text: str
    image_cover: float  # share of the page's area under image objects, 0..1
    problem: str | None
    hidden: int = 0  # characters on the page no reader sees (the module's note)

    def usable(self, mode: str) -> bool:
        """Whether `mode` ("fallback" or "prefer") takes this layer."""
        if self.problem is not None or mode == "off":
            return False
        return mode == "fallback" or (self.image_cover < MAX_IMAGE_COVER
                                      and self.hidden == 0)

    def why_not(self, mode: str) -> str:
        if self.problem is not None:
            return self.problem
        if mode == "prefer" and self.image_cover >= MAX_IMAGE_COVER:
            return (f"images cover {self.image_cover:.0%} of the page (a scan): "
                    "the model reads it")
        if mode == "prefer" and self.hidden:
            return (f"the page holds {self.hidden} character(s) of text no reader sees "
                    "(invisible, white or off the page): the model reads it")
        return "usable"

    def to_wire(self) -> dict[str, object]:
        return {"text": self.text, "image_cover": self.image_cover, "problem": self.problem,
                "hidden": self.hidden}

    @classmethod
    def from_wire(cls, raw: dict[str, object]) -> Layer:
        problem = raw.get("problem")
        cover = raw.get("image_cover")
        hidden = raw.get("hidden")
        return cls(text=str(raw.get("text") or ""),
                   image_cover=float(cover) if isinstance(cover, (int, float)) else 1.0,
                   problem=None if problem is None else str(problem),
                   # missing or unreadable: assume hidden text, so prefer never trusts it
                   hidden=hidden if isinstance(hidden, int) else 1)


def normalise(text: str) -> str:
    """PDFium's text with CRLF line ends, trailing spaces and runs of blank lines removed."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n")
             .split("\n")]
    out: list[str] = []
    for line in lines:
        if not line and out and not out[-1]:
            continue
        out.append(line)
    return "\n".join(out).strip("\n")


def _broken(ch: str) -> bool:
    if ch == "\ufffd":
        return True
    cat = unicodedata.category(ch)
    return cat in ("Cc", "Co", "Cn", "Cs") and ch not in "\t\n"


def assess(text: str, image_cover: float, hidden: int = 0) -> Layer:
    """The checks in the module docstring, on already-normalised text."""
    if len(text) > MAX_CHARS:
        return Layer("", image_cover, f"text layer holds {len(text)} characters, over "
                                      f"{MAX_CHARS}", hidden)
    chars = [c for c in text if not c.isspace()]
    n = len(chars)
    if n < MIN_CHARS:
        what = "no text layer" if n == 0 else f"text layer has only {n} character(s)"
        return Layer(text, image_cover, what, hidden)
    bad = sum(1 for c in chars if _broken(c))
    if bad / n > MAX_BAD_SHARE:
        return Layer(text, image_cover, f"text layer is broken: {bad} of {n} characters "
                                        "are unreadable (a font without a Unicode map)",
                     hidden)
    word = sum(1 for c in chars if unicodedata.category(c)[0] in "LN")
    if word / n < MIN_WORD_SHARE:
        return Layer(text, image_cover, f"text layer is mostly symbols: only {word} of {n} "
                                        "characters are letters or digits", hidden)
    return Layer(text, image_cover, None, hidden)


def _images(page: pdfium.PdfPage, box: Box) -> tuple[float, list[Box]]:
    """(share of the page under image objects, the largest images' boxes clipped to the
    page). Overlaps count twice (capped at 1), since a scan is one image over the page
    anyway."""
    x0, y0, x1, y1 = box
    area = max((x1 - x0) * (y1 - y0), 1e-9)
    covered = 0.0
    boxes: list[tuple[float, Box]] = []
    for i, obj in enumerate(page.get_objects(filter=(pdfium_c.FPDF_PAGEOBJ_IMAGE,),
                                             max_depth=3)):
        if i >= MAX_IMAGE_OBJECTS:
            break
        left, bottom, right, top = (float(v) for v in obj.get_bounds())
        clipped = (max(left, x0), max(bottom, y0), min(right, x1), min(top, y1))
        w, h = clipped[2] - clipped[0], clipped[3] - clipped[1]
        if w > 0 and h > 0:
            covered += w * h
            boxes.append((w * h, clipped))
    boxes.sort(key=lambda b: -b[0])
    return min(covered / area, 1.0), [b for _, b in boxes[:MAX_UNDER_IMAGES]]


def _inside(x: float, y: float, box: Box) -> bool:
    return box[0] <= x <= box[2] and box[1] <= y <= box[3]


class _Looks:
    """How each text object of a page is drawn, read once per object: "seen", "ocr"
    (invisible over an image: kept, but not seen) or "hidden" (the module's note)."""

    def __init__(self, images: Sequence[Box]) -> None:
        self.images = images
        self.cache: dict[int, str] = {}
        self._rgba = tuple(ctypes.c_uint() for _ in range(4))
        self._bounds = tuple(ctypes.c_float() for _ in range(4))

    def of(self, obj: pdfium_c.FPDF_PAGEOBJECT) -> str:
        key = ctypes.cast(obj, ctypes.c_void_p).value or 0
        look = self.cache.get(key)
        if look is None:
            look = self.cache[key] = self._judge(obj)
        return look

    def _over_image(self, obj: pdfium_c.FPDF_PAGEOBJECT) -> bool:
        left, bottom, right, top = self._bounds
        if not pdfium_c.FPDFPageObj_GetBounds(obj, left, bottom, right, top):
            return False
        x, y = (left.value + right.value) / 2, (bottom.value + top.value) / 2
        return any(_inside(x, y, box) for box in self.images)

    def _judge(self, obj: pdfium_c.FPDF_PAGEOBJECT) -> str:
        mode = pdfium_c.FPDFTextObj_GetTextRenderMode(obj)
        if mode in _UNSEEN_MODES:
            return "ocr" if self._over_image(obj) else "hidden"
        r, g, b, a = self._rgba
        paint = (pdfium_c.FPDFPageObj_GetStrokeColor if mode in _STROKE_ONLY
                 else pdfium_c.FPDFPageObj_GetFillColor)
        if not paint(obj, r, g, b, a):
            return "seen"  # no colour to judge by (a pattern): drawn, as far as we know
        if a.value == 0:
            return "hidden"
        white = min(r.value, g.value, b.value) >= WHITE
        if mode in _FILL_ONLY and white and not self._over_image(obj):
            return "hidden"
        return "seen"


def _seen_text(textpage: pdfium_c.FPDF_TEXTPAGE, box: Box, images: Sequence[Box]
               ) -> tuple[str, int]:
    """(the page's text without its hidden characters, how many it holds that no reader
    sees): PDFium's characters one by one (`textpage`: the raw FPDF_TEXTPAGE), each
    judged by its text object and its box."""
    looks = _Looks(images)
    left, right, bottom, top = (ctypes.c_double() for _ in range(4))
    chars: list[str] = []
    unseen = 0
    for i in range(pdfium_c.FPDFText_CountChars(textpage)):
        ch = chr(pdfium_c.FPDFText_GetUnicode(textpage, i))
        obj = pdfium_c.FPDFText_GetTextObject(textpage, i)
        if not obj:  # generated by PDFium (a space or line end between runs)
            chars.append(ch)
            continue
        look = looks.of(obj)
        if pdfium_c.FPDFText_GetCharBox(textpage, i, left, right, bottom, top) and not (
                _inside((left.value + right.value) / 2, (bottom.value + top.value) / 2,
                        box)):
            look = "hidden"  # off the page's visible box
        if look != "seen" and not ch.isspace():
            unseen += 1
        if look != "hidden":
            chars.append(ch)
    text = "".join(chars)
    if any("\ud800" <= c <= "\udfff" for c in text):  # a pair split into two characters
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text, unseen


def extract(pdf: pdfium.PdfDocument, page: int) -> Layer:
    """Page `page` (1-based) of an open document; the caller holds PDFIUM_LOCK. Raises
    IndexError for a page out of range and PdfiumError when the page cannot be loaded."""
    if not 1 <= page <= len(pdf):
        raise IndexError(f"page {page} is out of range: the PDF has {len(pdf)} page(s)")
    pg = pdf[page - 1]
    try:
        box: Box = tuple(float(v) for v in pg.get_bbox())  # type: ignore[assignment]
        cover, images = _images(pg, box)
        textpage = pg.get_textpage()
        try:
            count = pdfium_c.FPDFText_CountChars(textpage.raw)
            if count > 2 * MAX_CHARS:  # not read one by one: over the limit whatever it is
                return Layer("", cover, f"text layer holds {count} characters, over "
                                        f"{MAX_CHARS}", count)
            text, hidden = _seen_text(textpage.raw, box, images)
        finally:
            textpage.close()
        return assess(normalise(text), cover, hidden)
    finally:
        pg.close()
