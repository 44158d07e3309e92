"""The reader's task: what it was trained to read, as a seeded generator of pages.

Designed to be learnable in under an hour on 2 shared CPU cores: a page is a WIDTH x
HEIGHT label (16 x 2 vision tokens at the processor's 28 px cells) holding one line of
up to 16 upper-case letters, digits and a little punctuation, in 4 monospaced fonts
sized so that every character is one cell wide (28 px), set from the left edge, with
dark ink on light paper. Character k then sits in token column k: M-RoPE gives text
token k and image column k a fixed relative position, so the tiny model learns where
to look in minutes rather than hours. The text is the answer.
Training, the benchmark, the tests and the demo's sample all draw from here, so they
cannot drift apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache, lru_cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

WIDTH = 448
HEIGHT = 56
CELL = 28  # one character per vision-token column
CHARSET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:-/"
MAX_LINE = WIDTH // CELL  # 16 characters
FONT_DIRS = (Path("/usr/share/fonts/truetype/dejavu"), Path("/usr/share/fonts/truetype/liberation"))
FONTS = ("DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "LiberationMono-Regular.ttf",
         "LiberationMono-Bold.ttf")
FONT_HINT = "apt-get install fonts-dejavu-core fonts-liberation"

_WORD_TEXT = (
    "THE OF AND TO IN IS IT FOR ON WITH AS AT BY FROM OR AN BE THIS THAT ARE WAS NOT ALL "
    "PAGE TOTAL DATE NAME ORDER ITEM PRICE QTY UNIT SHIP TO BILL NOTE DUE PAID TAX NET "
    "INVOICE RECEIPT ACCOUNT NUMBER CODE REF FORM FILE BOX ROOM FLOOR STREET ROAD CITY "
    "NORTH SOUTH EAST WEST PARK LAKE RIVER HILL MAIN OLD NEW RED BLUE GREEN BLACK WHITE "
    "QUEUE WORKER BATCH CACHE MODEL IMAGE TEXT LINE READ WRITE SEND KEEP OPEN CLOSE START "
    "STOP WAIT JOB JOBS RESULT ERROR RETRY LIMIT SCALE PRINT SCAN COPY MAIL CALL TIME "
    "MONDAY FRIDAY MARCH APRIL JUNE JULY AUGUST OCTOBER WINTER SUMMER YEAR WEEK DAY HOUR "
    "QUICK BROWN FOX JUMPS OVER LAZY DOG ZERO ONE TWO THREE FOUR FIVE SIX SEVEN EIGHT NINE "
    "TEN HUNDRED VOLUME CHAPTER SECTION TABLE FIGURE REPORT SUMMARY PLAN GOAL TEAM HELLO"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class Page:
    """One rendered page and the text on it."""

    image: Image.Image
    text: str


@cache
def font_path(name: str) -> Path:
    for folder in FONT_DIRS:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"font {name} not found in {[str(d) for d in FONT_DIRS]}; "
                            f"{FONT_HINT}")


@lru_cache(maxsize=64)
def _font(name: str, size: float) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(font_path(name)), size)


def _token(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.65:
        return rng.choice(_WORDS)
    if roll < 0.85:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 5)))
    if roll < 0.93:
        a, b = rng.randint(1, 31), rng.randint(1, 12)
        return f"{a:02d}-{b:02d}" if rng.random() < 0.5 else f"{a}/{b}"
    return "".join(rng.choice(CHARSET[:36]) for _ in range(rng.randint(2, 6)))


def random_line(rng: random.Random, longest: int = MAX_LINE) -> str:
    """A line of words, numbers and codes, at most `longest` characters."""
    target = rng.randint(min(6, longest), longest)
    line = ""
    while True:
        word = _token(rng)
        if rng.random() < 0.15:
            word += rng.choice(".,:")
        joined = f"{line} {word}" if line else word
        if len(joined) > longest:
            return line or word[:longest]
        line = joined
        if len(line) >= target:
            return line


def random_text(rng: random.Random, longest: int = MAX_LINE) -> str:
    return random_line(rng, longest)


@cache
def font_size(name: str) -> float:
    """The size at which `name`'s advance is exactly one CELL."""
    return CELL * 100 / _font(name, 100).getlength("M")


def render(text: str, rng: random.Random, font: str | None = None) -> Image.Image:
    """`text` (one line) on a WIDTH x HEIGHT label, one character per CELL."""
    name = font if font is not None else rng.choice(FONTS)
    face = _font(name, font_size(name))
    top = -round(face.getmetrics()[0] - CELL * 1.42)  # the ascender above the image edge
    x, y = rng.randint(1, 5), top + rng.randint(-2, 3)
    paper = rng.randint(225, 255)
    ink = rng.randint(0, 60)
    im = Image.new("RGB", (WIDTH, HEIGHT), (paper, paper, paper))
    ImageDraw.Draw(im).text((x, y), text, font=face, fill=(ink, ink, ink))
    return im


def page(rng: random.Random, font: str | None = None, longest: int = MAX_LINE) -> Page:
    text = random_text(rng, longest)
    return Page(render(text, rng, font), text)


def pages(seed: int, n: int) -> list[Page]:
    """`n` pages from `seed`: the same seed gives the same pages (held-out sets use seeds
    the training run never draws)."""
    rng = random.Random(seed)
    return [page(rng) for _ in range(n)]


def cer(read: str, truth: str) -> float:
    """Character error rate: edit distance over the true text's length."""
    if not truth:
        return float(bool(read))
    prev = list(range(len(truth) + 1))
    for i, a in enumerate(read, 1):
        cur = [i]
        for j, b in enumerate(truth, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a != b)))
        prev = cur
    return prev[-1] / len(truth)


def born_digital_pdf(texts: list[str], rng: random.Random, font: str = FONTS[0]) -> bytes:
    """A PDF with one WIDTH x HEIGHT pt page per text, typed (a real text layer) in `font`:
    rendered with its longest side at WIDTH px it is a page like the training ones.
    Needs fpdf2 (a dev dependency): samples and tests use it, the product does not."""
    import fpdf

    pdf = fpdf.FPDF(unit="pt", format=(WIDTH, HEIGHT))
    pdf.creation_date = datetime(2026, 1, 1, tzinfo=UTC)  # same texts, same bytes
    pdf.set_auto_page_break(False)
    pdf.set_margin(0)
    pdf.add_font("reader", fname=str(font_path(font)))
    pdf.set_font("reader", size=font_size(font))
    for text in texts:
        pdf.add_page()
        pdf.text(rng.randint(1, 5), CELL * 1.42 + rng.randint(-2, 3), text)  # at its baseline
    return bytes(pdf.output())
