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
"""

from __future__ import annotations

import unicodedata
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


@dataclass(frozen=True)
class Layer:
    """A page's extracted text and what the checks found; `problem` is None when usable."""

    text: str
    image_cover: float  # share of the page's area under image objects, 0..1
    problem: str | None

    def usable(self, mode: str) -> bool:
        """Whether `mode` ("fallback" or "prefer") takes this layer."""
        if self.problem is not None or mode == "off":
            return False
        return mode == "fallback" or self.image_cover < MAX_IMAGE_COVER

    def why_not(self, mode: str) -> str:
        if self.problem is not None:
            return self.problem
        if mode == "prefer" and self.image_cover >= MAX_IMAGE_COVER:
            return (f"images cover {self.image_cover:.0%} of the page (a scan): "
                    "the model reads it")
        return "usable"

    def to_wire(self) -> dict[str, object]:
        return {"text": self.text, "image_cover": self.image_cover, "problem": self.problem}

    @classmethod
    def from_wire(cls, raw: dict[str, object]) -> Layer:
        problem = raw.get("problem")
        cover = raw.get("image_cover")
        return cls(text=str(raw.get("text") or ""),
                   image_cover=float(cover) if isinstance(cover, (int, float)) else 1.0,
                   problem=None if problem is None else str(problem))


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


def assess(text: str, image_cover: float) -> Layer:
    """The checks in the module docstring, on already-normalised text."""
    if len(text) > MAX_CHARS:
        return Layer("", image_cover, f"text layer holds {len(text)} characters, over "
                                      f"{MAX_CHARS}")
    chars = [c for c in text if not c.isspace()]
    n = len(chars)
    if n < MIN_CHARS:
        what = "no text layer" if n == 0 else f"text layer has only {n} character(s)"
        return Layer(text, image_cover, what)
    bad = sum(1 for c in chars if _broken(c))
    if bad / n > MAX_BAD_SHARE:
        return Layer(text, image_cover, f"text layer is broken: {bad} of {n} characters "
                                        "are unreadable (a font without a Unicode map)")
    word = sum(1 for c in chars if unicodedata.category(c)[0] in "LN")
    if word / n < MIN_WORD_SHARE:
        return Layer(text, image_cover, f"text layer is mostly symbols: only {word} of {n} "
                                        "characters are letters or digits")
    return Layer(text, image_cover, None)


def _image_cover(page: pdfium.PdfPage) -> float:
    """Share of the page under image objects: their boxes clipped to the page, overlaps
    counted twice (capped at 1), since a scan is one image over the page anyway."""
    x0, y0, x1, y1 = (float(v) for v in page.get_bbox())
    area = max((x1 - x0) * (y1 - y0), 1e-9)
    covered = 0.0
    for i, obj in enumerate(page.get_objects(filter=(pdfium_c.FPDF_PAGEOBJ_IMAGE,),
                                             max_depth=3)):
        if i >= MAX_IMAGE_OBJECTS:
            break
        left, bottom, right, top = (float(v) for v in obj.get_bounds())
        w = min(right, x1) - max(left, x0)
        h = min(top, y1) - max(bottom, y0)
        if w > 0 and h > 0:
            covered += w * h
    return min(covered / area, 1.0)


def extract(pdf: pdfium.PdfDocument, page: int) -> Layer:
    """Page `page` (1-based) of an open document; the caller holds PDFIUM_LOCK. Raises
    IndexError for a page out of range and PdfiumError when the page cannot be loaded."""
    if not 1 <= page <= len(pdf):
        raise IndexError(f"page {page} is out of range: the PDF has {len(pdf)} page(s)")
    pg = pdf[page - 1]
    try:
        textpage = pg.get_textpage()
        try:
            text = normalise(textpage.get_text_bounded())
        finally:
            textpage.close()
        return assess(text, _image_cover(pg))
    finally:
        pg.close()
